"""Allreduce: negotiated allreduces of one dtype and op, fused into buckets and reduced.

1. ``entries`` turns each negotiated operation into fusion entries: a tensor each, except a
   group of small tensors that fits a bucket, which is one entry (one cat, one split), decided
   from the response alone so that every rank (a joined one included) plans the same buckets.
2. ``FusedAllreduce.run`` cuts the entries into buckets of at most the fusion threshold
   (fusion.plan_buckets) and reduces each the cheapest way: through the shared-memory window
   where the tensors lie (fusion.pieces), in place for a lone tensor, else packed into a pooled
   buffer. The engine (``Host``) waits on the requests, counts and traces, and completes the
   operations whose last entry is done.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

import torch

from commlayer import fusion
from commlayer.algorithms.executor import Allreducer
from commlayer.backends.base import Backend, Request
from commlayer.negotiation import Response
from commlayer.reduce_ops import ReduceOp


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
    for index, shape in enumerate(response.shapes):
        numel = math.prod(shape)
        if op is None:
            entries.append(fusion.Entry(None, None, numel))
        else:
            entries.append(
                fusion.Entry(
                    op.inputs[index],
                    op.outputs[index],
                    numel,
                    op.prescale,
                    op.postscale * average,
                    op,
                )
            )
    if op is not None:
        op.remaining = len(entries)
    return entries


_CPU = torch.device("cpu")


class FusedAllreduce:
    """Buckets of fused entries reduced with the job's algorithm (module docstring, 2)."""

    __slots__ = ("_allreduce", "_threshold_bytes", "_host", "_pool")

    def __init__(self, allreducer: Allreducer, fusion_threshold_bytes: int, host: Host) -> None:
        self._allreduce = allreducer
        self._threshold_bytes = fusion_threshold_bytes
        self._host = host
        self._pool = fusion.BufferPool()

    def run(
        self,
        backend: Backend,
        dtype: torch.dtype,
        op: ReduceOp,
        entries: list[fusion.Entry],
        device: torch.device = _CPU,
    ) -> None:
        """Reduce ``entries`` (one dtype, op and channel) in buckets of at most the fusion
        threshold; fusion buffers on ``device`` (the channel's: device.channel_device)."""
        host = self._host
        element = element_size(dtype)
        for bucket in fusion.plan_buckets(entries, element, self._threshold_bytes):
            numel = sum(e.numel for e in bucket)
            t0 = time.perf_counter()
            direct = len(bucket) == 1 and bucket[0].output is not None
            # the shared-memory window reads host memory only
            pieces = fusion.pieces(bucket, dtype) if device.type == "cpu" else None
            request = None if pieces is None else self._allreduce.pieces(backend, *pieces, op)
            if request is not None:  # the window reads and writes the tensors where they lie
                t1 = time.perf_counter()
                host.wait(request)
                t2 = time.perf_counter()
            elif direct:
                entry = bucket[0]
                assert entry.source is not None and entry.output is not None
                send: torch.Tensor | None = entry.source
                if entry.prescale != 1.0 or entry.source is entry.output:
                    if entry.source is not entry.output:
                        entry.output.view(-1).copy_(entry.source.reshape(-1))
                    fusion.scale_(entry.output, entry.prescale)
                    send = None
                buf = entry.output.view(-1)
                t1 = time.perf_counter()
                host.wait(
                    self._allreduce(backend, None if send is None else send.reshape(-1), buf, op)
                )
                t2 = time.perf_counter()
                fusion.scale_(entry.output, entry.postscale)
            else:
                buf = self._pool.get(dtype, numel, device)
                fusion.pack(bucket, buf)
                t1 = time.perf_counter()
                host.wait(self._allreduce(backend, None, buf, op, t1 - t0))
                t2 = time.perf_counter()
                fusion.unpack(bucket, buf)
            t3 = time.perf_counter()
            host.account(numel * element, backend.size, t2 - t1, 2.0)
            for entry in bucket:
                owner = entry.owner
                if owner is None:
                    continue
                host.spans(owner.name, (t0, t1, t2, t3), bucket=len(bucket), bytes=numel * element)
                owner.remaining -= 1
                if owner.remaining == 0:
                    host.complete(owner, owner.outputs)


_ELEMENT_SIZES: dict[torch.dtype, int] = {}


def element_size(dtype: torch.dtype) -> int:
    size = _ELEMENT_SIZES.get(dtype)
    if size is None:
        size = _ELEMENT_SIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size
