"""Pack files: a shard store's samples in append-only files with an index, as WebDataset shards
or LMDB keep them, instead of one file per sample (issue 40: 3.8 MB on disk for 230 kB of digits,
and 1.8-4 ms to create each received sample's file on ext4).

Under a store's folder:

- ``packs/<n>.pack``: ``CLPACK2\n``, then one record per sample: (sample id, length) as two
  LEB128 varints (the id zigzag-coded), then the sample's bytes (codec.py: compact for arrays,
  tensors and numbers). Packs written before this format start ``CLPACK1\n`` and have 12-byte
  record headers (id int64, length uint32); they are still read, and a compaction copies their
  records into the new format. A pack is written once, front to back, and never changed: each
  exchange's received samples go into a new pack. Pack numbers are never reused.
- ``index-<g>.bin``: ``CLINDEX2``, then zlib-compressed columns (the number of samples; ids,
  packs, offsets, lengths, codec header sizes), entries in age order, ids and offsets as deltas:
  2-3 bytes per sample for a digits-sized shard instead of ``CLINDEX1``'s 20 (still read).
  Written under a new name at each change; the store's journal (``store.json``, replaced
  atomically) names the index, the pack being staged and the packs' age order, so the journal
  and the index change together, in one ``os.replace``.

The two-phase exchange: received samples are appended to a staging pack (``stage``), which the
journal names when the exchange is prepared; ``take`` adds their records to the index at the
commit; files that neither the saved index nor the journal's staging pack name are left over
from an interrupted exchange or compaction and are removed by ``drop_staged``. A kill at any
point leaves the previous journal and index whole.

FIFO by pack: ``groups()`` gives the samples pack by pack, oldest pack first, and the shuffler's
plan sends the samples of the oldest packs first (random within a pack, plan.py), so the packs
whose samples have all been sent are unlinked at the commit, whole, without a copy. A store
written by ``from_dataset`` is cut into packs of ``max(MIN_PACK_BYTES, shard / 16)``, its
samples in a seeded random order. Overhead: the record and codec headers and the index (about
12 bytes per digits sample), plus the records sent away from the pack the oldest-first sending
stopped in; ``compact`` copies the live records of packs whose live share fell below
``REWRITE_BELOW`` (10%), then, while the files would pass ``OVERHEAD_BUDGET`` (8%) over the
samples' own bytes, of the packs with the least live share: at Q = 0.1 at most one pack an
epoch (a sixteenth of a large shard), mostly none (the pack the sending stopped in is the first
sent from next epoch), not the shard. Live bytes per pack are counted once and kept up to date
by ``take`` and ``remove``, so deciding costs no pass over the index. The shuffler runs it on
its I/O thread at the start of each epoch, after the commit.

Reads are ``os.pread`` on descriptors kept open (they release the GIL, and several threads may
read at once). A DataLoader worker holding an index older than the last commit rereads it when a
sample is missing or its pack is gone. Errors name the file (a ``LayoutError``; the store adds
the rank).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from commlayer.data.codec import header_size, read_varint


class LayoutError(Exception):
    """What is wrong with a store's files; ShardStore names the rank and re-raises."""


PACK_MAGIC = b"CLPACK2\n"
PACK_MAGIC_V1 = b"CLPACK1\n"
INDEX_MAGIC = b"CLINDEX2"
INDEX_MAGIC_V1 = b"CLINDEX1"
RECORD_V1 = struct.Struct("<qI")  # sample id, length
_COUNT = struct.Struct("<Q")
ENTRY_V1 = np.dtype([("id", "<i8"), ("pack", "<u4"), ("offset", "<u4"), ("length", "<u4")])
MAX_PACK_BYTES = 2**32 - 1  # offsets are uint32: a pack that would pass it is closed
MAX_HEAD = 20  # the longest v2 record header: two 10-byte varints
# A compaction keeps the store's files (packs and index) within this share over the samples'
# own bytes where it can: ShardStore.storage() reports the whole folder, journal included.
OVERHEAD_BUDGET = 0.08
# A pack this little live is rewritten whatever the budget; above it only the budget decides:
# the pack the oldest-first sending stopped in is the first sent from next epoch, so it mostly
# dies whole without a copy (at 0.5, 160 kB of a 6.5 MB shard were copied every epoch, 2.3 ms of
# the I/O thread's CPU at Q = 0.1).
REWRITE_BELOW = 0.1
# from_dataset's packs: max(this, the shard's bytes / PACKS_PER_SHARD). Packs of a sixteenth
# of the shard die whole at Q >= 1/16 and leave at most 6% dead otherwise (within the budget);
# at 1 MiB a 6.5 MB shard had 6 packs and a compaction copied a third of one every other epoch.
MIN_PACK_BYTES = 1 << 16
PACKS_PER_SHARD = 16


_REREADS = 20  # a stale copy reads the journal again at most this often (PackSet.reread)

Entry = tuple[int, int, int]  # pack, offset of the record, length of the sample's bytes


def _zigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def record_head(sample_id: int, length: int) -> bytes:
    """A v2 record's header."""
    out = bytearray()
    for value in (_zigzag(sample_id), length):
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def _parse_head(data: bytes | memoryview, offset: int) -> tuple[int, int, int]:
    """(sample id, length, offset after the header) of a v2 record at ``offset``."""
    zz, offset = read_varint(data, offset)
    length, offset = read_varint(data, offset)
    return (zz >> 1) ^ -(zz & 1), length, offset


class PackSet:
    """The samples of one folder's packs (module docstring). ``state`` is what ``state()``
    returned when the journal was last saved (None: an empty set). ``meta_file`` and ``key``
    say where a stale copy finds the current state: ``json(meta_file)["layout"][key]``."""

    def __init__(
        self, folder: Path, state: dict[str, Any] | None, meta_file: Path, key: str = "packs"
    ) -> None:
        self.folder, self.meta_file, self.key = folder, meta_file, key
        self.dir = folder / "packs"
        self.index: dict[int, Entry] = {}  # id -> (pack, offset, length)
        self.heads: dict[int, int] = {}  # id -> codec header bytes of its sample (codec.py)
        self.order: list[int] = []  # packs, oldest first (FIFO: groups())
        self.gen, self.next_pack = 0, 1
        self.staging: int | None = None  # the pack received samples are appended to
        self.copied = 0  # bytes compactions copied, in all (stats)
        self._live: dict[int, int] | None = None  # pack -> bytes of its live records, or unknown
        self._sizes: dict[int, int] = {}  # pack -> its size (a pack never changes once written)
        self._fds: dict[int, int] = {}
        self._v1: set[int] = set()  # packs in the old format (12-byte record headers)
        # The staging pack: a descriptor and a buffer of our own, written only by flush(): a
        # forked DataLoader worker holding a copy never writes it (a buffered file object
        # would, when collected there).
        self._writer: int | None = None
        self._buffer = bytearray()
        self._written = 0  # bytes in the staging pack so far
        self._staged: dict[int, Entry] | None = None
        self._staged_heads: dict[int, int] = {}
        self._dirty = False
        if state is not None:
            self._load(state)

    # -- state -------------------------------------------------------------------------------
    def _load(self, state: dict[str, Any]) -> None:
        self.gen, self.next_pack = int(state["index"]), int(state["next"])
        staging = state.get("staging")
        self.staging = None if staging is None else int(staging)
        self.index, self.heads = self._read_index(self.gen) if self.gen else ({}, {})
        self._live = None
        self.order = [int(p) for p in state.get("order", ())]
        self._staged = None

    def state(self) -> dict[str, Any]:
        return {
            "index": self.gen,
            "next": self.next_pack,
            "staging": self.staging,
            "order": self.order,
        }

    def index_file(self, gen: int) -> Path:
        return self.folder / f"index-{gen}.bin"

    def pack_file(self, pack: int) -> Path:
        return self.dir / f"{pack}.pack"

    def _read_index(self, gen: int) -> tuple[dict[int, Entry], dict[int, int]]:
        file = self.index_file(gen)
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise LayoutError(f"cannot read the index {str(file)!r}: {exc}") from exc
        magic = data[: len(INDEX_MAGIC)]
        if magic == INDEX_MAGIC:
            ids, packs, offsets, lengths, heads = self._columns(data, file)
        elif magic == INDEX_MAGIC_V1 and len(data) >= len(magic) + _COUNT.size:
            (count,) = _COUNT.unpack_from(data, len(magic))
            head = len(magic) + _COUNT.size
            if len(data) != head + count * ENTRY_V1.itemsize:
                raise LayoutError(
                    f"the index {str(file)!r} is truncated or malformed: {len(data)} bytes for "
                    f"{count} samples, {head + count * ENTRY_V1.itemsize} expected"
                )
            entries = np.frombuffer(data, dtype=ENTRY_V1, offset=head)
            ids, packs = entries["id"].tolist(), entries["pack"].tolist()
            offsets, lengths = entries["offset"].tolist(), entries["length"].tolist()
            heads = [0] * len(ids)  # CLINDEX1 stores held pickles only (codec: no header)
        else:
            raise LayoutError(f"{str(file)!r} is not a pack index (malformed or truncated)")
        index = dict(zip(ids, zip(packs, offsets, lengths)))
        if len(index) != len(ids):
            raise LayoutError(f"the index {str(file)!r} names a sample twice")
        self._check_packs(index, file)
        return index, {i: h for i, h in zip(ids, heads) if h}

    @staticmethod
    def _columns(data: bytes, file: Path) -> tuple[list[int], ...]:
        try:
            raw = zlib.decompress(data[len(INDEX_MAGIC) :])
            (count,) = _COUNT.unpack_from(raw)
            if len(raw) != _COUNT.size + count * 24:
                raise ValueError(f"{len(raw)} bytes for {count} samples")
            at = _COUNT.size
            ids = np.frombuffer(raw, "<i8", count, at)
            packs = np.frombuffer(raw, "<u4", count, at + 8 * count)
            offsets = np.frombuffer(raw, "<u4", count, at + 12 * count)
            lengths = np.frombuffer(raw, "<u4", count, at + 16 * count)
            heads = np.frombuffer(raw, "<u4", count, at + 20 * count)
        except (zlib.error, ValueError, struct.error) as exc:
            raise LayoutError(f"the index {str(file)!r} is truncated or malformed: {exc}") from exc
        return (
            np.cumsum(ids, dtype=np.int64).tolist(),
            packs.tolist(),
            np.cumsum(offsets, dtype=np.uint32).tolist(),
            lengths.tolist(),
            heads.tolist(),
        )

    def _check_packs(self, index: dict[int, Entry], file: Path) -> None:
        """Every pack the index names exists and is long enough for its records."""
        ends: dict[int, tuple[int, int, int]] = {}
        for sample_id, (pack, offset, length) in index.items():
            if offset >= ends.get(pack, (-1, 0, 0))[0]:
                ends[pack] = (offset, sample_id, length)
        for pack, (offset, sample_id, length) in ends.items():
            path = self.pack_file(pack)
            try:
                size = path.stat().st_size
                end = offset + self._head_size(pack, sample_id, length) + length
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
            previous = (self.gen, self.next_pack, self.staging, self.index, self.heads)
            self._close_fds()
            try:
                self._load(state)
                return True
            except LayoutError as exc:
                self.gen, self.next_pack, self.staging, self.index, self.heads = previous
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

    def groups(self) -> list[list[int]]:
        """The samples pack by pack, oldest pack first (FIFO, module docstring)."""
        by_pack: dict[int, list[tuple[int, int]]] = {}
        for sample_id, (pack, offset, _) in self.index.items():
            by_pack.setdefault(pack, []).append((offset, sample_id))
        known = set(self.order)
        order = [p for p in self.order if p in by_pack]
        order += sorted(p for p in by_pack if p not in known)
        return [[sample_id for _, sample_id in sorted(by_pack[p])] for p in order]

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

    def _head_size(self, pack: int, sample_id: int, length: int) -> int:
        if pack not in self._fds and (pack != self.staging or self._writer is None):
            self._fd(pack)  # learns the pack's format
        if pack in self._v1:
            return RECORD_V1.size
        return _varint_size(_zigzag(sample_id)) + _varint_size(length)

    def _record(self, sample_id: int, pack: int, offset: int, length: int) -> bytes:
        path = self.pack_file(pack)
        try:
            head = self._head_size(pack, sample_id, length)
            data = os.pread(self._fd(pack), head + length, offset)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise LayoutError(f"cannot read sample {sample_id} from {str(path)!r}: {exc}") from exc
        if len(data) != head + length:
            raise LayoutError(
                f"cannot read sample {sample_id} from {str(path)!r}: the pack is truncated "
                f"({len(data)} of {head + length} bytes at offset {offset})"
            )
        if pack in self._v1:
            found = RECORD_V1.unpack_from(data)
        else:
            found = _parse_head(data, 0)[:2]
        if tuple(found) != (sample_id, length):
            raise LayoutError(
                f"cannot read sample {sample_id} from {str(path)!r}: malformed record at offset "
                f"{offset} (header {tuple(found)}, the index says {(sample_id, length)})"
            )
        return data[head:]

    def _fd(self, pack: int) -> int:
        fd = self._fds.get(pack)
        if fd is None:  # no lock (a forked DataLoader worker could inherit it held): setdefault
            path = self.pack_file(pack)
            fd = os.open(path, os.O_RDONLY)
            magic = os.pread(fd, len(PACK_MAGIC), 0)
            if magic == PACK_MAGIC_V1:
                self._v1.add(pack)
            elif magic != PACK_MAGIC:
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
    def write_all(
        self, records: Iterable[tuple[int, bytes]], pack_bytes: int = MAX_PACK_BYTES
    ) -> None:
        """A new store's samples (``from_dataset``): packs of about ``pack_bytes`` written in
        one pass, oldest first, then the index."""
        self.dir.mkdir(parents=True, exist_ok=True)
        first = self.next_pack
        for sample_id, data in records:
            if self._writer is not None and self._written >= pack_bytes:
                self._close_writer()
            self._append(sample_id, data, self.index, self.heads, roll=True)
        self._close_writer()
        self.order += range(first, self.next_pack)
        self.staging = None
        self._live = None
        self._dirty = True

    def _append(
        self,
        sample_id: int,
        data: bytes,
        target: dict[int, Entry],
        heads: dict[int, int],
        roll: bool,
    ) -> None:
        """Append a record to the pack being written (a new one if none is), its entry into
        ``target``; ``roll``: a pack that would pass MAX_PACK_BYTES is closed, a new one begun."""
        head = record_head(sample_id, len(data))
        size = len(head) + len(data)
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
        self._buffer += head
        self._buffer += data
        self._written += size
        if len(self._buffer) >= 1 << 20:
            self.flush()
        target[sample_id] = entry
        codec_head = header_size(data)
        if codec_head:
            heads[sample_id] = codec_head

    def _close_writer(self) -> None:
        if self._writer is not None:
            if self.staging is not None:
                self._sizes[self.staging] = self._written
            self.flush()
            os.close(self._writer)
            self._writer = None

    def stage(self, sample_id: int, data: bytes) -> None:
        """Phase 1: append a received sample to this exchange's staging pack."""
        if self._staged is None:
            self._staged = {}
        self._append(sample_id, data, self._staged, self._staged_heads, roll=False)

    def flush(self) -> None:
        """What was staged is in the file (before the journal names the staging pack)."""
        if self._writer is not None and self._buffer:
            view = memoryview(self._buffer)
            while view:  # os.write releases the GIL
                view = view[os.write(self._writer, view) :]
            view.release()
            self._buffer = bytearray()

    def staged(self) -> dict[int, Entry]:
        """The staged records: as written by this process, or read back from the staging pack
        the journal names (after a kill)."""
        self.flush()
        if self._staged is None:
            self._staged = self._scan(self.staging) if self.staging is not None else {}
        return self._staged

    def staged_bytes(self, sample_id: int) -> bytes:
        pack, offset, length = self.staged()[sample_id]
        return self._record(sample_id, pack, offset, length)

    def _scan(self, pack: int) -> dict[int, Entry]:
        path = self.pack_file(pack)
        if not path.exists():
            return {}
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise LayoutError(f"cannot read the staging pack {str(path)!r}: {exc}") from exc
        v1 = data[: len(PACK_MAGIC)] == PACK_MAGIC_V1
        if data[: len(PACK_MAGIC)] != PACK_MAGIC and not v1:
            raise LayoutError(f"{str(path)!r} is not a pack file (malformed or truncated)")
        records, offset = {}, len(PACK_MAGIC)
        while offset < len(data):
            try:
                if v1:
                    sample_id, length = RECORD_V1.unpack_from(data, offset)
                    body = offset + RECORD_V1.size
                else:
                    sample_id, length, body = _parse_head(data, offset)
            except (struct.error, IndexError):
                raise LayoutError(
                    f"the pack {str(path)!r} is truncated at offset {offset}"
                ) from None
            if body + length > len(data):
                raise LayoutError(
                    f"the pack {str(path)!r} is truncated: the record of sample {sample_id} at "
                    f"offset {offset} needs {length} bytes"
                )
            records[sample_id] = (pack, offset, length)
            codec_head = header_size(data[body : body + length])
            if codec_head:
                self._staged_heads[sample_id] = codec_head
            offset = body + length
        return records

    def take(self, sample_id: int) -> None:
        """Phase 2: a staged sample joins the index (idempotent)."""
        entry = self.staged().get(sample_id)
        if entry is not None:
            if self._live is not None and sample_id not in self.index:
                self._live[entry[0]] = self._live.get(entry[0], 0) + self._record_size(
                    sample_id, *entry
                )
            self.index[sample_id] = entry
            if sample_id in self._staged_heads:
                self.heads[sample_id] = self._staged_heads[sample_id]
            if entry[0] not in self.order:
                self.order.append(entry[0])
            self._dirty = True

    def remove(self, sample_id: int) -> None:
        entry = self.index.pop(sample_id, None)
        if entry is not None:
            if self._live is not None:
                self._live[entry[0]] -= self._record_size(sample_id, *entry)
            self.heads.pop(sample_id, None)
            self._dirty = True

    def _record_size(self, sample_id: int, pack: int, offset: int, length: int) -> int:
        return self._head_size(pack, sample_id, length) + length

    def _live_by_pack(self) -> dict[int, int]:
        """The bytes of every pack's live records: counted once, then kept up to date by
        ``take`` and ``remove`` (a compaction's scan costs no pass over the index)."""
        if self._live is None:
            live: dict[int, int] = {}
            for sample_id, entry in self.index.items():
                live[entry[0]] = live.get(entry[0], 0) + self._record_size(sample_id, *entry)
            self._live = live
        return {pack: size for pack, size in self._live.items() if size > 0}

    # -- saving ------------------------------------------------------------------------------
    def persist(self, ending: bool) -> None:
        """Before the journal is saved: staged bytes flushed; ``ending`` (no exchange pending
        any more): the staging pack is no longer one; after a change, the new index written
        (the journal will name it)."""
        if ending:
            self.end_exchange()
        self.flush()
        if not self._dirty:
            return
        live = {pack for pack, _, _ in self.index.values()}
        self.order = [p for p in self.order if p in live or p == self.staging]
        ids = [i for group in self.groups() for i in group]  # age order: small deltas
        entries = np.array([self.index[i] for i in ids], dtype=np.uint32).reshape(-1, 3)
        id_column = np.array(ids, dtype=np.int64)
        offsets = entries[:, 1].copy()
        columns = [
            _COUNT.pack(len(ids)),
            np.diff(id_column, prepend=np.int64(0)).astype("<i8").tobytes(),
            entries[:, 0].astype("<u4").tobytes(),
            np.diff(offsets, prepend=np.uint32(0)).astype("<u4").tobytes(),
            entries[:, 2].astype("<u4").tobytes(),
            np.array([self.heads.get(i, 0) for i in ids], dtype="<u4").tobytes(),
        ]
        self.gen += 1
        file = self.index_file(self.gen)
        tmp = file.with_suffix(".tmp")
        tmp.write_bytes(INDEX_MAGIC + zlib.compress(b"".join(columns), 1))
        os.replace(tmp, file)
        self._dirty = False

    def end_exchange(self) -> None:
        """The exchange is over (committed or not): nothing is staged any more."""
        self._close_writer()
        self.staging = None
        self._staged_heads = {}

    def compact(self) -> bool:
        """Copy the live records of the packs chosen (module docstring: less than
        ``REWRITE_BELOW`` live, then the least live while the files would pass
        ``OVERHEAD_BUDGET``) into a new pack, which takes the age of the oldest of them; True
        when it did (the caller saves the journal, which writes the new index). Safe while other
        threads read: the new index replaces the old in one assignment once the new pack is
        written, and the old packs stay until ``drop_superseded``. Not while anything is
        staged."""
        if self.staging is not None:
            return False
        index = self.index
        live = self._live_by_pack()
        sizes = {pack: self._pack_size(pack) for pack in live}
        index_size = self.index_file(self.gen).stat().st_size if self.gen else 0
        total = sum(sizes.values()) + index_size
        if total - len(PACK_MAGIC) * len(sizes) - index_size <= sum(live.values()):
            return False  # no dead record anywhere
        budget = (1 + OVERHEAD_BUDGET) * self.own_bytes()
        share = {pack: live[pack] / max(1, sizes[pack] - len(PACK_MAGIC)) for pack in live}
        chosen = []
        for pack in sorted((p for p in live if share[p] < 1.0), key=lambda p: (share[p], p)):
            if share[pack] >= REWRITE_BELOW and total <= budget:
                break
            chosen.append(pack)
            total -= sizes[pack] - live[pack] - len(PACK_MAGIC)
        if not chosen:
            return False
        rewritten = set(chosen)
        moving = sorted(
            (entry, sample_id) for sample_id, entry in index.items() if entry[0] in rewritten
        )
        new_index, heads = dict(index), dict(self.heads)
        first = self.next_pack
        for (pack, offset, length), sample_id in moving:
            head = self._head_size(pack, sample_id, length)
            data = os.pread(self._fd(pack), head + length, offset)
            if len(data) != head + length:
                raise LayoutError(
                    f"cannot compact {str(self.pack_file(pack))!r}: truncated at {offset}"
                )
            self._append(sample_id, data[head:], new_index, heads, roll=True)
            self.copied += len(data)
        self._close_writer()
        self.staging = None
        made = list(range(first, self.next_pack))
        oldest = min(self.order.index(p) if p in self.order else len(self.order) for p in chosen)
        kept = [p for p in self.order if p not in rewritten]
        at = sum(1 for p in self.order[:oldest] if p not in rewritten)
        self.order = kept[:at] + made + kept[at:]
        self.index, self.heads, self._dirty = new_index, heads, True
        kept_live = {p: v for p, v in live.items() if p not in rewritten}
        for pack in made:  # every record in them is live
            kept_live[pack] = self._pack_size(pack) - len(PACK_MAGIC)
        self._live = kept_live
        return True

    def _pack_size(self, pack: int) -> int:
        size = self._sizes.get(pack)
        if size is None:  # written by another process: once
            size = self._sizes[pack] = os.stat(self.pack_file(pack)).st_size
        return size

    def forget_staged(self) -> None:
        """The exchange ended: nothing staged any more, the descriptors of packs the index no
        longer names closed; their files stay for ``drop_superseded``."""
        self.end_exchange()
        self._staged = None
        self._close_fds(keep={pack for pack, _, _ in self.index.values()})

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
        """The live samples' bytes as stored (codec headers included)."""
        return sum(length for _, _, length in self.index.values())

    def own_bytes(self) -> int:
        """The live samples' own bytes (codec.py: the arrays' nbytes, 8 per number; a pickled
        sample's bytes)."""
        return self.live_bytes() - sum(self.heads.get(i, 0) for i in self.index)

    def files(self) -> list[Path]:
        found = [self.pack_file(p) for p in {p for p, _, _ in self.index.values()}]
        return sorted(found + ([self.index_file(self.gen)] if self.gen else []))


def _number(file: Path) -> int | None:
    try:
        return int(file.stem)
    except ValueError:
        return None
