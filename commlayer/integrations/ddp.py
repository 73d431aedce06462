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

``algorithm="auto"`` runs every collective over ``torch.distributed`` (gloo on CPU, NCCL on GPU),
so the hook needs no ``commlayer.init()``. A named algorithm (``"ring"``, ``"rabenseifner"``, any
of ``commlayer.algorithms.available()``) runs the bucket's allreduces and allgathers through
commlayer's public collectives instead, which reduce with the algorithm commlayer was initialised
with: it must be the one named (``commlayer.init(allreduce_algorithm="ring")`` or
``COMMLAYER_ALLREDUCE_ALGORITHM=ring``), since the engine runs one algorithm for every allreduce
of the job and all ranks must agree on it. A thread per process turns commlayer's handles into the
futures DDP waits on.

Error-feedback residuals (and PowerSGD's warm start) are keyed by ``bucket.index()``:
``"bucket3"`` (whole buffer) or ``"bucket3.p1"`` (per parameter, multi-round).
``CommState.state_dict()`` returns them for a checkpoint.

Every collective is launched from the hook itself, on the thread DDP calls it from, so all
ranks launch them in the same order; torch's ``powerSGD_hook`` launches its second allreduce in
a future's callback, whose timing differs between ranks, and with several buckets on gloo we saw
it hang or abort with "Received data size doesn't match expected size".

This module has no ``from __future__ import annotations``: DDP compares the hook's return
annotation with the real ``torch.futures.Future[torch.Tensor]`` object, not a string.
"""

import atexit
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import commlayer
from commlayer import algorithms
from commlayer.compression import Compressed, Compressor, create

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
_state_ids = itertools.count()


class CommState:
    """Settings and memory of :func:`hook`: process group, compressor, iteration count.

    ``compression``: a spec for :func:`commlayer.compression.create` (``"none"``, ``"fp16"``,
    ``"topk:ratio=0.01"``, ``"powersgd:rank=2"``; biased ones get error feedback) or a compressor.
    ``dense_iters``: iterations reduced uncompressed while DDP rebuilds its buckets (>= 2 for a
    stateful compressor, as torch's ``PowerSGDState.start_powerSGD_iter``).
    ``algorithm``: ``"auto"`` (torch.distributed's allreduce / all_gather of the group), or a
    name of ``commlayer.algorithms.available()``: commlayer's collectives, with commlayer
    initialised with that algorithm (module docstring). Create CommStates in the same order on
    every rank (their commlayer operation names are numbered).
    """

    __slots__ = ("process_group", "compressor", "algorithm", "dense_iters", "iteration", "_id")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        compression: str | Compressor = "none",
        algorithm: str = "auto",
        dense_iters: int = 2,
    ) -> None:
        _check_algorithm(algorithm)
        if isinstance(dense_iters, bool) or not isinstance(dense_iters, int) or dense_iters < 0:
            raise ValueError(f"CommState(dense_iters={dense_iters!r}): must be an integer >= 0")
        self.process_group = process_group
        self.compressor: Compressor = create(compression)
        self.algorithm = algorithm
        self.dense_iters = dense_iters
        self.iteration = 0
        self._id = next(_state_ids)

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


def _check_algorithm(algorithm: str) -> None:
    """``auto``, or the registered name commlayer is running with (module docstring)."""
    if algorithm == algorithms.AUTO:
        return
    names = algorithms.available()
    if algorithm not in names:
        raise ValueError(
            f"CommState(algorithm={algorithm!r}): unknown allreduce algorithm; registered: "
            f"{', '.join(names)}"
        )
    if not commlayer.is_initialized():
        raise commlayer.NotInitializedError(
            f"CommState(algorithm={algorithm!r}) runs the hook's collectives through commlayer, "
            f"which is not initialised: call commlayer.init(allreduce_algorithm={algorithm!r}) "
            "first, or use algorithm='auto' (torch.distributed's collectives)"
        )
    running = commlayer.allreduce_algorithm()
    if running != algorithm:
        raise ValueError(
            f"rank {commlayer.rank()}: CommState(algorithm={algorithm!r}), but commlayer was "
            f"initialised with allreduce_algorithm={running!r}; its engine reduces every "
            f"allreduce of the job with one algorithm: init(allreduce_algorithm={algorithm!r}) "
            f"(or COMMLAYER_ALLREDUCE_ALGORITHM={algorithm}), or use algorithm='auto'"
        )


class _TorchComm:
    """Collectives of a torch.distributed process group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def allreduce_(self, tensor: torch.Tensor, name: str) -> torch.futures.Future[Any]:
        """Sum ``tensor`` over the group, in place."""
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future()

    def all_gather(self, tensor: torch.Tensor, name: str) -> torch.futures.Future[Any]:
        """Every rank's ``tensor`` (same shape on all), as a list in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda _: out)


class _CommlayerComm:
    """commlayer's collectives (the global process set), reduced with its configured algorithm;
    names ``ddp<state id>.<name>``."""

    def __init__(self, state_id: int, group: Any) -> None:
        self.size = commlayer.size()
        if dist.get_world_size(group) != self.size:
            raise ValueError(
                f"rank {commlayer.rank()}: CommState(algorithm=...) reduces over all "
                f"{self.size} commlayer ranks, but the process group has "
                f"{dist.get_world_size(group)}; use algorithm='auto' for a subgroup"
            )
        self.prefix = f"ddp{state_id}."

    def allreduce_(self, tensor: torch.Tensor, name: str) -> torch.futures.Future[Any]:
        handle = commlayer.allreduce_async_(tensor, name=self.prefix + name, op=commlayer.Sum)
        return _future_of(handle, lambda result: result)

    def all_gather(self, tensor: torch.Tensor, name: str) -> torch.futures.Future[Any]:
        shape = tensor.shape
        handle = commlayer.allgather_async(tensor.reshape(1, -1), name=self.prefix + name)
        return _future_of(handle, lambda rows: [row.view(shape) for row in rows])


_Completion = tuple[Any, torch.futures.Future[Any], Callable[[Any], Any]]
_completions: queue.SimpleQueue[_Completion | None] = queue.SimpleQueue()
_completer_lock = threading.Lock()
_completer: threading.Thread | None = None


def _future_of(handle: Any, convert: Callable[[Any], Any]) -> torch.futures.Future[Any]:
    """A torch Future completed with ``convert(result)`` once the commlayer handle is: DDP waits
    on futures, not handles. One daemon thread per process waits on the handles in the order
    they were submitted (the engine completes them in about that order)."""
    global _completer
    future: torch.futures.Future[Any] = torch.futures.Future()
    _completions.put((handle, future, convert))
    with _completer_lock:
        if _completer is None:
            _completer = threading.Thread(target=_complete, name="commlayer-ddp", daemon=True)
            _completer.start()
            atexit.register(_stop_completer)
    return future


def _stop_completer() -> None:
    """End the thread before the interpreter finalizes: a daemon thread still blocked then
    aborted the process at exit (SIGABRT, seen in 4 of 6 test sessions)."""
    global _completer
    with _completer_lock:
        thread, _completer = _completer, None
    if thread is not None:
        _completions.put(None)
        thread.join(timeout=10.0)


def _complete() -> None:
    while True:
        item = _completions.get()
        if item is None:
            return
        handle, future, convert = item
        try:
            result = convert(commlayer.synchronize(handle))
        except BaseException as exc:  # noqa: BLE001 - DDP raises it from future.wait()
            future.set_exception(exc)
        else:
            future.set_result(result)


def _comm(state: CommState) -> _TorchComm | _CommlayerComm:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if state.algorithm == algorithms.AUTO:
        return _TorchComm(group)
    return _CommlayerComm(state._id, group)


def hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.process_group`` with ``state.compressor`` (module doc)."""
    comm = _comm(state)
    buffer = bucket.buffer()
    buffer.div_(comm.size)
    dense = state.iteration < state.dense_iters
    if bucket.is_last():
        state.iteration += 1
    name = f"bucket{bucket.index()}"
    if dense:
        return comm.allreduce_(buffer, name + ".dense").then(lambda _: buffer)
    if state.compressor.summable:
        return _summable(state.compressor, comm, bucket, buffer)
    return _gathered(state.compressor, comm, name, buffer)


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
    compressor: Compressor, comm: Any, bucket: dist.GradBucket, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    views = _views(compressor, buffer, bucket)
    names = [
        f"bucket{bucket.index()}" + (f".p{j}" if v is not buffer else "")
        for j, v in enumerate(views)
    ]
    current: list[Compressed | None] = [compressor.compress(v, n) for v, n in zip(views, names)]
    results: list[torch.Tensor | None] = [None] * len(views)
    rounds = 0
    while not all(c.final for c in current if c is not None):
        _allreduce_payloads([c for c in current if c is not None], comm, names[0], rounds).wait()
        rounds += 1
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

    last = _allreduce_payloads([c for c in current if c is not None], comm, names[0], rounds)
    return last.then(decompress)


def _allreduce_payloads(
    rounds: Sequence[Compressed], comm: Any, name: str, round_index: int
) -> torch.futures.Future[Any]:
    """Sum every payload tensor over the group in one allreduce, written back in place (PowerSGD
    keeps the reduced Q it sent as its next warm start)."""
    payloads = [t for c in rounds for t in c.payload]
    name = f"{name}.r{round_index}"
    if len(payloads) == 1 and payloads[0].is_contiguous():
        return comm.allreduce_(payloads[0], name).then(lambda _: None)  # reduced in place
    flat = torch.cat([t.reshape(-1) for t in payloads]) if payloads else torch.zeros(0)

    def unpack(_: Any) -> None:
        for tensor, part in zip(payloads, flat.split([t.numel() for t in payloads])):
            tensor.copy_(part.view(tensor.shape))

    return comm.allreduce_(flat, name).then(unpack)


def _gathered(
    compressor: Compressor, comm: Any, name: str, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    compressed = compressor.compress(buffer, name)
    futures = [
        comm.all_gather(tensor.contiguous(), f"{name}.g{i}")
        for i, tensor in enumerate(compressed.payload)
    ]

    def decompress(_: Any) -> torch.Tensor:
        gathered = [f.value() for f in futures]
        total = torch.zeros_like(buffer).reshape(-1)
        for peer in range(comm.size):
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
