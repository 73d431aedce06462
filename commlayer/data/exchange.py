"""The chunks of one epoch's exchange, moved by commlayer's alltoall, their bytes read, packed,
unpacked and written by an I/O thread of the data module.

1. Chunk k of every rank travels in one ``alltoall_async`` of bytes: the part for rank q is a
   frame of (sample id, length, bytes) records, its length the split for q, so samples of any
   size travel without padding.
2. The I/O thread (one per shuffler, ``commlayer-shuffle-io``) reads the samples of chunk k and
   packs them while the training thread computes: chunk 0 when the epoch's first sample is
   drawn (then it compacts the store's pack files where the last commit left them due,
   packs.py), chunk k + 1 when chunk k is submitted. The training thread only starts the alltoall
   (the engine moves it) and, when a chunk is done, hands the received bytes back to the I/O
   thread, which unpacks them and stages them in the store. File reads and writes release the
   GIL.
3. A rank that cannot read a sample it must send still takes part: it sends every peer an error
   frame naming itself and the file, and every rank raises that error in ``finish``, after all
   chunks are done, so that no rank waits forever on a chunk another rank gave up on. Any other
   error on the I/O thread is kept the same way and raised on the training thread by ``finish``
   (a ShardStoreError naming the rank, the thread and the chunk; the original as its cause).
4. ``collect`` counts what was staged per sender, for the vote that ends the exchange.
"""

from __future__ import annotations

import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from commlayer import ops
from commlayer.common.errors import ShardStoreError
from commlayer.data.plan import Plan
from commlayer.data.store import ShardStore

_DATA, _ERROR = b"D", b"E"
_RECORD = struct.Struct("<qq")  # sample id, length in bytes
THREAD_NAME = "commlayer-shuffle-io"


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
    view = memoryview(frame)
    while offset < len(frame):
        sample_id, length = _RECORD.unpack_from(frame, offset)
        offset += _RECORD.size
        records.append((sample_id, bytes(view[offset : offset + length])))
        offset += length
    return records


def io_thread() -> ThreadPoolExecutor:
    """The I/O thread of a shuffler: one, so that its jobs run in the order submitted."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)


_Payload = tuple[torch.Tensor, list[int]]


class Exchange:
    """One epoch's chunks on this rank: prepared on the I/O thread, submitted in order by the
    training thread, staged on the I/O thread when done."""

    __slots__ = (
        "plan",
        "store",
        "rank",
        "size",
        "name",
        "handles",
        "received",
        "sent_bytes",
        "received_bytes",
        "vote",
        "io_s",
        "io_waited_s",
        "compacted_bytes",
        "compaction",
        "_io",
        "_payloads",
        "_staging",
        "_error",
    )

    def __init__(
        self,
        plan: Plan,
        store: ShardStore,
        rank: int,
        size: int,
        name: str,
        io: ThreadPoolExecutor | None = None,
    ) -> None:
        """``io``: the I/O thread (None: the caller's thread does the I/O)."""
        self.plan, self.store, self.rank, self.size, self.name = plan, store, rank, size, name
        self.handles: list[ops.Handle | None] = []
        self.received = [0] * size  # samples staged, per sender
        self.sent_bytes = self.received_bytes = 0
        self.vote: ops.Handle | None = None  # the vote that ends it (the shuffler's)
        self.io_s = 0.0  # the I/O thread's time on this exchange
        self.io_waited_s = 0.0  # the training thread's time blocked on the I/O thread
        self.compacted_bytes = 0  # what the compaction at its start copied
        self._io = io
        self._payloads: list[Future[_Payload] | None] = []
        self._staging: list[Future[None]] = []
        self._error: ShardStoreError | None = None
        self.compaction: Future[None] | None = None

    def start(self) -> None:
        """The epoch begins (the sampler's first sample): the I/O thread prepares chunk 0, then
        compacts the store where the last commit left it due (before anything is staged).
        Nothing runs before: an exchange planned and never iterated leaves the files alone."""
        if self.compaction is None:
            self._prepare_next()  # chunk 0 first: the sampler submits it soonest
            self.compaction = self._run(self._compact)

    @property
    def submitted(self) -> int:
        return len(self.handles)

    def _run(self, function: object, *args: object) -> Future:  # type: ignore[type-arg]
        """``function(*args)`` on the I/O thread, or here (no thread), as a future."""
        if self._io is not None:
            return self._io.submit(function, *args)  # type: ignore[arg-type]
        future: Future[object] = Future()
        future.set_result(function(*args))  # type: ignore[operator]
        return future

    def _prepare_next(self) -> None:
        k = len(self._payloads)
        if k < len(self.plan.sends):
            self._payloads.append(self._run(self._payload, k))

    def submit_next(self) -> None:
        """Start the next chunk's alltoall (the engine moves it while the caller computes)."""
        self.start()
        k = len(self.handles)
        future, self._payloads[k] = self._payloads[k], None
        assert future is not None
        tensor, splits = self._wait(future)
        self._prepare_next()
        self.sent_bytes += sum(splits)
        self.handles.append(ops.alltoall_async(tensor, splits, name=f"{self.name}.chunk{k}"))

    def collect(self, block: bool) -> None:
        """Hand every submitted chunk that is done to the I/O thread to stage (all of them when
        ``block``, and then wait until they are staged)."""
        for k, handle in enumerate(self.handles):
            if handle is None or not (block or handle.done()):
                continue
            self.handles[k] = None
            output, splits = ops.synchronize(handle)
            self._staging.append(self._run(self._stage_chunk, k, output, splits.tolist()))
        if block:
            for future in self._staging:
                self._wait(future)
            self._staging = []
            if self._error is not None:
                raise self._error  # only once every chunk is done: no rank is left waiting

    def finish(self) -> None:
        """Submit what is left, then wait for every chunk and for its staging."""
        self.start()
        while self.submitted < len(self.plan.sends):
            self.submit_next()
        assert self.compaction is not None
        self._wait(self.compaction)
        self.collect(block=True)

    def _wait(self, future: Future):  # type: ignore[no-untyped-def, type-arg]
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.io_waited_s += time.perf_counter() - t0

    # -- on the I/O thread -------------------------------------------------------------------
    def _compact(self) -> None:
        t0 = time.perf_counter()
        before = self.store.compacted_bytes()
        try:
            self.store.compact()
            self.compacted_bytes = self.store.compacted_bytes() - before
        except Exception as exc:
            self._fail(exc, "compacting the store")
        finally:
            self.io_s += time.perf_counter() - t0

    def _payload(self, k: int) -> _Payload:
        t0 = time.perf_counter()
        try:
            frames = self._frames(k, self.plan.sends[k])
            try:
                payload = bytearray().join(frames)
            except Exception as exc:  # MemoryError: the peers still get this chunk
                frames = self._error_frames(exc, f"packing chunk {k}")
                payload = bytearray().join(frames)
            tensor = (
                torch.frombuffer(payload, dtype=torch.uint8)
                if payload
                else torch.empty(0, dtype=torch.uint8)
            )
            return tensor, [len(frame) for frame in frames]
        finally:
            self.io_s += time.perf_counter() - t0

    def _frames(self, k: int, sends: tuple[tuple[int, int], ...]) -> list[bytes]:
        records: list[list[tuple[int, bytes]]] = [[] for _ in range(self.size)]
        try:
            for sample_id, dest in sends:
                records[dest].append((sample_id, self.store.dump(sample_id)))
        except Exception as exc:  # every peer must hear of it, or it would wait for the chunk
            return self._error_frames(exc, f"reading chunk {k}'s samples")
        return [pack(r) if r else b"" for r in records]

    def _error_frames(self, exc: Exception, doing: str) -> list[bytes]:
        self._fail(exc, doing)
        assert self._error is not None
        message = _ERROR + str(self._error).encode()
        return [message if q != self.rank else b"" for q in range(self.size)]

    def _stage_chunk(self, k: int, output: torch.Tensor, splits: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            data, offset = output.numpy().tobytes(), 0
            for sender, length in enumerate(splits):
                frame, offset = data[offset : offset + length], offset + length
                if length:
                    self.received_bytes += length
                    self._stage(sender, frame)
        except Exception as exc:
            self._fail(exc, f"staging chunk {k}")
        finally:
            self.io_s += time.perf_counter() - t0

    def _stage(self, sender: int, frame: bytes) -> None:
        try:
            records = unpack(frame)
        except ShardStoreError as exc:
            self._error = self._error or exc
            return
        for sample_id, data in records:
            self.store.stage(sample_id, data)
        self.received[sender] += len(records)

    def _fail(self, exc: Exception, doing: str) -> None:
        """Keep the first error for ``finish`` to raise on the training thread."""
        if self._error is not None:
            return
        if isinstance(exc, ShardStoreError):
            self._error = exc
        else:
            error = ShardStoreError(
                f"rank {self.rank}: the shuffler's I/O thread failed {doing} of {self.name}: "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            self._error = error
