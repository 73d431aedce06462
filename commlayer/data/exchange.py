"""The chunks of one epoch's exchange, moved by commlayer's alltoall.

1. Chunk k of every rank travels in one ``alltoall_async`` of bytes: the part for rank q is a
   frame of (sample id, length, bytes) records, its length the split for q, so samples of any
   size travel without padding.
2. A rank that cannot read a sample it must send still takes part: it sends every peer an error
   frame naming itself and the file, and every rank raises that error in ``finish``, after all
   chunks are done, so that no rank waits forever on a chunk another rank gave up on.
3. ``collect`` stages what arrived in the store (phase 1 of the store's two-phase change) and
   counts it per sender, for the vote that ends the exchange.
"""

from __future__ import annotations

import struct

import torch

from commlayer import ops
from commlayer.data.plan import Plan
from commlayer.data.store import ShardStore
from commlayer.errors import ShardStoreError

_DATA, _ERROR = b"D", b"E"
_RECORD = struct.Struct("<qq")  # sample id, length in bytes


def pack(records: list[tuple[int, bytes]]) -> bytes:
    parts = [_DATA]
    for sample_id, data in records:
        parts += [_RECORD.pack(sample_id, len(data)), data]
    return b"".join(parts)


def unpack(frame: bytes) -> list[tuple[int, bytes]]:
    """The records of a frame; an error frame raises its error here."""
    if frame[:1] == _ERROR:
        raise ShardStoreError(frame[1:].decode())
    records, offset = [], 1
    while offset < len(frame):
        sample_id, length = _RECORD.unpack_from(frame, offset)
        offset += _RECORD.size
        records.append((sample_id, frame[offset : offset + length]))
        offset += length
    return records


class Exchange:
    """One epoch's chunks on this rank: submitted in order, collected when done."""

    __slots__ = (
        "plan",
        "store",
        "rank",
        "size",
        "name",
        "handles",
        "received",
        "sent_bytes",
        "vote",
        "_error",
    )

    def __init__(self, plan: Plan, store: ShardStore, rank: int, size: int, name: str) -> None:
        self.plan, self.store, self.rank, self.size, self.name = plan, store, rank, size, name
        self.handles: list[ops.Handle | None] = []
        self.received = [0] * size  # samples staged, per sender
        self.sent_bytes = 0
        self.vote: ops.Handle | None = None  # the vote that ends it (the shuffler's)
        self._error: ShardStoreError | None = None

    @property
    def submitted(self) -> int:
        return len(self.handles)

    def submit_next(self) -> None:
        """Start the next chunk's alltoall (the engine moves it while the caller computes)."""
        k = len(self.handles)
        frames = self._frames(self.plan.sends[k])
        payload = b"".join(frames)
        tensor = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.empty(0, dtype=torch.uint8)
        )
        splits = [len(frame) for frame in frames]
        self.sent_bytes += len(payload)
        self.handles.append(ops.alltoall_async(tensor, splits, name=f"{self.name}.chunk{k}"))

    def collect(self, block: bool) -> None:
        """Stage every submitted chunk that is done (all of them when ``block``)."""
        for k, handle in enumerate(self.handles):
            if handle is None or not (block or handle.done()):
                continue
            self.handles[k] = None
            output, splits = ops.synchronize(handle)
            data, offset = output.numpy().tobytes(), 0
            for sender, length in enumerate(splits.tolist()):
                frame, offset = data[offset : offset + length], offset + length
                if length:
                    self._stage(sender, frame)
        if block and self._error is not None:
            raise self._error  # only once every chunk is done: no rank is left waiting in one

    def finish(self) -> None:
        """Submit what is left, then wait for and stage every chunk."""
        while self.submitted < len(self.plan.sends):
            self.submit_next()
        self.collect(block=True)

    def _frames(self, sends: tuple[tuple[int, int], ...]) -> list[bytes]:
        records: list[list[tuple[int, bytes]]] = [[] for _ in range(self.size)]
        try:
            for sample_id, dest in sends:
                records[dest].append((sample_id, self.store.dump(sample_id)))
        except ShardStoreError as exc:
            self._error = exc
            message = _ERROR + str(exc).encode()
            return [message if q != self.rank else b"" for q in range(self.size)]
        return [pack(r) if r else b"" for r in records]

    def _stage(self, sender: int, frame: bytes) -> None:
        try:
            records = unpack(frame)
        except ShardStoreError as exc:
            self._error = self._error or exc
            return
        for sample_id, data in records:
            self.store.stage(sample_id, data)
        self.received[sender] += len(records)
