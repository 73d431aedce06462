"""Intra-node allreduce through a shared-memory window.

Between ranks of one node MPI's allreduce moves data through its own queues at ~1-4 GB/s busbw
(benchmarks/README.md, Yardsticks), and gloo's through TCP over loopback, while one core copies
24-30 GB/s.
Here every rank of the node maps the same window (the MPI backend: an MPI-3 window,
``MPI.Win.Allocate_shared``; the torch backend, under torchrun: ``FileWindow``, files in
/dev/shm that every rank maps) and an allreduce of a buffer is, per chunk:

1. copy in: each rank copies the parts of its chunk that other ranks reduce (every slice but its
   own) into its own segment, then raises its flag;
2. reduce: once every flag is up, rank r reduces slice r from its own input and every other
   segment (in rank order) straight into its own segment, then raises its flag again;
3. copy out: once every flag is up again, each rank copies every slice into its output.

Skipping the copy of a rank's own slice saves 1/p of the copying: at 64 MiB the window is cache
resident and the input and output stream from and to DRAM, so what is left is close to one
memory copy per rank (on the 2-core VM of benchmarks/results/algorithms_np2.md two ranks each
copying 64 MiB with ``Tensor.copy_`` at once took ~11 ms, the window allreduce 15-30 ms).
Each slice is reduced by exactly one rank and copied by all, so every rank gets the same bits
(with ``inter``, below, too: its result is the same bits on all of its ranks).
Chunks alternate between two halves of each segment: a rank can write chunk k+2 into a half only
after every rank raised its "reduced" flag for chunk k+1, which each does after copying chunk k
out, so no rank overwrites data another still reads. Flags are monotonic counters (2 per chunk)
in a cache line of their own; the window's ``sync`` (MPI_Win_sync, a memory barrier in the
window's ``Lock_all`` epoch, as MPI-3's shared-memory model requires; FileWindow's: below) orders
data before flags.

As the local leg of ``hierarchical`` (algorithms/hierarchical.py: several nodes of g ranks
each), rank r raises its "reduced" flag only after ``inter`` has allreduced its reduced slice in
place with the ranks of the same local index on the other nodes, which hold the same slice (same
g, chunking and dtype). So a chunk is reduce-scattered through the window, 1/g of it per rank
crosses between nodes, and it is allgathered through the window. The g allreduces across nodes
run at once, on separate slices; a chunk's copy out waits for the slowest of them (chunks do not
overlap), so the cost per chunk is the window's plus one inter-node allreduce of chunk/g bytes.

The engine hands a fused bucket over as pieces (``iallreduce_pieces``): the tensors
themselves, read in step 1 and 2 and written in step 3, each scaled by its own factor (Average's
1/n) as it is copied out. The window copies every byte in and out anyway, so a fusion buffer
would only add a pass each way (benchmark MLP at 2 ranks: ~4 ms of ~45 per step).

DistributedOptimizer's planned buckets can live in a window of their own (``BucketWindow``,
COMMLAYER_WINDOW_BUCKETS): there backward writes the gradients into the segment, so step 1's
copy in is gone, and each rank writes its reduced slice into the others' buckets instead of
every rank copying every slice out.

``test()`` advances as far as it can without waiting, so the engine's yield-then-sleep wait loop
drives it like any MPI request: no busy-polling, and a dead peer is still noticed.
"""

from __future__ import annotations

import bisect
import mmap
import os
import platform
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from commlayer.backends.base import Request
from commlayer.common.reduce_ops import ReduceOp, reduce_into, reduce_out, scale_into

_FLAG_BYTES = 128  # one flag per rank, alone in its cache lines (no false sharing)
_ALIGN = 64  # slice boundaries on cache lines
# per rank and half-window (both backends); at 64 MiB over MPI 1, 2 and 4 MiB were measured:
# 2 MiB best or tied
CHUNK_BYTES = 2 << 20


class Window(Protocol):
    """Memory every rank of a node maps: one segment per rank, and how to order it.

    ``segments[r]``: rank r's segment (uint8, the size asked for), mapped in this process;
    ``sync()``: a full memory barrier (data written before a flag is visible before it, and a
    flag seen makes the data written before it visible); ``barrier()``: every rank of the node
    reaches it before any leaves; ``close()``: unmaps (collective where the memory needs it)."""

    segments: list[np.ndarray]

    def sync(self) -> None: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class FileWindow:
    """Shared memory without MPI (the torch backend's window): one file per rank in a tmpfs
    (``/dev/shm``), every rank mapping every file. Made collectively: ``token`` is the same on
    every rank and new to this window (the file names).

    Each rank creates its own file, reserves its pages (``posix_fallocate``: a tmpfs too small
    fails here with ENOSPC, not later with SIGBUS), maps every rank's after a barrier, and
    unlinks its own after a second: from then on nothing is left on disk, even if the job is
    killed. ``sync()``: on x86-64 none is needed (stores are seen in program order, loads are not
    reordered with loads, and glibc fences its non-temporal copies), elsewhere numba's fence
    where numba is installed; without either, ``FileWindow.usable()`` is False and the torch
    backend keeps to gloo."""

    DIRECTORY = "/dev/shm"

    def __init__(
        self, rank: int, size: int, token: str, segment: int, agree: Callable[[bool], bool]
    ) -> None:
        """``agree(ok)``: True on every rank when every rank passes True (a collective AND:
        it is also the node's barrier). A rank that cannot make its file makes every rank
        raise OSError, naming the ranks that could not, instead of waiting for them."""
        self._agree = agree
        self._sync = _fence()
        self._maps: list[mmap.mmap] = []
        self.segments: list[np.ndarray] = []
        mine = self._path(token, rank)
        error: OSError | None = None
        try:
            fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, segment)
            finally:
                os.close(fd)
        except OSError as exc:
            error = exc
        if not agree(error is None):
            if error is None:
                os.unlink(mine)
            why = str(error) if error else "another rank could not make its file"
            raise OSError(
                f"rank {rank}: no shared-memory window of {size} x {segment} B in "
                f"{self.DIRECTORY}: {why}"
            )
        try:
            for r in range(size):
                fd = os.open(self._path(token, r), os.O_RDWR)
                try:
                    self._maps.append(mmap.mmap(fd, segment))
                finally:
                    os.close(fd)
                self.segments.append(np.frombuffer(self._maps[-1], dtype=np.uint8))
        finally:
            agree(True)  # every rank mapped every file (or failed): the names can go
            os.unlink(mine)

    @classmethod
    def usable(cls) -> bool:
        """Whether this process can make one: a writable tmpfs and a memory barrier."""
        if not os.access(cls.DIRECTORY, os.W_OK | os.X_OK):
            return False
        try:
            _fence()
        except ImportError:
            return False
        return True

    @classmethod
    def _path(cls, token: str, rank: int) -> str:
        return os.path.join(cls.DIRECTORY, f"commlayer-{token}-{rank}")

    def sync(self) -> None:
        self._sync()

    def barrier(self) -> None:
        self._agree(True)

    def close(self) -> None:
        self.segments = []
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a view still exported (a request not collected yet)
                pass
        self._maps = []


def _no_fence() -> None:
    pass


_FENCE: list[Callable[[], None]] = []


def _fence() -> Callable[[], None]:
    """A full memory barrier callable from Python (FileWindow.sync); ImportError where none."""
    if _FENCE:
        return _FENCE[0]
    if platform.machine().lower() in ("x86_64", "amd64"):
        _FENCE.append(_no_fence)
        return _no_fence
    from numba import njit, types  # ImportError: no barrier here
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[misc]
    def _seq_cst(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    @njit(nogil=True)  # type: ignore[misc]
    def fence() -> None:
        _seq_cst()  # type: ignore[call-arg]

    fence()
    _FENCE.append(fence)
    return fence


# Bytes this process copied into, out of and between shared-memory windows (both kinds of
# window, on whatever thread drives them): memory traffic on top of the reductions' reads, as
# communication_stats()'s window_copied_bytes reports it from the engine's start.
_copied = [0]


def copied_bytes() -> int:
    return _copied[0]


class SharedMemoryAllreduce:
    """A shared window over the ranks of a node and its flag counters.

    Collective: every rank of the node constructs it together; ``chunk_bytes`` must agree.
    ``window(segment_bytes)`` maps the memory: backends/mpi.py's ``MPIWindow``, or
    ``FileWindow`` (the torch backend's)."""

    def __init__(
        self, rank: int, size: int, chunk_bytes: int, window: Callable[[int], Window]
    ) -> None:
        self.rank = rank
        self.size = size
        self.others = [r for r in range(self.size) if r != self.rank]  # reduction order
        self.chunk_bytes = _chunk_bytes(self.size, chunk_bytes)
        self._segment = _FLAG_BYTES + 2 * self.chunk_bytes
        self.win = window(self._segment)
        self._flags: list[np.ndarray] = []
        self._halves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for raw in self.win.segments:
            self._flags.append(raw[:8].view(np.int64))
            data = torch.from_numpy(raw[_FLAG_BYTES:])
            self._halves.append((data[: self.chunk_bytes], data[self.chunk_bytes :]))
        self._views: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._flags[self.rank][0] = 0
        self.seq = 0  # this rank's flag value: 2 per chunk done
        self.chunks = 0  # chunks done, for the half to use
        self.win.sync()
        self.win.barrier()

    def raise_flag(self) -> None:
        self.win.sync()  # data written before the flag is visible before it
        self.seq += 1
        self._flags[self.rank][0] = self.seq

    def all_reached(self, target: int) -> bool:
        self.win.sync()  # see the peers' flags and the data written before them
        return all(int(flag[0]) >= target for flag in self._flags)

    def views(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's two halves as whole chunks of ``dtype`` (made once per dtype)."""
        views = self._views.get(dtype)
        if views is None:
            usable = self.chunk_bytes // dtype.itemsize * dtype.itemsize
            views = [(a[:usable].view(dtype), b[:usable].view(dtype)) for a, b in self._halves]
            self._views[dtype] = views
        return views

    def slices(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        """(start, stop) of each rank's slice of a chunk of ``numel`` elements."""
        return _slices(numel, itemsize, self.size)

    def iallreduce(
        self,
        send: torch.Tensor | None,
        recv: torch.Tensor,
        op: ReduceOp,
        inter: Callable[[torch.Tensor], Request] | None = None,
    ) -> Request:
        """``inter``: allreduces a reduced slice in place across nodes (hierarchical's leg
        between nodes; its peers must hold the same slice: same size, chunking and dtype)."""
        out = recv.view(-1)
        src = out if send is None else send.view(-1)
        return _Request(self, _Pieces([src]), _Pieces([out]), [1.0], op, inter)

    def iallreduce_pieces(
        self,
        sources: list[torch.Tensor],
        outputs: list[torch.Tensor],
        scales: list[float],
        op: ReduceOp,
    ) -> Request:
        """Allreduce the concatenation of ``sources`` (1-D, one floating dtype) into
        ``outputs`` (same sizes; output i may be source i itself), output i scaled by
        ``scales[i]`` as it is written: a fused bucket without packing or unpacking it."""
        return _Request(self, _Pieces(sources), _Pieces(outputs), scales, op, None)

    def close(self) -> None:
        self._halves, self._views, self._flags = [], {}, []
        self.win.close()


def _slices(numel: int, itemsize: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) of each of ``size`` ranks' slice of a chunk of ``numel`` elements."""
    align = max(1, _ALIGN // itemsize)
    step = -(-numel // size)
    step = -(-step // align) * align
    return [(min(r * step, numel), min((r + 1) * step, numel)) for r in range(size)]


def _chunk_bytes(size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The bytes of a chunk over ``size`` ranks (at least a cache line a rank)."""
    return max(_ALIGN * size, chunk_bytes // _ALIGN * _ALIGN)


class _Pieces:
    """Consecutive 1-D tensors read or written as one virtual flat buffer: a fused bucket's
    gradients, copied straight into and out of the window instead of through a fusion buffer
    (one pass less each way)."""

    __slots__ = ("starts", "tensors")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.starts = [0]
        for tensor in tensors:
            self.starts.append(self.starts[-1] + tensor.numel())

    def parts(self, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor, int]]:
        """(piece index, the view of that piece, its position) covering [lo, hi)."""
        i = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            start, end = self.starts[i], self.starts[i + 1]
            if end > lo:
                stop = min(hi, end)
                yield i, self.tensors[i][lo - start : stop - start], lo
                lo = stop
            i += 1


class _Request:
    """One allreduce in flight: a state machine that ``test()`` advances without waiting."""

    __slots__ = (
        "_shm", "_src", "_out", "_scales", "_op", "_inter", "_across", "_offset", "_numel",
        "_phase", "_target", "_chunk", "_slices", "_views", "_segments",
    )  # fmt: skip

    def __init__(
        self,
        shm: SharedMemoryAllreduce,
        src: _Pieces,
        out: _Pieces,
        scales: list[float],
        op: ReduceOp,
        inter: Callable[[torch.Tensor], Request] | None,
    ) -> None:
        self._shm = shm
        self._src = src
        self._out = out
        self._scales = scales  # per piece of out, applied as it is copied out
        self._op = op
        self._inter = inter
        self._across: Request | None = None  # my slice's allreduce across nodes, in flight
        self._offset = 0
        self._numel = out.starts[-1]
        self._phase = 0
        self._target = 0
        dtype = out.tensors[0].dtype
        self._chunk = shm.chunk_bytes // dtype.itemsize
        self._views = shm.views(dtype)
        self._slices: list[tuple[int, int]] = []  # of the chunk in flight
        self._segments: list[torch.Tensor] = []  # every rank's segment for the chunk in flight

    def test(self) -> bool:
        shm = self._shm
        me = shm.rank
        while self._offset < self._numel:
            offset = self._offset
            count = min(self._chunk, self._numel - offset)
            if self._phase == 0:  # copy in all but my slice, flag "arrived"
                half = shm.chunks % 2
                self._segments = [views[half][:count] for views in self._views]
                self._slices = shm.slices(count, self._views[me][0].element_size())
                mine = self._segments[me]
                start, stop = self._slices[me]
                for lo, hi in ((0, start), (stop, count)):
                    for _, part, at in self._src.parts(offset + lo, offset + hi):
                        mine[at - offset : at - offset + part.numel()].copy_(part)
                _copied[0] += (count - (stop - start)) * mine.element_size()
                shm.raise_flag()
                self._target = shm.seq
                self._phase = 1
            if self._phase == 1:  # every rank's chunk is in: reduce my slice (and across nodes)
                if not shm.all_reached(self._target):
                    return False
                start, stop = self._slices[me]
                if stop > start:  # size >= 2: the backend sends size 1 elsewhere
                    acc, first = self._segments[me], self._segments[shm.others[0]]
                    for _, part, at in self._src.parts(offset + start, offset + stop):
                        at -= offset
                        end = at + part.numel()
                        reduce_out(part, first[at:end], acc[at:end], self._op)
                    for r in shm.others[1:]:
                        reduce_into(acc[start:stop], self._segments[r][start:stop], self._op)
                    if self._inter is not None:
                        self._across = self._inter(acc[start:stop])
                self._phase = 2
            if self._phase == 2:  # my slice final: flag "reduced"
                if self._across is not None:
                    if not self._across.test():
                        return False
                    self._across = None
                shm.raise_flag()
                self._target = shm.seq
                self._phase = 3
            if self._phase == 3:  # every slice reduced: copy all of them out
                if not shm.all_reached(self._target):
                    return False
                for r, (start, stop) in enumerate(self._slices):
                    segment = self._segments[r]
                    for index, part, at in self._out.parts(offset + start, offset + stop):
                        reduced = segment[at - offset : at - offset + part.numel()]
                        scale = self._scales[index]
                        if scale == 1.0:
                            part.copy_(reduced)
                        else:
                            scale_into(reduced, scale, part)
                _copied[0] += count * self._segments[me].element_size()
                shm.chunks += 1
                self._offset += count
                self._phase = 0
        return True


# -- buckets that live in a window -------------------------------------------------------------
# What DistributedOptimizer's planned buckets are allocated in (COMMLAYER_WINDOW_BUCKETS): a
# window of its own, made by a WINDOW operation (core/negotiation.py) that every rank of the
# optimizer's process set executes at the same point, whose segments ARE the buckets' memory.
# An allreduce of a tensor there is announced on the channel ``window:<token>:<offset>``
# (``window_channel``): negotiated, so every rank runs the same algorithm at the same offset,
# or every rank gets a mismatch error (a tensor in a window on one rank and not on another).
WINDOW_CHANNEL = "window:"
# by token: the windows made and neither closed nor dropped in this process (an optimizer
# holds its own: one dropped without a new plan takes its window's channel with it)
_LIVE: weakref.WeakValueDictionary[str, BucketWindow] = weakref.WeakValueDictionary()


class BucketWindow:
    """A window whose segment of rank r is rank r's planned buckets (flat buffers of
    gradients, which backward writes into) and the in-window allreduce of a part of it.

    Made collectively (``window(segment_bytes)``: a FileWindow in both backends, whose
    memory lives as long as a tensor views it: ``close`` while a gradient still views the
    memory unmaps nothing, where MPI_Win_free would leave the gradient dangling); ``token``:
    the same on every rank and new to this window.

    ``iallreduce(offset, numel, dtype, op, scale)`` of the ``numel`` elements at byte
    ``offset`` of every rank's segment (the same offset everywhere: the same plan), per part:

    1. arrive: raise my flag (backward's writes into my segment are final and visible);
    2. once every flag is up, rank r reduces slice r in place in its own segment, reading
       slice r of every other segment where backward left it (in the order of
       ``SharedMemoryAllreduce``: own, then the others by rank, so the bits are the window
       allreduce's), scales it (Average's 1/n, once, by the one rank that reduced it), and
       writes it into every other rank's segment (slice r of a segment is read and written
       by rank r alone: no rank writes where another reads); raise my flag;
    3. once every flag is up again, my segment holds the whole result, and no peer reads or
       writes it any more for this part: the request completes, and backward, zero_grad and
       the optimizer may touch the memory again (the next step's arrival orders them).

    No copy in (the regular window copies (p-1)/p of a bucket into its segment first), no
    copy out of a result area: each rank writes (p-1)/p of its slice's worth into the others'
    segments, the one copy of the reduced data a rank makes, (p-1)/p of a part in all. Each
    slice is reduced and scaled by one rank, so every rank holds the same bits. Flags are
    monotonic counters (2 per part), as ``SharedMemoryAllreduce``'s; every rank runs a window's
    allreduces in one order (negotiated), so the counters stay in step.

    Across machines (``across``: the ranks of a process set on several nodes, each node's
    ranks sharing a window of their own; algorithms/hierarchical.py's shared-memory form on
    these buffers): the window is one node's, ``rank`` and ``size`` this rank's index and the
    node's ranks, and in 2. rank r reduces slice r of each chunk over its node's segments,
    then ``across(slice, op)`` allreduces it in place with the ranks of the same index on the
    other nodes (the only bytes that leave the machine: 1/size of the part a rank), and only
    once that is done scales it and writes it into its node's other segments. The chunks and
    slices are those of the regular hierarchical window (``SharedMemoryAllreduce`` with
    ``inter``), so the bits are its bits."""

    def __init__(
        self,
        rank: int,
        size: int,
        nbytes: int,
        window: Callable[[int], Window],
        token: str,
        across: Callable[[torch.Tensor, ReduceOp], Request] | None = None,
    ) -> None:
        self.rank, self.size, self.token = rank, size, token
        self.across = across
        self.others = [r for r in range(size) if r != rank]
        self.nbytes = -(-nbytes // _ALIGN) * _ALIGN
        self.win: Window | None = window(_FLAG_BYTES + self.nbytes)
        self._flags = [raw[:8].view(np.int64) for raw in self.win.segments]
        self.segments = [torch.from_numpy(raw[_FLAG_BYTES:]) for raw in self.win.segments]
        self._flags[rank][0] = 0
        self.seq = 0
        self.chunk_bytes = _chunk_bytes(size)
        self.win.sync()
        self.win.barrier()
        _LIVE[token] = self

    @property
    def memory(self) -> torch.Tensor:
        """This rank's segment (uint8): where its buckets are allocated."""
        return self.segments[self.rank]

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """The byte offset of ``tensor`` in this rank's segment; None where it is not all
        inside it (or not contiguous)."""
        if not self.segments or not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        base = self.memory.data_ptr()
        at = tensor.data_ptr() - base
        if at < 0 or at + tensor.numel() * tensor.element_size() > self.nbytes:
            return None
        return at

    def raise_flag(self) -> None:
        assert self.win is not None
        self.win.sync()
        self.seq += 1
        self._flags[self.rank][0] = self.seq

    def all_reached(self, target: int) -> bool:
        assert self.win is not None
        self.win.sync()
        return all(int(flag[0]) >= target for flag in self._flags)

    def iallreduce(
        self, offset: int, numel: int, dtype: torch.dtype, op: ReduceOp, scale: float
    ) -> Request:
        """The in-window allreduce of the part at byte ``offset`` (class docstring)."""
        itemsize = dtype.itemsize
        if offset % itemsize or offset + numel * itemsize > self.nbytes:
            raise ValueError(f"no part of {numel} x {dtype} at byte {offset} of the window")
        parts = [s[offset : offset + numel * itemsize].view(dtype) for s in self.segments]
        return _InWindow(self, parts, op, scale)

    def close(self) -> None:
        """Unmap (memory a gradient still views stays mapped until it is dropped) and stop
        announcing its tensors on the window channel."""
        _LIVE.pop(self.token, None)
        self._flags, self.segments = [], []
        if self.win is not None:
            self.win.close()
            self.win = None


def window_channel(tensor: torch.Tensor) -> str:
    """The channel an allreduce of ``tensor`` in place is announced on: ``window:<token>:<byte
    offset>`` where it lies in a live BucketWindow, else "" (the default channel)."""
    for window in list(_LIVE.values()):
        at = window.offset_of(tensor)
        if at is not None:
            return f"{WINDOW_CHANNEL}{window.token}:{at}"
    return ""


def live_windows() -> bool:
    return bool(_LIVE)


def window_of(channel: str) -> tuple[BucketWindow | None, int]:
    """The live window and byte offset a window channel names (None: gone here)."""
    token, _, at = channel.removeprefix(WINDOW_CHANNEL).rpartition(":")
    return _LIVE.get(token), int(at)


class _InWindow:
    """One in-window allreduce in flight (BucketWindow's docstring): ``test()`` advances it
    without waiting, as ``_Request``."""

    __slots__ = ("_win", "_parts", "_op", "_scale", "_phase", "_target", "_mine", "_across")

    def __init__(
        self, win: BucketWindow, parts: list[torch.Tensor], op: ReduceOp, scale: float
    ) -> None:
        self._win, self._parts, self._op, self._scale = win, parts, op, scale
        self._phase = 0
        self._target = 0
        self._mine: list[tuple[int, int]] = []  # my slices [lo, hi) left to take across
        self._across: Request | None = None  # a slice's allreduce across nodes, in flight

    def test(self) -> bool:
        win = self._win
        if self._phase == 0:  # my part is final: arrive
            win.raise_flag()
            self._target = win.seq
            self._phase = 1
        if self._phase == 1:  # every part is in: reduce my slice (and across nodes)
            if not win.all_reached(self._target):
                return False
            self._reduce()
            self._phase = 2
        if self._phase == 2:  # my slices final and handed to all
            while self._mine:  # across nodes, a slice at a time (as the regular window)
                lo, hi = self._mine[0]
                if self._across is None:
                    assert win.across is not None
                    self._across = win.across(self._parts[win.rank][lo:hi], self._op)
                if not self._across.test():
                    return False
                self._across = None
                self._share(lo, hi)
                del self._mine[0]
            win.raise_flag()
            self._target = win.seq
            self._phase = 3
        if self._phase == 3:  # every slice is in every segment: done, nobody reads mine
            if not win.all_reached(self._target):
                return False
            self._phase = 4
        return True

    def _reduce(self) -> None:
        """My slice of each chunk (SharedMemoryAllreduce's chunks and slices, so each element
        is reduced by the rank, and in the order, the regular window reduces it: the same
        bits), reduced in place, then scaled and written into every other segment; across
        nodes, kept for ``test`` to take across first, one at a time (two ring allreduces
        over one communicator in flight at once could match each other's messages)."""
        win, parts, op = self._win, self._parts, self._op
        me = win.rank
        mine = parts[me]
        numel = mine.numel()
        if win.size == 1:  # alone on my node: the whole part across (as the regular window)
            self._mine = [(0, numel)] if win.across is not None and numel else []
            return
        itemsize = mine.element_size()
        chunk = win.chunk_bytes // itemsize
        for offset in range(0, numel, chunk):
            count = min(chunk, numel - offset)
            start, stop = _slices(count, itemsize, win.size)[me]
            if stop <= start:
                continue
            lo, hi = offset + start, offset + stop
            acc = mine[lo:hi]
            for r in win.others:
                reduce_into(acc, parts[r][lo:hi], op)
            if win.across is None:
                self._share(lo, hi)  # while the slice is in cache
            else:
                self._mine.append((lo, hi))

    def _share(self, lo: int, hi: int) -> None:
        """My reduced slice [lo, hi) scaled and written into every other segment."""
        win, parts, scale = self._win, self._parts, self._scale
        acc = parts[win.rank][lo:hi]
        if scale != 1.0:
            scale_into(acc, scale, acc)
        for r in win.others:
            parts[r][lo:hi].copy_(acc)
        _copied[0] += (hi - lo) * acc.element_size() * len(win.others)
