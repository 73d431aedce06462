"""Allreduce: negotiated allreduces of one dtype and op, fused into buckets and reduced.

1. ``entries`` turns each negotiated operation into fusion entries: a tensor each, except a
   group of small tensors that fits a bucket, which is one entry (one cat, one split), decided
   from the response alone so that every rank (a joined one included) plans the same buckets;
   an operation of one large tensor (``fusion.ALONE_NUMEL``) is marked ``alone``.
2. ``FusedAllreduce.run`` cuts the entries into buckets of at most the fusion threshold
   (fusion.plan_buckets) and reduces each the cheapest way: through the shared-memory window
   where the tensors lie (fusion.pieces), in place for a lone tensor, else packed into a pooled
   buffer. The engine (``Host``) waits on the requests, counts and traces, and completes the
   operations whose last entry is done.
3. Over gloo (a backend with ``progress_threads``: its transfers run on threads of their own,
   torchrun's case) packing costs more than it saves: a copy in and a copy out of every byte
   (26.8 MB of the MLP gradients: ~7 ms each way on the 2-core VM), on the cores the ranks
   compute with, while gloo runs several allreduces at once (11 in flight took what one of
   their total size took: benchmarks/README.md). So there a bucket's small entries are packed
   together and reduced first, then each large entry (``fusion.ONE_PASS_NUMEL`` elements or
   more) where it lies, and the backend's own allreduces stay in flight together:
   posted in the agreed order (gloo matches a group's collectives by that order), waited for
   in it, each finished as it ends while the later ones run. Schedules (point-to-point steps),
   the window and calls the online tuner times are waited for alone; a bucket whose
   algorithm is the window (every rank on one machine: the torch backend has one too) is not
   split (``Allreducer.windowed``: a joined rank, which packs, must take the same path). Over
   MPI (progress only while tested, and the window on one node) buckets are packed and waited
   for one by one, and so they are over gloo where a machine runs more ranks than it has cores
   (``_splits``: each allreduce a split adds then costs more than the copies it saves).
4. Everywhere, a bucket that would be packed reduces its ``alone`` entries (an operation of one
   large tensor, such as a planned bucket of DistributedOptimizer, which owns its memory)
   each where it lies, after its other entries packed together (``_alone``): it is one buffer
   already, a copy in and out of it would cost more than the collective it saves, and
   DistributedOptimizer's planned buckets are sent as such (comm/bucketer.py, 4.).
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol, cast

import torch

from commlayer.algorithms.executor import BufferPool
from commlayer.backends.base import PROGRESS_THREADS, Backend, ProgressThreads, Request
from commlayer.backends.shm import window_of
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import fusion
from commlayer.core.negotiation import Response
from commlayer.core.selection import Allreducer


class Host(Protocol):
    """What the runner needs from the engine that runs it."""

    def wait(self, request: Request) -> None: ...

    def account(self, nbytes: int, size: int, seconds: float, factor: float) -> None: ...

    def spans(self, name: str, times: tuple[float, float, float, float], **args: Any) -> None: ...

    def complete(self, op: Any, result: Any) -> None: ...


def entries(
    response: Response, op: Any, divisor: int, fusion_threshold_bytes: int
) -> list[fusion.Entry]:
    """The fusion entries of one negotiated allreduce (``op``: the engine's Operation, None on
    a joined rank): a tensor each, or one for a group of small tensors that fits a bucket."""
    average = 1.0 / divisor if response.op == ReduceOp.Average else 1.0
    if len(response.shapes) > 1:
        # A group of small tensors that fits a bucket is one entry (one cat, one split),
        # decided from the response alone so that every rank (a joined one included)
        # plans the same buckets. Large tensors stay entries of their own, which the
        # shared-memory window reads and writes where they lie (fusion.pieces).
        numels = [math.prod(shape) for shape in response.shapes]
        total = sum(numels)
        element = element_size(getattr(torch, response.dtype))
        if total * element <= fusion_threshold_bytes and not fusion.per_tensor(total, len(numels)):
            if op is None:
                return [fusion.Entry(None, None, total)]
            op.remaining = 1
            group = (op.inputs, op.outputs, numels)
            scale = op.postscale * average
            return [fusion.Entry(None, None, total, op.prescale, scale, op, group)]
    entries = []
    single = len(response.shapes) == 1
    for index, shape in enumerate(response.shapes):
        numel = math.prod(shape)
        alone = single and numel >= fusion.ALONE_NUMEL  # one buffer already: not packed
        if op is None:
            entries.append(fusion.Entry(None, None, numel, alone=alone))
        else:
            entries.append(
                fusion.Entry(
                    op.inputs[index],
                    op.outputs[index],
                    numel,
                    op.prescale,
                    op.postscale * average,
                    op,
                    alone=alone,
                )
            )
    if op is not None:
        op.remaining = len(entries)
    return entries


_CPU = torch.device("cpu")


class _Part:
    """A part of a bucket in flight: its entries, the buffer the collective reduces (a pooled
    one it was packed into, or the lone entry's output; None where the shared-memory window
    reads and writes the tensors themselves), and its start times."""

    __slots__ = ("entries", "buf", "packed", "request", "t0", "t1")

    def __init__(
        self,
        entries: list[fusion.Entry],
        buf: torch.Tensor | None,
        packed: bool,
        request: Request,
        t0: float,
        t1: float,
    ) -> None:
        self.entries, self.buf, self.packed = entries, buf, packed
        self.request, self.t0, self.t1 = request, t0, t1


class FusedAllreduce:
    """Buckets of fused entries reduced with the job's algorithm (module docstring, 2)."""

    __slots__ = ("_allreduce", "_threshold_bytes", "_host", "_pool", "_split_of")

    def __init__(self, allreducer: Allreducer, fusion_threshold_bytes: int, host: Host) -> None:
        self._allreduce = allreducer
        self._threshold_bytes = fusion_threshold_bytes
        self._host = host
        self._pool = BufferPool()
        self._split_of: dict[Backend, bool] = {}  # per backend object: _splits

    def run(
        self,
        backend: Backend,
        dtype: torch.dtype,
        op: ReduceOp,
        entries: list[fusion.Entry],
        device: torch.device = _CPU,
    ) -> None:
        """Reduce ``entries`` (one dtype, op and channel) in buckets of at most the fusion
        threshold; fusion buffers on ``device`` (the channel's: device.channel_device).

        Over a backend whose transfers progress on threads of their own (gloo:
        ``progress_threads``), host memory is not packed where it need not be (module
        docstring, 3.): the small entries of a bucket are packed together, each large one is
        reduced where it lies, and the backend's own allreduces stay in flight together, waited
        for in the order posted; each is finished (unpacked, scaled, its operation completed)
        as it ends, while the later ones still run."""
        element = element_size(dtype)
        split = device.type == "cpu" and self._splits(backend)
        flight: list[_Part] = []
        offset = 0  # into the pool buffer: packed parts in flight together need their own slices
        # over a split, a part that must run alone waits for the flight before it is posted
        drain = (lambda: self._drain(flight, backend, element)) if split else None
        for bucket in fusion.plan_buckets(entries, element, self._threshold_bytes):
            t0 = time.perf_counter()
            # the shared-memory window reads host memory only, and runs alone
            pieces = fusion.pieces(bucket, dtype) if device.type == "cpu" else None
            request = (
                None if pieces is None else self._allreduce.pieces(backend, *pieces, op, drain)
            )
            if request is not None:  # the window reads and writes the tensors where they lie
                t1 = time.perf_counter()
                self._host.wait(request)
                self._finish(_Part(bucket, None, False, request, t0, t1), backend, element)
                continue
            alone = not split and any(e.alone for e in bucket)
            whole = not (split or alone) or self._allreduce.windowed(
                backend, sum(e.numel for e in bucket), element
            )
            for part in (bucket,) if whole else _alone(bucket) if alone else _split(bucket):
                t0 = time.perf_counter()
                if len(part) == 1 and part[0].output is not None:
                    buf, send = _in_place(part[0])
                    packed, packed_s = False, 0.0
                else:
                    numel = sum(e.numel for e in part)
                    if not flight:
                        offset = 0
                    buf = self._pool.get(dtype, offset + numel, device)[offset:]
                    fusion.pack(part, buf)
                    send, packed, packed_s = None, True, time.perf_counter() - t0
                t1 = time.perf_counter()
                request, concurrent = self._allreduce.start(backend, send, buf, op, packed_s, drain)
                flight.append(_Part(part, buf, packed, request, t0, t1))
                if packed:
                    offset += buf.numel()
                if not (concurrent and split):
                    self._drain(flight, backend, element)  # waited for alone
        self._drain(flight, backend, element)

    def in_window(
        self,
        backend: Backend,
        dtype: torch.dtype,
        op: ReduceOp,
        entries: list[fusion.Entry],
        channel: str,
        joined: bool,
    ) -> None:
        """Allreduce each entry of a window channel (``window:<token>:<offset>``: a planned
        bucket of DistributedOptimizer whose memory is its shared-memory window's segment,
        backends/shm.py's BucketWindow) where it lies: no copy in, no copy out of a result
        area. Where a rank has joined (``joined``: the same on every rank), or the window is
        gone here, the regular way (``run``: the bucket's memory is host memory all the same),
        as the joined rank, whose zeros are not in the window, takes it."""
        window, offset = window_of(channel)
        if joined or window is None or any(e.output is None for e in entries):
            self.run(backend, dtype, op, entries)
            return
        element = element_size(dtype)
        for entry in entries:  # one: the channel names one part's offset
            t0 = time.perf_counter()
            if entry.prescale != 1.0 or entry.source is not entry.output:
                _in_place(entry)  # the prescale applied (or the input copied) in the window
            assert entry.output is not None
            request = window.iallreduce(offset, entry.numel, dtype, op, entry.postscale)
            t1 = time.perf_counter()
            self._host.wait(request)
            self._finish(_Part([entry], None, False, request, t0, t1), backend, element)

    def _splits(self, backend: Backend) -> bool:
        """Whether buckets over ``backend`` are split (module docstring, 3.): its transfers
        progress on threads of their own (gloo), and no machine runs more of its ranks than it
        has cores (``oversubscribed``). Where one does, every hop of a collective waits for a
        peer the kernel has descheduled, and the allreduces a split adds cost more than the
        copies it saves (the MLP over gloo, paired with DDP on 2 cores: split 0.86-0.90 of DDP
        against packed 0.81-0.87 at 2 ranks, 4 of 4 pairs better; 0.71-0.74 against 0.78-0.90
        at 4 ranks, 2 of 2 worse). Every rank decides alike: a split changes which
        collectives are posted."""
        known = self._split_of.get(backend)
        if known is None:
            known = PROGRESS_THREADS in backend.capabilities and not (
                cast(ProgressThreads, backend).oversubscribed()
            )
            self._split_of[backend] = known
        return known

    def _drain(self, flight: list[_Part], backend: Backend, element: int) -> None:
        """Wait for the parts in flight, in the order posted, finishing each as it ends."""
        ended = 0.0
        for part in flight:
            self._host.wait(part.request)
            self._finish(part, backend, element, since=ended)
            ended = time.perf_counter()
        flight.clear()

    def _finish(self, part: _Part, backend: Backend, element: int, since: float = 0.0) -> None:
        """Unpack (or scale in place), account and trace; complete the operations whose last
        entry this was. ``since``: when the part before it in flight ended (its collective time
        is counted from then: time in flight together is counted once)."""
        host = self._host
        t2 = time.perf_counter()
        if part.buf is None:
            pass  # the window scaled the outputs as it wrote them
        elif part.packed:
            fusion.unpack(part.entries, part.buf)
        else:
            fusion.scale_(part.entries[0].output, part.entries[0].postscale)  # type: ignore[arg-type]
        t3 = time.perf_counter()
        numel = sum(e.numel for e in part.entries)
        host.account(numel * element, backend.size, t2 - max(part.t1, since), 2.0)
        for entry in part.entries:
            owner = entry.owner
            if owner is None:
                continue
            host.spans(
                owner.name,
                (part.t0, part.t1, t2, t3),
                bucket=len(part.entries),
                bytes=numel * element,
            )
            owner.remaining -= 1
            if owner.remaining == 0:
                host.complete(owner, owner.outputs)


def _in_place(entry: fusion.Entry) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the buffer reduced: the entry's output, flat; what is sent from, None for the buffer
    itself): a lone entry is reduced where its result goes; a prescale, or an input that is its
    own output, is applied there first."""
    assert entry.source is not None and entry.output is not None
    send: torch.Tensor | None = entry.source
    if entry.prescale != 1.0 or entry.source is entry.output:
        if entry.source is not entry.output:
            entry.output.view(-1).copy_(entry.source.reshape(-1))
        fusion.scale_(entry.output, entry.prescale)
        send = None
    return entry.output.view(-1), None if send is None else send.reshape(-1)


def _alone(bucket: list[fusion.Entry]) -> list[list[fusion.Entry]]:
    """A bucket that would be packed as parts to reduce: its entries ``alone`` (an operation's
    one large tensor) each where it lies, after the others packed together; decided from the
    responses alone, so every rank (a joined one too) parts alike."""
    rest = [e for e in bucket if not e.alone]
    return ([rest] if rest else []) + [[e] for e in bucket if e.alone]


def _split(bucket: list[fusion.Entry]) -> list[list[fusion.Entry]]:
    """A bucket as parts to reduce (module docstring, 3.): its small entries packed together
    first (waited for alone where their algorithm is a schedule, while nothing else is in
    flight), then each large entry alone, where it lies (``fusion.ONE_PASS_NUMEL`` elements or
    more, a tensor and not a group): decided from the sizes alone, so every rank (a joined one,
    whose entries are zeros, too) splits alike."""
    large = [e for e in bucket if e.numel >= fusion.ONE_PASS_NUMEL and e.group is None]
    if not large:
        return [bucket]
    small = [e for e in bucket if e.numel < fusion.ONE_PASS_NUMEL or e.group is not None]
    return ([small] if small else []) + [[e] for e in large]


_ELEMENT_SIZES: dict[torch.dtype, int] = {}


def element_size(dtype: torch.dtype) -> int:
    size = _ELEMENT_SIZES.get(dtype)
    if size is None:
        size = _ELEMENT_SIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size
