"""Layouts: how a shard store's samples sit in memory or on disk.

A ShardStore (store.py) runs the two-phase exchange; its layout keeps the samples:

- ``Memory``: a dict (``path=None``).
- ``PackFiles``: append-only pack files with an index under a folder (packs.py; what
  ``from_dataset`` writes): received samples are appended to a new pack, not a file each.
- ``PickleFiles``: ``samples/<global id>.pkl`` under a folder (stores written before pack
  files; still read and exchanged).
- ``ImageFolder``: files already staged per rank as ``<class>/<file>`` (torchvision's layout);
  samples are ``(loader(file), class index)``, class indices numbered over the union of every
  rank's class folders. Received samples are staged in a pack under ``.commlayer-incoming/`` and
  written into their class folder at the commit, so the folder stays ImageFolder-like; its index
  of ids lives in ``.commlayer-store.json``.
- ``ArrayFile``: one ``.npy`` (sample i is row i) or ``.npz`` (sample i is the tuple of row i of
  each array, in the file's order); the file is only read, received samples (in pack files) and
  the ids of the rows sent away are kept in ``<file>.store/`` beside it.

Every layout stages received samples apart (``stage``) and takes them in at ``commit`` with
``take`` after ``remove`` dropped the samples sent. Both are idempotent: a commit interrupted
by a dying process is redone from the journal. The staged bytes of a sample are removed only
after the store saved the layout's new state (``_end_exchange``), so a redo still finds them.
``persist(ending)`` runs before each save of the journal (packs: flush, write the new index).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from commlayer.data.codec import decode, encode, tensor
from commlayer.data.packs import LayoutError, PackSet

SUFFIX = ".pkl"
ARRAY_SUFFIXES = (".npy", ".npz")


def read_bytes(file: Path, sample_id: int) -> bytes:
    """A sample file's content; an error names the sample and the file (the store adds the
    rank)."""
    try:
        return file.read_bytes()
    except OSError as exc:
        raise LayoutError(f"cannot read sample {sample_id} from {str(file)!r}: {exc}") from exc


def image_loader(path: str) -> torch.Tensor:
    """The default ImageFolder loader: an RGB uint8 tensor, channels first (PIL decodes)."""
    from PIL import Image

    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def default_image_loader() -> Callable[[str], torch.Tensor]:
    """``image_loader``, once Pillow is known to be importable: a store opened without it
    fails at once, naming the extra, not at the first sample an exchange or a reader decodes."""
    if importlib.util.find_spec("PIL") is None:
        raise LayoutError(
            "an ImageFolder-like store decodes its images with Pillow, which is not installed: "
            "pip install 'commlayer[images]' (or pass loader= to read the files yourself)"
        )
    return image_loader


class _Staging:
    """Received samples kept as files under ``incoming/`` until the commit."""

    incoming: Path

    def stage(self, sample_id: int, data: bytes) -> None:
        # Written in place, no temporary file and rename: a file cut short by a dying process
        # is never taken in, since the vote that allows the commit comes after every write
        # (one file operation less per sample: 1.8-4 ms each on this VM's ext4).
        self.incoming.mkdir(parents=True, exist_ok=True)
        (self.incoming / f"{sample_id}{SUFFIX}").write_bytes(data)

    def staged(self) -> list[int]:
        return ids_in(self.incoming)

    def drop_staged(self) -> None:
        shutil.rmtree(self.incoming, ignore_errors=True)


def ids_in(folder: Path) -> list[int]:
    """The ids of the ``<id>.pkl`` files in ``folder``."""
    if not folder.is_dir():
        return []
    ids = []
    for file in folder.iterdir():
        if file.suffix != SUFFIX:
            continue
        try:
            ids.append(int(file.stem))
        except ValueError:
            raise LayoutError(
                f"{str(file)!r} is not a sample file (names are <global index>{SUFFIX})"
            ) from None
    return ids


def check_readable(files: list[Path]) -> None:
    for file in files:
        if not os.access(file, os.R_OK):
            why = "permission denied" if file.exists() else "no such file"
            raise LayoutError(f"cannot read {str(file)!r}: {why}")


class _NoPacks:
    """A layout that keeps nothing in pack files: no state of its own to save, nothing to
    persist before a save, nothing to compact."""

    def state(self) -> dict[str, Any]:
        return {}

    def persist(self, ending: bool) -> None:
        pass

    def compact(self) -> bool:
        return False

    def drop_superseded(self) -> None:
        pass


class Memory(_NoPacks):
    """Samples in a dict; what is staged waits in another."""

    kind = "memory"
    meta_file: Path | None = None

    def __init__(self, samples: dict[int, Any] | None = None) -> None:
        self.samples = samples or {}
        self._staged: dict[int, Any] = {}

    def ids(self) -> list[int]:
        return list(self.samples)

    def load(self, sample_id: int) -> Any:
        try:
            return self.samples[sample_id]
        except KeyError:
            raise LayoutError(f"sample {sample_id} is not in this rank's store") from None

    def dump(self, sample_id: int) -> bytes:
        return encode(self.load(sample_id))

    def stage(self, sample_id: int, data: bytes) -> None:
        self._staged[sample_id] = decode(data)

    def staged(self) -> list[int]:
        return list(self._staged)

    def take(self, sample_id: int) -> None:
        self.samples[sample_id] = self._staged[sample_id]

    def remove(self, sample_id: int) -> None:
        self.samples.pop(sample_id, None)

    def drop_staged(self) -> None:
        self._staged = {}

    def stray_files(self) -> list[Path]:
        return []


class _InPacks:
    """What a layout keeps in pack files (``self.packs``: packs.py) does there: received
    samples staged and taken in, samples removed, the packs persisted and compacted."""

    packs: PackSet

    def _decoded(self, sample_id: int) -> Any:
        data = self.packs.read(sample_id)
        try:
            return decode(data)
        except Exception as exc:
            pack = self.packs.pack_file(self.packs.index[sample_id][0])
            raise LayoutError(
                f"cannot decode sample {sample_id} from {str(pack)!r}: {exc}"
            ) from exc

    def stage(self, sample_id: int, data: bytes) -> None:
        self.packs.stage(sample_id, data)

    def staged(self) -> list[int]:
        return list(self.packs.staged())

    def take(self, sample_id: int) -> None:
        self.packs.take(sample_id)

    def remove(self, sample_id: int) -> None:
        self.packs.remove(sample_id)

    def drop_staged(self) -> None:
        self.packs.drop_staged()

    def persist(self, ending: bool) -> None:
        self.packs.persist(ending)

    def compact(self) -> bool:
        return self.packs.compact()

    def drop_superseded(self) -> None:
        self.packs.drop_superseded()

    def stray_files(self) -> list[Path]:
        return self.packs.stray_files()


class PackFiles(_InPacks):
    """Pack files and their index under ``folder`` (packs.py); a sample travels as its record's
    bytes, read with one ``pread``."""

    kind = "packs"
    numbered, found = True, ()

    def __init__(self, folder: Path, state: dict[str, Any] | None) -> None:
        self.folder, self.meta_file = folder, folder / "store.json"
        self.packs = PackSet(folder, None if state is None else state.get("packs"), self.meta_file)

    def ids(self) -> list[int]:
        return self.packs.ids()

    def groups(self) -> list[list[int]]:
        return self.packs.groups()

    def load(self, sample_id: int) -> Any:
        return self._decoded(sample_id)

    def dump(self, sample_id: int) -> bytes:
        return self.packs.read(sample_id)

    def state(self) -> dict[str, Any]:
        return {"packs": self.packs.state()}


class PickleFiles(_NoPacks, _Staging):
    """``samples/<id>.pkl`` under ``folder``; a sample travels as its file's bytes."""

    kind = "files"
    numbered, found = True, ()  # ids are the file names

    def __init__(self, folder: Path) -> None:
        self.folder, self.incoming = folder, folder / "incoming"
        self.meta_file = folder / "store.json"
        check_readable(list((folder / "samples").iterdir()))

    def file(self, sample_id: int) -> Path:
        return self.folder / "samples" / f"{sample_id}{SUFFIX}"

    def ids(self) -> list[int]:
        return ids_in(self.folder / "samples")

    def load(self, sample_id: int) -> Any:
        return _decode_file(self.file(sample_id), sample_id)

    def dump(self, sample_id: int) -> bytes:
        return read_bytes(self.file(sample_id), sample_id)

    def take(self, sample_id: int) -> None:
        staged = self.incoming / f"{sample_id}{SUFFIX}"
        if staged.exists():  # absent: moved already by a commit that was interrupted
            os.replace(staged, self.file(sample_id))

    def remove(self, sample_id: int) -> None:
        self.file(sample_id).unlink(missing_ok=True)

    def stray_files(self) -> list[Path]:
        return [self.incoming] if self.incoming.exists() else []


def _decode_file(file: Path, sample_id: int) -> Any:
    data = read_bytes(file, sample_id)
    try:
        return decode(data)
    except Exception as exc:
        raise LayoutError(f"cannot read sample {sample_id} from {str(file)!r}: {exc}") from exc


class ImageFolder:
    """``<class>/<file>`` under ``folder`` (module docstring). ``files`` maps id -> relative path;
    a sample travels as (relative path, the file's bytes)."""

    kind = "imagefolder"

    def __init__(
        self,
        folder: Path,
        state: dict[str, Any] | None,
        loader: Callable[[str], Any] | None,
        leaving: Collection[int] = (),
    ) -> None:
        """``leaving``: samples a commit in progress sends away (their files may be gone)."""
        self.folder, self.loader = folder, loader or default_image_loader()
        self.meta_file = folder / ".commlayer-store.json"
        self.incoming = PackSet(
            folder / ".commlayer-incoming",
            None if state is None else state.get("incoming"),
            self.meta_file,
            "incoming",
        )
        self.classes: list[str] = []
        self.files: dict[int, str] = {}
        self.owner: dict[str, int] = {}  # relative path -> id
        # before numbering (a first open): the files found, in order
        self.found: list[str] = []
        self.numbered = state is not None
        if state is not None:
            self.classes = list(state["classes"])
            self.files = {int(i): rel for i, rel in state["files"].items()}
            self.owner = {rel: i for i, rel in self.files.items()}
            check_readable([folder / r for i, r in self.files.items() if i not in leaving])
        else:
            self.found = self._scan()
            check_readable([folder / rel for rel in self.found])

    def _scan(self) -> list[str]:
        found = []
        for root, dirs, names in os.walk(self.folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if Path(root) == self.folder:
                continue  # files beside the class folders belong to no class
            found += [
                str((Path(root) / n).relative_to(self.folder))
                for n in sorted(names)
                if not n.startswith(".")
            ]
        return found

    def local_classes(self) -> list[str]:
        return sorted({rel.split(os.sep)[0] for rel in (self.found or self.files.values())})

    def number(self, first_id: int, classes: list[str]) -> None:
        """Give the files found ids ``first_id``, ``first_id + 1``, ... (a first open)."""
        self.classes = classes
        self.files = {first_id + k: rel for k, rel in enumerate(self.found)}
        self.owner = {rel: i for i, rel in self.files.items()}
        self.found, self.numbered = [], True

    def ids(self) -> list[int]:
        return list(self.files)

    def _path(self, sample_id: int) -> Path:
        if sample_id not in self.files:
            self._reread_index()
        try:
            return self.folder / self.files[sample_id]
        except KeyError:
            raise LayoutError(f"sample {sample_id} is not in this rank's store") from None

    def _reread_index(self) -> None:
        """The index as the last commit saved it: a persistent DataLoader worker holds a copy
        of this layout made before that commit took samples in."""
        try:
            saved = json.loads(self.meta_file.read_text())["layout"]["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # nothing newer: the caller reports the sample missing
        self.files = {int(i): rel for i, rel in saved.items()}
        self.owner = {rel: i for i, rel in self.files.items()}

    def load(self, sample_id: int) -> Any:
        path = self._path(sample_id)
        try:
            image = self.loader(str(path))
        except Exception as exc:
            raise LayoutError(f"cannot read sample {sample_id} from {str(path)!r}: {exc}") from exc
        return image, self.classes.index(self.files[sample_id].split(os.sep)[0])

    def dump(self, sample_id: int) -> bytes:
        return encode((self.files[sample_id], read_bytes(self._path(sample_id), sample_id)))

    def stage(self, sample_id: int, data: bytes) -> None:
        self.incoming.stage(sample_id, data)

    def staged(self) -> list[int]:
        return list(self.incoming.staged())

    def drop_staged(self) -> None:
        self.incoming.drop_staged()

    def persist(self, ending: bool) -> None:
        self.incoming.persist(ending)

    def compact(self) -> bool:
        return False

    def drop_superseded(self) -> None:
        pass

    def stray_files(self) -> list[Path]:
        return self.incoming.stray_files()

    def take(self, sample_id: int) -> None:
        # The staging pack stays until the store saved the new index: a redo finds it.
        rel, data = decode(self.incoming.staged_bytes(sample_id))
        parts = Path(rel).parts
        dest = str(Path(parts[0], parts[-1]))
        if self.owner.get(dest, sample_id) != sample_id:  # another file of that name: keep both
            dest = str(Path(parts[0], f"{sample_id}-{parts[-1]}"))
        target = self.folder / dest
        target.parent.mkdir(exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        self.files[sample_id], self.owner[dest] = dest, sample_id

    def remove(self, sample_id: int) -> None:
        rel = self.files.pop(sample_id, None)
        if rel is not None:
            del self.owner[rel]
            (self.folder / rel).unlink(missing_ok=True)

    def state(self) -> dict[str, Any]:
        return {
            "classes": self.classes,
            "files": {str(i): r for i, r in self.files.items()},
            "incoming": self.incoming.state(),
        }


class ArrayFile(_InPacks):
    """One .npy/.npz file, read only; received samples (pickled, in pack files) and the ids of
    the rows sent away are kept in ``<file>.store/`` (module docstring). A .npz is decompressed
    into memory once per process; a .npy is memory-mapped. DataLoader workers get the store
    without the arrays and open the file themselves (a memory map would be pickled as a full
    copy)."""

    kind = "array"

    def __init__(self, file: Path, state: dict[str, Any] | None) -> None:
        self.file = file
        self.side = file.with_name(file.name + ".store")
        self.meta_file = self.side / "store.json"
        self.packs = PackSet(
            self.side, None if state is None else state.get("packs"), self.meta_file
        )
        self._arrays: list[np.ndarray] | None = None
        rows = {len(a) for a in self.arrays}
        if len(rows) != 1:
            raise LayoutError(f"the arrays of {str(file)!r} differ in length: {sorted(rows)}")
        self.rows = rows.pop()
        self.found = range(self.rows)  # rows to number at a first open
        self.numbered = state is not None
        self.first_id: int | None = None if state is None else int(state["first_id"])
        self.removed: set[int] = set() if state is None else set(state["removed"])
        self.side.mkdir(parents=True, exist_ok=True)
        if state is not None and "packs" not in state:
            self._take_in_old_samples()

    def _take_in_old_samples(self) -> None:
        """A side folder written before pack files kept each received sample as
        ``samples/<id>.pkl``: they are copied into a pack (the store's next save names it; the
        old files stay, unused, until then and after)."""
        old = self.side / "samples"
        found = sorted(ids_in(old))
        if found:
            self.packs.write_all((i, read_bytes(old / f"{i}{SUFFIX}", i)) for i in found)
            self.packs.persist(ending=True)

    @property
    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            try:
                if self.file.suffix == ".npy":
                    self._arrays = [np.load(self.file, mmap_mode="r")]
                else:
                    with np.load(self.file) as npz:
                        self._arrays = [npz[key] for key in npz.files]
            except Exception as exc:
                raise LayoutError(f"cannot read {str(self.file)!r}: {exc}") from exc
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def number(self, first_id: int) -> None:
        self.first_id, self.numbered = first_id, True

    def _row(self, sample_id: int) -> int | None:
        assert self.first_id is not None
        row = sample_id - self.first_id
        return row if 0 <= row < self.rows and sample_id not in self.removed else None

    def ids(self) -> list[int]:
        assert self.first_id is not None
        rows = range(self.first_id, self.first_id + self.rows)
        return [i for i in rows if i not in self.removed] + self.packs.ids()

    def groups(self) -> list[list[int]]:
        """The rows left first (the oldest), then the packs of received samples."""
        assert self.first_id is not None
        rows = range(self.first_id, self.first_id + self.rows)
        return [[i for i in rows if i not in self.removed], *self.packs.groups()]

    def load(self, sample_id: int) -> Any:
        row = self._row(sample_id)
        if row is None:
            return self._decoded(sample_id)
        if len(self.arrays) == 1 and self.file.suffix == ".npy":
            return tensor(np.asarray(self.arrays[0][row]))
        return tuple(tensor(np.asarray(a[row])) for a in self.arrays)

    def dump(self, sample_id: int) -> bytes:
        if self._row(sample_id) is None:
            return self.packs.read(sample_id)
        return encode(self.load(sample_id))

    def remove(self, sample_id: int) -> None:
        super().remove(sample_id)
        assert self.first_id is not None
        if 0 <= sample_id - self.first_id < self.rows:
            self.removed.add(sample_id)

    def state(self) -> dict[str, Any]:
        return {
            "first_id": self.first_id,
            "removed": sorted(self.removed),
            "packs": self.packs.state(),
        }
