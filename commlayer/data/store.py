"""ShardStore: one rank's part of a dataset, samples keyed by their global index.

In memory (``path=None``), or at a path (``{rank}`` in it keeps the ranks of one host apart):
a folder the store wrote (pack files and their index, packs.py; ``samples/<id>.pkl`` from
before them is still read), an ImageFolder-like folder or one .npy/.npz array file already
staged per rank (layouts.py). An exchange changes a store in two phases, so that a rank dying
mid-exchange loses no sample (the shuffler runs the vote between them):

1. ``stage``: received samples wait apart (a staging pack); the samples sent stay.
   ``prepare`` records both lists in the store's journal (state "prepared").
2. After every rank voted that it staged all it expected, ``commit`` records "committed", drops
   the samples sent, takes in the staged ones and records the new epoch. With no vote, ``abort``
   drops what was staged.

``recover`` finishes an interrupted exchange the way every rank decides together (forward when
any rank had committed, else back). Files are replaced atomically (``os.replace``); there is no
fsync: this survives a process dying, not the host losing power.

Opening a path is collective (every rank opens its store at once): the ranks number the samples
of ImageFolder-like folders and array files opened the first time (rank 0's first, ids after
any already numbered), agree on the class names, and a rank that cannot open its store makes
every rank fail, naming it and the file, instead of leaving the others waiting.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from commlayer import state_sync
from commlayer.common.errors import ShardStoreError, ShuffleMismatchError
from commlayer.core import runtime
from commlayer.data import packs as packs_mod
from commlayer.data.layouts import (
    ARRAY_SUFFIXES,
    ArrayFile,
    ImageFolder,
    LayoutError,
    Memory,
    PackFiles,
    PickleFiles,
    decode,
    encode,
)
from commlayer.data.packs import PackSet

log = logging.getLogger("commlayer")

__all__ = ["ShardStore", "decode", "encode", "partition"]

_opens = itertools.count()  # every rank opens its stores in the same order
_Layout = Memory | PackFiles | PickleFiles | ImageFolder | ArrayFile


def partition(
    num_samples: int, size: int, how: str | Sequence[Sequence[int]] = "random", seed: int = 0
) -> list[list[int]]:
    """The initial shards: ``"random"`` (a seeded permutation), ``"given"`` (the dataset's own
    order cut into ``size`` contiguous parts, e.g. sorted by class to model site-local data),
    or explicit index lists, one per rank. Rank r gets N // M samples, one more when r < N % M."""
    if not isinstance(how, str):
        shards = [list(map(int, shard)) for shard in how]
        if len(shards) != size:
            raise ValueError(f"partition has {len(shards)} shards for {size} ranks")
        return shards
    order = list(range(num_samples))
    if how == "random":
        random.Random(f"commlayer.data.partition:{seed}").shuffle(order)
    elif how != "given":
        raise ValueError(f"partition {how!r} is not one of 'random', 'given' or index lists")
    bounds = [r * (num_samples // size) + min(r, num_samples % size) for r in range(size + 1)]
    return [order[bounds[r] : bounds[r + 1]] for r in range(size)]


class ShardStore:
    """A rank's samples by global id (see the module docstring)."""

    __slots__ = ("path", "epoch", "layout", "_pending")

    def __init__(
        self, path: str | os.PathLike[str] | None = None, loader: Callable[[str], Any] | None = None
    ) -> None:
        """Open the store at ``path`` (collective), or an empty one in memory when ``path`` is
        None. ``loader(file)`` reads an ImageFolder sample (default: an RGB uint8 tensor)."""
        self.path = None if path is None else Path(str(path).format(rank=runtime.rank()))
        self.epoch = 0
        self._pending: dict[str, Any] | None = None
        self.layout: _Layout = Memory()
        if self.path is not None:
            self._open(self.path, loader)

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        path: str | os.PathLike[str] | None = None,
        partition_by: str | Sequence[Sequence[int]] = "random",
        seed: int = 0,
        overwrite: bool = False,
    ) -> ShardStore:
        """Keep this rank's part of ``dataset`` (every rank passes the same one) in memory
        (``path=None``) or in pack files at ``path``. Collective: the ranks first compare their
        dataset's length (ShuffleMismatchError on every rank where they differ: the partitions
        would leave samples out or in two stores), and with a path, open the store together.

        Where every rank already has a store at ``path`` (a job run again), ``overwrite``
        decides: False (the default) opens those stores as the last run left them, so training
        resumes with the shards its exchanges made (an interrupted exchange is finished when the
        shuffler is built), after checking that they hold ``len(dataset)`` samples in all
        (ShardStoreError otherwise); True removes them and writes the shards anew from
        ``dataset`` (``partition_by`` and ``seed`` as given). Either way rank 0 logs which
        (logger ``commlayer``, level WARNING, shown by default). Where only some ranks have a
        store, every rank writes anew (the old shards do not fit together), and logs it.
        """
        me, size = runtime.rank(), runtime.size()
        lengths = state_sync.allgather_object(
            len(dataset), name=f"commlayer.data.store{next(_opens)}.from_dataset"
        )
        if len(set(lengths)) > 1:
            shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
            raise ShuffleMismatchError(
                f"rank {me}: ShardStore.from_dataset needs the same dataset on every rank; "
                f"got datasets of {shown} samples"
            )
        if path is None:
            shard = partition(len(dataset), size, partition_by, seed)[me]
            store = cls(None)
            store.layout = Memory({i: dataset[i] for i in shard})
            return store
        folder = Path(str(path).format(rank=me))
        found = (folder / "store.json").exists()
        everyone = state_sync.allgather_object(
            found, name=f"commlayer.data.store{next(_opens)}.existing"
        )
        if all(everyone) and not overwrite:
            store = cls(folder)
            if me == 0:
                log.warning(
                    "ShardStore.from_dataset: opening the existing shard stores at %s as the "
                    "last run left them (epoch %d); overwrite=True writes them anew",
                    path,
                    store.epoch,
                )
            held = state_sync.allgather_object(
                len(store), name=f"commlayer.data.store{next(_opens)}.held"
            )
            if sum(held) != len(dataset):
                raise ShardStoreError(
                    f"rank {me}: the existing stores at {str(path)!r} hold {sum(held)} samples "
                    f"in all, the dataset {len(dataset)}: pass overwrite=True to write them anew"
                )
            return store
        if any(everyone) and me == 0:
            log.warning(
                "ShardStore.from_dataset: replacing the existing shard stores at %s (%s)",
                path,
                "overwrite=True"
                if overwrite
                else f"only ranks {[r for r, f in enumerate(everyone) if f]} have one",
            )
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        shard = partition(len(dataset), size, partition_by, seed)[me]
        # written in a seeded random order: the oldest-first sending (packs.py) then sends a
        # random part of the shard, whatever order the partition gave (class-sorted: "given")
        random.Random(f"commlayer.data.write:{seed}:{me}").shuffle(shard)
        records: Iterator[tuple[int, bytes]] = ((i, encode(dataset[i])) for i in shard)
        first = next(records, None)
        pack_bytes = packs_mod.MIN_PACK_BYTES
        if first is not None:
            records = itertools.chain([first], records)
            shard_bytes = len(first[1]) * len(shard)  # estimated from the first sample
            pack_bytes = max(pack_bytes, shard_bytes // packs_mod.PACKS_PER_SHARD)
        packs = PackSet(folder, None, folder / "store.json")
        packs.write_all(records, pack_bytes)
        packs.persist(ending=True)
        meta = {"epoch": 0, "pending": None, "layout": {"packs": packs.state()}}
        (folder / "store.json").write_text(json.dumps(meta))
        return cls(folder)

    # -- reading -----------------------------------------------------------------------------
    def ids(self) -> list[int]:
        return sorted(self._call(self.layout.ids))

    def groups(self) -> list[list[int]]:
        """The samples by age, oldest group first: pack by pack for pack files (the plan sends
        the oldest first, so whole packs die: packs.py); one group for the other layouts (an
        array file: its rows, then its packs)."""
        groups = getattr(self.layout, "groups", None)
        return self._call(groups) if groups is not None else [self.ids()]

    def __len__(self) -> int:
        return len(self.ids())

    def load(self, sample_id: int) -> Any:
        """The sample ``sample_id`` (errors name the rank and the file)."""
        return self._call(self.layout.load, sample_id)

    def dump(self, sample_id: int) -> bytes:
        """The sample's bytes as they travel (a file's content, as is, where there is one)."""
        return self._call(self.layout.dump, sample_id)

    # -- the two-phase change ----------------------------------------------------------------
    def stage(self, sample_id: int, data: bytes) -> None:
        """Phase 1: keep a received sample apart until ``commit``."""
        self.layout.stage(sample_id, data)

    def staged(self) -> list[int]:
        return sorted(self._call(self.layout.staged))

    def prepare(self, epoch: int, sent: Iterable[int], received: Iterable[int]) -> None:
        """Phase 1 done: record what the exchange of ``epoch`` moves."""
        self._pending = {
            "epoch": epoch,
            "state": "prepared",
            "sent": sorted(sent),
            "received": sorted(received),
        }
        self._save()

    def commit(self) -> None:
        """Phase 2 (every rank voted yes): drop what was sent, take in what was staged."""
        pending = self._pending
        if pending is None:
            return
        pending["state"] = "committed"
        self._save()
        for i in pending["sent"]:
            self.layout.remove(i)
        staged = set(self.staged())
        for i in pending["received"]:
            if i in staged:  # not staged: taken in already by a commit that was interrupted
                self._call(self.layout.take, i)
        self.epoch = int(pending["epoch"]) + 1
        self._end_exchange(unlink_later=True)

    def compact(self) -> bool:
        """Rewrite the pack files holding samples sent away where the store's overhead would
        pass 8% (packs.py), then save the journal naming the new index; True when it did. Then
        unlink the files the saved state no longer names (the last commit leaves them). Not
        during an exchange's staging; the shuffler runs it on its I/O thread after each
        commit."""
        if not self._call(self.layout.compact):
            self._call(self.layout.drop_superseded)  # what the last commit left (pack files)
            return False
        self._save()
        self._call(self.layout.drop_superseded)
        return True

    def compacted_bytes(self) -> int:
        """The bytes compactions copied since the store was opened (0 without pack files)."""
        packs = getattr(self.layout, "packs", None)
        return packs.copied if isinstance(packs, PackSet) else 0

    def stray_files(self) -> list[Path]:
        """Files in the store's folder that its saved state does not name: what an interrupted
        exchange left behind, before the recovery removed it (none after)."""
        return list(self._call(self.layout.stray_files))

    def disk_bytes(self) -> tuple[int, int]:
        """(bytes the store's files take on disk, in allocated blocks; the samples' own bytes,
        as encoded) for a store written by ``from_dataset`` (pack files): every file and
        folder under its folder counts."""
        layout = self.layout
        if not isinstance(layout, PackFiles):
            raise ShardStoreError(f"rank {runtime.rank()}: disk_bytes needs a pack-file store")
        on_disk = 0
        for root, dirs, files in os.walk(layout.folder):
            for name in dirs + files:
                on_disk += os.lstat(os.path.join(root, name)).st_blocks * 512
        return on_disk, layout.packs.live_bytes()

    def storage(self) -> dict[str, float]:
        """What a store written by ``from_dataset`` (pack files) takes on disk:
        ``samples_bytes``, the samples' own bytes (codec.py: the arrays' ``nbytes`` and 8 per
        number, a pickled sample's bytes); ``file_bytes``, the sizes of every file under the
        store's folder (packs, index, journal); ``disk_bytes``, the blocks they and the folders
        take; ``overhead`` = file_bytes / samples_bytes - 1 and ``disk_overhead`` likewise (a
        small shard's files each round up to the file system's block: 4 kB on ext4 and tmpfs,
        +4% of a 95 kB shard per file); ``compacted_bytes``: what compactions copied so far."""
        layout = self.layout
        if not isinstance(layout, PackFiles):
            raise ShardStoreError(f"rank {runtime.rank()}: storage() needs a pack-file store")
        files = disk = 0
        for root, dirs, names in os.walk(layout.folder):
            for name in dirs + names:
                info = os.lstat(os.path.join(root, name))
                disk += info.st_blocks * 512
                files += info.st_size if name in names else 0
        own = layout.packs.own_bytes()
        return {
            "samples_bytes": own,
            "file_bytes": files,
            "disk_bytes": disk,
            "overhead": files / own - 1 if own else 0.0,
            "disk_overhead": disk / own - 1 if own else 0.0,
            "compacted_bytes": layout.packs.copied,
        }

    def abort(self) -> None:
        """No vote: forget what was staged; the store is as before the exchange."""
        self._end_exchange()

    def journal(self) -> dict[str, Any]:
        """What ``recover`` needs from this rank: its epoch and its exchange in progress."""
        return {"epoch": self.epoch, "pending": self._pending}

    def recover(self, journals: Sequence[dict[str, Any]]) -> None:
        """Finish an interrupted exchange as every rank decides from all ranks' journals: forward
        when any rank had committed it (so all had staged it), else back."""
        pending = self._pending
        if pending is None:
            self.layout.drop_staged()
            return
        forward = any(
            j["epoch"] > pending["epoch"]
            or (j["pending"] is not None and j["pending"]["state"] == "committed")
            for j in journals
        )
        if forward:
            self.commit()
            self.layout.drop_staged()  # what the commit leaves to the next compact(): now
        else:
            self.abort()

    # -- opening -----------------------------------------------------------------------------
    def _open(self, path: Path, loader: Callable[[str], Any] | None) -> None:
        """Open this rank's layout, then agree with every rank (module docstring)."""
        error = None
        try:
            self.layout = self._layout(path, loader)
        except ShardStoreError as exc:
            error = str(exc)
        except OSError as exc:
            error = str(self._error(f"cannot open {str(path)!r}: {exc}"))
        gathered = state_sync.allgather_object(
            (error, self._numbering()), name=f"commlayer.data.store{next(_opens)}.open"
        )
        errors = [e for e, _ in gathered if e is not None]
        if errors:
            raise ShardStoreError(
                error
                if error is not None
                else f"rank {runtime.rank()}: another rank cannot open its store: "
                + "; ".join(errors)
            )
        self._number([n for _, n in gathered])

    def _layout(self, path: Path, loader: Callable[[str], Any] | None) -> _Layout:
        if path.suffix in ARRAY_SUFFIXES and path.is_file():
            state = self._read_meta(path.with_name(path.name + ".store") / "store.json")
            return self._call(ArrayFile, path, state)
        if (path / "packs").is_dir():
            state = self._read_meta(path / "store.json")
            return self._call(PackFiles, path, state)
        if (path / "samples").is_dir():
            self._read_meta(path / "store.json")
            return self._call(PickleFiles, path)
        if path.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in path.iterdir()):
            state = self._read_meta(path / ".commlayer-store.json")
            leaving = self._pending["sent"] if self._pending else ()
            return self._call(ImageFolder, path, state, loader, leaving)
        raise self._error(
            f"{str(path)!r} holds no shard store: not a folder written by "
            "ShardStore.from_dataset (with 'samples/'), not an ImageFolder-like folder "
            f"(<class>/<file>) and not an array file ({', '.join(ARRAY_SUFFIXES)})"
        )

    def _read_meta(self, meta: Path) -> dict[str, Any] | None:
        """The journal's epoch and exchange in progress; returns the layout's saved state."""
        if not meta.exists():
            return None
        try:
            saved = json.loads(meta.read_text())
            self.epoch, self._pending = int(saved["epoch"]), saved["pending"]
            return dict(saved["layout"]) if "layout" in saved else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise self._error(f"cannot read {str(meta)!r}: {exc}") from exc

    def _numbering(self) -> dict[str, Any] | None:
        """What the ranks need to number new samples: how many, their classes, the ids used."""
        layout = self.layout
        if isinstance(layout, Memory):
            return None  # a rank that could not open its store
        return {
            "new": 0 if layout.numbered else len(layout.found),
            "classes": layout.local_classes() if isinstance(layout, ImageFolder) else None,
            "max_id": max(self._call(layout.ids), default=-1) if layout.numbered else -1,
        }

    def _number(self, everyone: list[dict[str, Any] | None]) -> None:
        first = 1 + max((n["max_id"] for n in everyone if n), default=-1)
        me = runtime.rank()
        first += sum(n["new"] for n in everyone[:me] if n)
        classes = sorted({c for n in everyone if n and n["classes"] for c in n["classes"]})
        layout = self.layout
        if isinstance(layout, ArrayFile) and not layout.numbered:
            layout.number(first)
        elif isinstance(layout, ImageFolder):
            if not layout.numbered:
                layout.number(first, classes)
            elif layout.classes != classes:
                raise self._error(
                    f"the class folders of all ranks, {classes}, differ from those this store "
                    f"was numbered with, {layout.classes}: reopen every rank's folder fresh "
                    f"(remove {str(layout.meta_file)!r})"
                )
        self._save()

    # -- files -------------------------------------------------------------------------------
    def _save(self) -> None:
        meta = self.layout.meta_file
        if meta is None:
            return
        self._call(self.layout.persist, self._pending is None)
        tmp = meta.with_suffix(".tmp")
        record = {"epoch": self.epoch, "pending": self._pending, "layout": self.layout.state()}
        tmp.write_text(json.dumps(record))
        os.replace(tmp, meta)

    def _end_exchange(self, unlink_later: bool = False) -> None:
        """``unlink_later`` (a commit): pack files the new index no longer names (the packs
        whose samples were all sent) are left to the next ``compact``, which the shuffler runs
        on its I/O thread: unlinking them took 2-6 ms of the training thread's set_epoch on
        ext4. They are files no saved state names, as after a kill: a reopening removes them."""
        self._pending = None
        self._save()
        if unlink_later and isinstance(self.layout, PackFiles | ArrayFile):
            self._call(self.layout.packs.forget_staged)
        else:
            self.layout.drop_staged()

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, its LayoutError raised as a ShardStoreError naming this rank."""
        try:
            return function(*args)
        except LayoutError as exc:
            raise self._error(str(exc)) from exc

    def _error(self, what: str) -> ShardStoreError:
        return ShardStoreError(f"rank {runtime.rank()}: shard store: {what}")
