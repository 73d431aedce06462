"""DDP communication hook: commlayer's compressors inside torch's DistributedDataParallel.

```python
from commlayer.integrations import ddp
state = ddp.CommState(process_group=None, compression="topk:ratio=0.01")
model.register_comm_hook(state, ddp.hook)
```

The GradBucket contract (torch ``ddp_comm_hooks``): the hook gets a bucket whose flat
``buffer()`` holds the *sum-pending* gradients of several parameters, undivided; it returns a
``torch.futures.Future`` whose value is a tensor shaped like ``buffer()``, holding the average.
``hook`` does:

1. Divide the buffer by the process group's size (before compressing: the payload then sums to
   the mean, and a cast to fp16 cannot overflow on the sum).
2. For the first ``dense_iters`` iterations, allreduce the buffer as is: DDP rebuilds its buckets
   after the first iteration, so a residual or a warm start kept for bucket ``i`` before then
   would belong to other parameters.
3. Summable compressors (none, fp16, bf16, randomk): compress the whole buffer and allreduce
   the payload. Multi-round ones (PowerSGD) compress each parameter's view of the buffer (they
   need the matrix shape), concatenate the payloads and allreduce them in one collective per
   round, the earlier rounds synchronously, the last one asynchronously. Decompress into the
   buffer.
4. Gathered compressors (topk, qsgd, efsignsgd, onebit): compress the whole flat buffer,
   ``all_gather`` each payload tensor, decompress every rank's payload with the local context and
   sum into the buffer.

Error-feedback residuals (and PowerSGD's warm start) are keyed by ``bucket.index()``:
``"bucket3"`` (whole buffer) or ``"bucket3.p1"`` (per parameter, multi-round).
``CommState.state_dict()`` returns them for a checkpoint. Only ``torch.distributed`` collectives
are used (gloo on CPU, NCCL on GPU), so the hook needs no ``commlayer.init()``.

Every collective is launched from the hook itself, on the thread DDP calls it from, so all
ranks launch them in the same order; torch's ``powerSGD_hook`` launches its second allreduce in
a future's callback, whose timing differs between ranks, and with several buckets on gloo we saw
it hang or abort with "Received data size doesn't match expected size".

This module has no ``from __future__ import annotations``: DDP compares the hook's return
annotation with the real ``torch.futures.Future[torch.Tensor]`` object, not a string.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commlayer.compression import Compressed, Compressor, create

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
ALGORITHMS = ("auto",)


class CommState:
    """Settings and memory of :func:`hook`: process group, compressor, iteration count.

    ``compression``: a spec for :func:`commlayer.compression.create` (``"none"``, ``"fp16"``,
    ``"topk:ratio=0.01"``, ``"powersgd:rank=2"``; biased ones get error feedback) or a compressor.
    ``dense_iters``: iterations reduced uncompressed while DDP rebuilds its buckets (>= 2 for a
    stateful compressor, as torch's ``PowerSGDState.start_powerSGD_iter``).
    ``algorithm``: ``"auto"`` (torch.distributed's allreduce / all_gather of the group).
    """

    __slots__ = ("process_group", "compressor", "algorithm", "dense_iters", "iteration")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        compression: str | Compressor = "none",
        algorithm: str = "auto",
        dense_iters: int = 2,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"CommState(algorithm={algorithm!r}): allowed {ALGORITHMS} (the hook runs over "
                "torch.distributed collectives of the process group)"
            )
        if isinstance(dense_iters, bool) or not isinstance(dense_iters, int) or dense_iters < 0:
            raise ValueError(f"CommState(dense_iters={dense_iters!r}): must be an integer >= 0")
        self.process_group = process_group
        self.compressor: Compressor = create(compression)
        self.algorithm = algorithm
        self.dense_iters = dense_iters
        self.iteration = 0

    def __repr__(self) -> str:
        return (
            f"CommState(compressor={self.compressor!r}, algorithm={self.algorithm!r}, "
            f"iteration={self.iteration}, dense_iters={self.dense_iters})"
        )

    def state_dict(self) -> dict[str, Any]:
        """Iteration count and the compressor's state (error-feedback residuals per bucket)."""
        saver = getattr(self.compressor, "state_dict", None)
        return {"iteration": self.iteration, "compressor": saver() if saver else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        loader = getattr(self.compressor, "load_state_dict", None)
        if state.get("compressor") is not None:
            if loader is None:
                raise ValueError(
                    f"the checkpoint holds compressor state but {self.compressor!r} keeps none"
                )
            loader(state["compressor"])


def hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.process_group`` with ``state.compressor`` (module doc)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    dense = state.iteration < state.dense_iters
    if bucket.is_last():
        state.iteration += 1
    if dense:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    if state.compressor.summable:
        return _summable(state.compressor, group, bucket, buffer)
    return _gathered(state.compressor, group, f"bucket{bucket.index()}", buffer)


def _views(
    compressor: Compressor, buffer: torch.Tensor, bucket: dist.GradBucket
) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of ``buffer`` (which may be a wrapper's cast copy) for
    a multi-round compressor (PowerSGD needs the matrix shapes); the whole buffer otherwise
    (none, fp16: per-parameter payloads cost a concatenation, +22 ms a step on the benchmark
    mlp's 27 MB)."""
    if not hasattr(compressor, "next_round"):
        return [buffer]
    shapes = [p.shape for p in bucket.parameters()]
    sizes = [shape.numel() for shape in shapes]
    if sum(sizes) != buffer.numel():
        return [buffer]  # not a plain concatenation (never seen): compress it whole
    return [part.view(shape) for part, shape in zip(buffer.split(sizes), shapes)]


def _summable(
    compressor: Compressor, group: Any, bucket: dist.GradBucket, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    views = _views(compressor, buffer, bucket)
    names = [
        f"bucket{bucket.index()}" + (f".p{j}" if v is not buffer else "")
        for j, v in enumerate(views)
    ]
    current: list[Compressed | None] = [compressor.compress(v, n) for v, n in zip(views, names)]
    results: list[torch.Tensor | None] = [None] * len(views)
    while not all(c.final for c in current if c is not None):
        _allreduce_payloads([c for c in current if c is not None], group).wait()
        for j, c in enumerate(current):
            if c is None:
                continue
            if c.final:
                results[j], current[j] = compressor.decompress(c), None
            else:
                current[j] = compressor.next_round(c, names[j])  # type: ignore[attr-defined]

    def decompress(_: Any) -> torch.Tensor:
        for j, c in enumerate(current):
            if c is not None:
                results[j] = compressor.decompress(c)
        for view, result in zip(views, results):
            view.copy_(result.reshape(view.shape))  # type: ignore[union-attr]
        return buffer

    return _allreduce_payloads([c for c in current if c is not None], group).then(decompress)


def _allreduce_payloads(rounds: Sequence[Compressed], group: Any) -> torch.futures.Future[Any]:
    """Sum every payload tensor over the group in one allreduce, written back in place (PowerSGD
    keeps the reduced Q it sent as its next warm start)."""
    payloads = [t for c in rounds for t in c.payload]
    if len(payloads) == 1 and payloads[0].is_contiguous():
        work = dist.all_reduce(payloads[0], group=group, async_op=True)
        return work.get_future().then(lambda _: None)  # reduced in place already
    flat = torch.cat([t.reshape(-1) for t in payloads]) if payloads else torch.zeros(0)
    work = dist.all_reduce(flat, group=group, async_op=True)

    def unpack(fut: torch.futures.Future[Any]) -> None:
        reduced = fut.value()[0]
        for tensor, part in zip(payloads, reduced.split([t.numel() for t in payloads])):
            tensor.copy_(part.view(tensor.shape))

    return work.get_future().then(unpack)


def _gathered(
    compressor: Compressor, group: Any, name: str, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    compressed = compressor.compress(buffer, name)
    world = dist.get_world_size(group)
    gathered: list[list[torch.Tensor]] = []
    futures = []
    for tensor in compressed.payload:
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(world)]
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        futures.append(work.get_future())
        gathered.append(out)

    def decompress(_: Any) -> torch.Tensor:
        total = torch.zeros_like(buffer).reshape(-1)
        for peer in range(world):
            payload = [out[peer] for out in gathered]
            part = compressor.decompress(Compressed(payload, compressed.ctx))
            total += part.reshape(-1).to(buffer.dtype)
        buffer.copy_(total.view(buffer.shape))
        return buffer

    return torch.futures.collect_all(futures).then(decompress)


def compress_wrapper(inner: Hook, compression: str | Compressor) -> Hook:
    """``inner`` run on a cast of the bucket, like torch's ``fp16_compress_wrapper``:
    ``compress_wrapper(hook, "fp16")`` (or around torch's own hooks, e.g. ``powerSGD_hook``).

    1. Cast the bucket's buffer (``compression``: a cast compressor, "fp16" or "bf16") and hand
       the cast copy to ``inner`` through ``bucket.set_buffer``.
    2. When ``inner``'s future completes, decompress its result into the original buffer.
    """
    compressor = create(compression)
    if not (compressor.summable and getattr(compressor, "compresses_small_tensors", False)):
        raise ValueError(
            f"compress_wrapper(compression={compression!r}): allowed a cast compressor "
            "('fp16', 'bf16'); give other compressors to CommState(compression=...)"
        )

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = compressor.compress(buffer, f"bucket{bucket.index()}")
        bucket.set_buffer(compressed.payload[0])

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            buffer.copy_(compressor.decompress(Compressed([fut.value()], compressed.ctx)))
            return buffer

        return inner(state, bucket).then(decompress)

    wrapped.__qualname__ = f"compress_wrapper({getattr(inner, '__qualname__', inner)!r}, " \
        f"{compressor.name!r})"  # fmt: skip
    return wrapped
