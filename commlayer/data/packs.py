"""Pack files: a shard store's samples in append-only files with an index, as WebDataset shards
or LMDB keep them, instead of one file per sample (issue 40: 3.8 MB on disk for 230 kB of digits,
and 1.8-4 ms to create each received sample's file on ext4).

Under a store's folder:

- ``packs/<n>.pack``: ``CLPACK1\\n``, then one record per sample: (sample id int64, length
  uint32, the sample's bytes). A pack is written once, front to back, and never changed: each
  exchange's received samples go into a new pack, and a compaction copies the live records of
  packs with removed ones into a new pack. Pack numbers are never reused.
- ``index-<g>.bin``: ``CLINDEX1``, the number of samples (uint64), then per sample (id int64,
  pack uint32, offset uint32, length uint32): 20 bytes. Written under a new name at each change;
  the store's journal (``store.json``, replaced atomically) names the index and the pack being
  staged, so the journal and the index change together, in one ``os.replace``.

The two-phase exchange: received samples are appended to a staging pack (``stage``), which the
journal names when the exchange is prepared; ``take`` adds their records to the index at the
commit; files that neither the saved index nor the journal's staging pack name are left over
from an interrupted exchange or compaction and are removed by ``drop_staged``. A kill at any
point leaves the previous journal and index whole.

Overhead: 32 bytes per sample (record header and index entry) plus the records of samples sent
away that still sit in packs: when all of it would pass ``OVERHEAD_BUDGET`` (8%) of the
samples' bytes, ``compact`` copies the live records of the packs holding dead ones into a new
pack (sequential reads and writes), so the files stay within 10% of the samples' bytes. The
shuffler runs it on its I/O thread at the start of each epoch, after the commit.

Reads are ``os.pread`` on descriptors kept open (they release the GIL, and several threads may
read at once). A DataLoader worker holding an index older than the last commit rereads it when a
sample is missing or its pack is gone. Errors name the file (a ``LayoutError``; the store adds
the rank).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np


class LayoutError(Exception):
    """What is wrong with a store's files; ShardStore names the rank and re-raises."""


PACK_MAGIC = b"CLPACK1\n"
INDEX_MAGIC = b"CLINDEX1"
RECORD = struct.Struct("<qI")  # sample id, length
_COUNT = struct.Struct("<Q")
ENTRY = np.dtype([("id", "<i8"), ("pack", "<u4"), ("offset", "<u4"), ("length", "<u4")])
MAX_PACK_BYTES = 2**32 - 1  # offsets are uint32: a pack that would pass it is closed
# A save compacts when the store's overhead (record headers, index entries and the records of
# samples sent away) would pass this share of the samples' own bytes: the store keeps its files
# within 10% of the samples' bytes (the journal and the last block of each file aside).
OVERHEAD_BUDGET = 0.08


_REREADS = 20  # a stale copy reads the journal again at most this often (PackSet.reread)


class PackSet:
    """The samples of one folder's packs (module docstring). ``state`` is what ``state()``
    returned when the journal was last saved (None: an empty set). ``meta_file`` and ``key``
    say where a stale copy finds the current state: ``json(meta_file)["layout"][key]``."""

    def __init__(
        self, folder: Path, state: dict[str, Any] | None, meta_file: Path, key: str = "packs"
    ) -> None:
        self.folder, self.meta_file, self.key = folder, meta_file, key
        self.dir = folder / "packs"
        self.index: dict[int, tuple[int, int, int]] = {}  # id -> (pack, offset, length)
        self.gen, self.next_pack = 0, 1
        self.staging: int | None = None  # the pack received samples are appended to
        self._fds: dict[int, int] = {}
        # The staging pack: a descriptor and a buffer of our own, written only by flush(): a
        # forked DataLoader worker holding a copy never writes it (a buffered file object
        # would, when collected there).
        self._writer: int | None = None
        self._buffer = bytearray()
        self._written = 0  # bytes in the staging pack so far
        self._staged: dict[int, tuple[int, int, int]] | None = None
        self._dirty = False
        if state is not None:
            self._load(state)

    # -- state -------------------------------------------------------------------------------
    def _load(self, state: dict[str, Any]) -> None:
        self.gen, self.next_pack = int(state["index"]), int(state["next"])
        staging = state.get("staging")
        self.staging = None if staging is None else int(staging)
        self.index = self._read_index(self.gen) if self.gen else {}
        self._staged = None

    def state(self) -> dict[str, Any]:
        return {"index": self.gen, "next": self.next_pack, "staging": self.staging}

    def index_file(self, gen: int) -> Path:
        return self.folder / f"index-{gen}.bin"

    def pack_file(self, pack: int) -> Path:
        return self.dir / f"{pack}.pack"

    def _read_index(self, gen: int) -> dict[int, tuple[int, int, int]]:
        file = self.index_file(gen)
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise LayoutError(f"cannot read the index {str(file)!r}: {exc}") from exc
        head = len(INDEX_MAGIC) + _COUNT.size
        if len(data) < head or data[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise LayoutError(f"{str(file)!r} is not a pack index (malformed or truncated)")
        (count,) = _COUNT.unpack_from(data, len(INDEX_MAGIC))
        if len(data) != head + count * ENTRY.itemsize:
            raise LayoutError(
                f"the index {str(file)!r} is truncated or malformed: {len(data)} bytes for "
                f"{count} samples, {head + count * ENTRY.itemsize} expected"
            )
        entries = np.frombuffer(data, dtype=ENTRY, offset=head)
        index = dict(
            zip(
                entries["id"].tolist(),
                zip(
                    entries["pack"].tolist(),
                    entries["offset"].tolist(),
                    entries["length"].tolist(),
                ),
            )
        )
        if len(index) != count:
            raise LayoutError(f"the index {str(file)!r} names a sample twice")
        self._check_packs(index, file)
        return index

    def _check_packs(self, index: dict[int, tuple[int, int, int]], file: Path) -> None:
        """Every pack the index names exists and is long enough for its records."""
        ends: dict[int, int] = {}
        for pack, offset, length in index.values():
            ends[pack] = max(ends.get(pack, 0), offset + RECORD.size + length)
        for pack, end in ends.items():
            path = self.pack_file(pack)
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise LayoutError(
                    f"the index {str(file)!r} names the pack {str(path)!r}: {exc}"
                ) from exc
            if size < end:
                raise LayoutError(
                    f"the pack {str(path)!r} is truncated: {size} bytes, its records in "
                    f"{str(file)!r} end at {end}"
                )

    def reread(self) -> bool:
        """The state the journal saved last (a stale copy: a persistent DataLoader worker);
        False when there is nothing newer. The index (or a pack) the journal named may be gone
        by the time this copy reads it: the writer saved a newer one since and dropped the
        superseded files; then the journal is read again, up to ``_REREADS`` times."""
        gone: LayoutError | None = None
        for _ in range(_REREADS):
            try:
                state = json.loads(self.meta_file.read_text())["layout"][self.key]
            except (OSError, ValueError, KeyError, TypeError):
                return False
            if int(state["index"]) <= self.gen:  # nothing newer (the writer is never behind)
                return False
            previous = (self.gen, self.next_pack, self.staging, self.index)
            self._close_fds()
            try:
                self._load(state)
                return True
            except LayoutError as exc:
                self.gen, self.next_pack, self.staging, self.index = previous
                if not isinstance(exc.__cause__, FileNotFoundError):
                    raise
                gone = exc  # superseded while being read: the journal names a newer one
        assert gone is not None
        raise gone

    def __getstate__(self) -> dict[str, Any]:
        # a DataLoader worker (spawned) opens its own descriptors; it never stages
        return {**self.__dict__, "_fds": {}, "_writer": None, "_buffer": bytearray()}

    # -- reading -----------------------------------------------------------------------------
    def ids(self) -> list[int]:
        return list(self.index)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self.index

    def read(self, sample_id: int) -> bytes:
        """The sample's bytes; LayoutError naming the pack when it cannot be read."""
        entry = self.index.get(sample_id)
        if entry is None and self.reread():
            entry = self.index.get(sample_id)
        if entry is None:
            raise LayoutError(f"sample {sample_id} is not in this rank's store")
        try:
            return self._record(sample_id, *entry)
        except FileNotFoundError as exc:  # compacted since: the new index, here or on disk
            current = self.index.get(sample_id)
            if (current is None or current == entry) and self.reread():
                current = self.index.get(sample_id)
            if current is None or current == entry:
                raise LayoutError(
                    f"cannot read sample {sample_id} from {str(self.pack_file(entry[0]))!r}: "
                    f"{exc.strerror}"
                ) from exc
            return self._record(sample_id, *current)

    def _record(self, sample_id: int, pack: int, offset: int, length: int) -> bytes:
        path = self.pack_file(pack)
        try:
            data = os.pread(self._fd(pack), RECORD.size + length, offset)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise LayoutError(f"cannot read sample {sample_id} from {str(path)!r}: {exc}") from exc
        if len(data) != RECORD.size + length:
            raise LayoutError(
                f"cannot read sample {sample_id} from {str(path)!r}: the pack is truncated "
                f"({len(data)} of {RECORD.size + length} bytes at offset {offset})"
            )
        if RECORD.unpack_from(data) != (sample_id, length):
            raise LayoutError(
                f"cannot read sample {sample_id} from {str(path)!r}: malformed record at offset "
                f"{offset} (header {RECORD.unpack_from(data)}, the index says "
                f"{(sample_id, length)})"
            )
        return data[RECORD.size :]

    def _fd(self, pack: int) -> int:
        fd = self._fds.get(pack)
        if fd is None:  # no lock (a forked DataLoader worker could inherit it held): setdefault
            path = self.pack_file(pack)
            fd = os.open(path, os.O_RDONLY)
            if os.pread(fd, len(PACK_MAGIC), 0) != PACK_MAGIC:
                os.close(fd)
                raise LayoutError(f"{str(path)!r} is not a pack file (malformed)")
            kept = self._fds.setdefault(pack, fd)
            if kept != fd:  # another thread opened it meanwhile
                os.close(fd)
            fd = kept
        return fd

    def _close_fds(self, keep: Iterable[int] = ()) -> None:
        kept = set(keep)
        for pack in [p for p in self._fds if p not in kept]:
            os.close(self._fds.pop(pack))

    # -- writing -----------------------------------------------------------------------------
    def write_all(self, records: Iterable[tuple[int, bytes]]) -> None:
        """A new store's samples (``from_dataset``): packs written in one pass, then the index."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for sample_id, data in records:
            self._append(sample_id, data, self.index, roll=True)
        self._close_writer()
        self.staging = None
        self._dirty = True

    def _append(
        self, sample_id: int, data: bytes, target: dict[int, tuple[int, int, int]], roll: bool
    ) -> None:
        """Append a record to the pack being written (a new one if none is), its entry into
        ``target``; ``roll``: a pack that would pass MAX_PACK_BYTES is closed, a new one begun."""
        size = RECORD.size + len(data)
        if self._writer is not None and self._written + size > MAX_PACK_BYTES:
            if not roll:
                raise LayoutError(
                    f"the staging pack {str(self.pack_file(self.staging or 0))!r} would pass "
                    f"{MAX_PACK_BYTES} bytes: use more chunks or a smaller fraction"
                )
            self._close_writer()
        if self._writer is None:
            self.staging = self.next_pack
            self.next_pack += 1
            self.dir.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            self._writer = os.open(self.pack_file(self.staging), flags, 0o644)
            self._buffer += PACK_MAGIC
            self._written = len(PACK_MAGIC)
        assert self.staging is not None
        entry = (self.staging, self._written, len(data))
        self._buffer += RECORD.pack(sample_id, len(data))
        self._buffer += data
        self._written += size
        if len(self._buffer) >= 1 << 20:
            self.flush()
        target[sample_id] = entry

    def _close_writer(self) -> None:
        if self._writer is not None:
            self.flush()
            os.close(self._writer)
            self._writer = None

    def stage(self, sample_id: int, data: bytes) -> None:
        """Phase 1: append a received sample to this exchange's staging pack."""
        if self._staged is None:
            self._staged = {}
        self._append(sample_id, data, self._staged, roll=False)

    def flush(self) -> None:
        """What was staged is in the file (before the journal names the staging pack)."""
        if self._writer is not None and self._buffer:
            view = memoryview(self._buffer)
            while view:  # os.write releases the GIL
                view = view[os.write(self._writer, view) :]
            view.release()
            self._buffer = bytearray()

    def staged(self) -> dict[int, tuple[int, int, int]]:
        """The staged records: as written by this process, or read back from the staging pack
        the journal names (after a kill)."""
        self.flush()
        if self._staged is None:
            self._staged = self._scan(self.staging) if self.staging is not None else {}
        return self._staged

    def staged_bytes(self, sample_id: int) -> bytes:
        pack, offset, length = self.staged()[sample_id]
        return self._record(sample_id, pack, offset, length)

    def _scan(self, pack: int) -> dict[int, tuple[int, int, int]]:
        path = self.pack_file(pack)
        if not path.exists():
            return {}
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise LayoutError(f"cannot read the staging pack {str(path)!r}: {exc}") from exc
        if data[: len(PACK_MAGIC)] != PACK_MAGIC:
            raise LayoutError(f"{str(path)!r} is not a pack file (malformed or truncated)")
        records, offset = {}, len(PACK_MAGIC)
        while offset < len(data):
            if offset + RECORD.size > len(data):
                raise LayoutError(f"the pack {str(path)!r} is truncated at offset {offset}")
            sample_id, length = RECORD.unpack_from(data, offset)
            if offset + RECORD.size + length > len(data):
                raise LayoutError(
                    f"the pack {str(path)!r} is truncated: the record of sample {sample_id} at "
                    f"offset {offset} needs {length} bytes"
                )
            records[sample_id] = (pack, offset, length)
            offset += RECORD.size + length
        return records

    def take(self, sample_id: int) -> None:
        """Phase 2: a staged sample joins the index (idempotent)."""
        entry = self.staged().get(sample_id)
        if entry is not None:
            self.index[sample_id] = entry
            self._dirty = True

    def remove(self, sample_id: int) -> None:
        if self.index.pop(sample_id, None) is not None:
            self._dirty = True

    # -- saving ------------------------------------------------------------------------------
    def persist(self, ending: bool) -> None:
        """Before the journal is saved: staged bytes flushed; ``ending`` (no exchange pending
        any more): the staging pack is no longer one; after a change, a compaction where due
        and the new index written (the journal will name it)."""
        if ending:
            self.end_exchange()
        self.flush()
        if not self._dirty:
            return
        entries = np.empty(len(self.index), dtype=ENTRY)
        if self.index:
            entries["id"] = list(self.index)
            values = np.array(list(self.index.values()), dtype=np.uint64).reshape(-1, 3)
            entries["pack"], entries["offset"], entries["length"] = values.T
        self.gen += 1
        file = self.index_file(self.gen)
        tmp = file.with_suffix(".tmp")
        tmp.write_bytes(INDEX_MAGIC + _COUNT.pack(len(entries)) + entries.tobytes())
        os.replace(tmp, file)
        self._dirty = False

    def end_exchange(self) -> None:
        """The exchange is over (committed or not): nothing is staged any more."""
        self._close_writer()
        self.staging = None

    def compact(self) -> bool:
        """Copy the live records of the packs holding dead ones into a new pack, where the
        overhead would pass OVERHEAD_BUDGET; True when it did (the caller saves the journal,
        which writes the new index). Safe while other threads read: the new index replaces the
        old in one assignment once the new pack is written, and the old packs stay until
        ``drop_staged`` (the next exchange's end). Not while anything is staged."""
        if self.staging is not None:
            return False
        referenced: dict[int, int] = {}  # pack -> live bytes
        for pack, _, length in self.index.values():
            referenced[pack] = referenced.get(pack, 0) + RECORD.size + length
        live = sum(referenced.values())
        dead = {}
        for pack in referenced:
            size = self.pack_file(pack).stat().st_size - len(PACK_MAGIC)
            if size > referenced[pack]:
                dead[pack] = size - referenced[pack]
        samples = live - (RECORD.size * len(self.index))
        fixed = (RECORD.size + ENTRY.itemsize) * len(self.index)
        if not dead or fixed + sum(dead.values()) <= OVERHEAD_BUDGET * samples:
            return False
        moving = sorted(
            (entry[1], sample_id, entry)
            for sample_id, entry in self.index.items()
            if entry[0] in dead
        )
        index = dict(self.index)
        by_pack: dict[int, list[tuple[int, int, tuple[int, int, int]]]] = {}
        for item in moving:
            by_pack.setdefault(item[2][0], []).append(item)
        for pack, items in sorted(by_pack.items()):
            fd = self._fd(pack)
            for _, sample_id, (_, offset, length) in items:
                data = os.pread(fd, RECORD.size + length, offset)
                if len(data) != RECORD.size + length:
                    raise LayoutError(
                        f"cannot compact {str(self.pack_file(pack))!r}: truncated at {offset}"
                    )
                self._append(sample_id, data[RECORD.size :], index, roll=True)
        self._close_writer()
        self.staging = None
        self.index, self._dirty = index, True
        return True

    def drop_staged(self) -> None:
        """Remove what neither the saved index nor a staging pack names: a staging pack after
        its exchange ended, packs left empty or compacted, an index replaced."""
        self.end_exchange()
        self._staged = None
        self._close_fds(keep={pack for pack, _, _ in self.index.values()})
        self.drop_superseded()

    def drop_superseded(self) -> None:
        """Remove the packs and index files the saved state no longer names (after a
        compaction, while other threads may read: their open descriptors stay valid, and a
        pack opened too late is found gone, which makes the reader reread the index)."""
        live = {pack for pack, _, _ in self.index.values()} | {self.staging}
        if self.dir.is_dir():
            for file in self.dir.iterdir():
                if not (file.suffix == ".pack" and _number(file) in live):
                    file.unlink(missing_ok=True)
        for file in self.folder.glob("index-*"):
            if file.name != self.index_file(self.gen).name:
                file.unlink(missing_ok=True)

    def stray_files(self) -> list[Path]:
        """Files the saved state does not name (tests: none after a recovery)."""
        live = {pack for pack, _, _ in self.index.values()} | {self.staging}
        packs = (
            [f for f in self.dir.iterdir() if _number(f) not in live] if self.dir.is_dir() else []
        )
        indexes = [f for f in self.folder.glob("index-*") if f != self.index_file(self.gen)]
        return sorted(packs + indexes)

    def live_bytes(self) -> int:
        return sum(length for _, _, length in self.index.values())

    def files(self) -> list[Path]:
        found = [self.pack_file(p) for p in {p for p, _, _ in self.index.values()}]
        return sorted(found + ([self.index_file(self.gen)] if self.gen else []))


def _number(file: Path) -> int | None:
    try:
        return int(file.stem)
    except ValueError:
        return None


def decode_with(decode: Callable[[bytes], Any], data: bytes, sample_id: int, where: Path) -> Any:
    try:
        return decode(data)
    except Exception as exc:
        raise LayoutError(f"cannot decode sample {sample_id} from {str(where)!r}: {exc}") from exc
