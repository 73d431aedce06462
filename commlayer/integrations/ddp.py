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

0. Over a process group of one rank the average is the bucket itself: the hook returns it at
   once, in a completed future, with nothing compressed or sent (as DistributedOptimizer does
   there, and Horovod), unless ``COMMLAYER_FORCE_FULL_PATH=1`` (read when the CommState is
   made) asks for the whole path, for benchmarks and tests. ``compress_wrapper`` around it
   casts nothing then either.

1. Divide the buffer by the process group's size (before compressing: the payload then sums to
   the mean, and a cast to fp16 cannot overflow on the sum).
2. For the first ``dense_iters`` iterations, allreduce the buffer as is: DDP rebuilds its buckets
   after the first iteration, so a residual or a warm start kept for bucket ``i`` before then
   would belong to other parameters.
3. Otherwise hand the buffer to commlayer's compression communicator
   (comm/communicator.py, the one DistributedOptimizer uses), which compresses, moves the
   payload as the compressor declares (allreduce for summable ones, one gathered record for the
   others) and decompresses into the buffer. A multi-round compressor (PowerSGD) gets each
   parameter's view of the buffer (it needs the matrix shapes), all views' payloads in one
   collective per round.
4. Return the communicator's future chained to the buffer: no thread, no wait for the last
   round. On a GPU it is a torch Future that declares the device, completed with events
   recorded after the work queued for the buffer (commlayer/core/device.py, **Order**: the cast
   back and the copy into it, on whichever stream the collective's callback ran), so DDP's
   stream waits for them before it reads the buffer.

``algorithm="auto"`` runs every collective over ``torch.distributed`` (gloo on CPU, NCCL on GPU),
so the hook needs no ``commlayer.init()`` (backends/torch_distributed.py's ``GroupTransport``:
that module holds all of commlayer's torch.distributed calls). A named algorithm (``"ring"``,
``"rabenseifner"``, any of ``commlayer.algorithms.available()``) runs the bucket's collectives
through commlayer's engine instead, which reduces with the algorithm commlayer was initialised
with: it must be the one named (``commlayer.init(allreduce_algorithm="ring")`` or
``COMMLAYER_ALLREDUCE_ALGORITHM=ring``), since the engine runs one algorithm for every allreduce
of the job and all ranks must agree on it.

Error-feedback residuals (and PowerSGD's warm start) are keyed by ``bucket.index()``:
``"bucket3"`` (whole buffer) or ``"bucket3.p1"`` (per parameter, multi-round).
``CommState.state_dict()`` returns them for a checkpoint.

The CommState owns its communicator for the job: the communicator, its transport and the
per-host path's levels are made at the first bucket that is sent and kept; they are made again
only when what they were made from changes: the process group (``state.process_group``
reassigned, or a new default group after ``init_process_group``), commlayer's engine (a new
``init()``, for a named algorithm), ``state.compressor`` or ``state.hierarchy`` reassigned, or
an elastic re-formation of the world (commlayer.elastic calls :func:`new_world`, as it calls
the DistributedOptimizers' ``new_world``). The compressor's state (residuals, warm starts) is
the compressor's, kept across all of these.

Once per host (``hierarchy="host"``, or COMMLAYER_COMPRESSION_HIERARCHY=host, or a spec's
``hierarchy=host``; ``auto`` is flat here: nothing measures the links): where the process
group spans several hosts with more than one rank on some, a bucket is summed inside the host,
compressed by one leader (its residual kept there), exchanged among the leaders and shared
inside the host (comm/hierarchy.py). The CommState makes the groups it needs at its first
bucket: of each host's ranks and of the ranks with the same index on their host
(``dist.new_group``, on every rank of the world in the same order, once per job), hosts told
by the ranks' host names
(COMMLAYER_TOPOLOGY, fitting the world, poses them). Over a torch.distributed group smaller
than the world it refuses: groups its ranks made alone would be named by how many groups each
process made before, which differs between them. Leaders rotate by bucket, in the
order DDP reduces them (the same on every rank). Over torch.distributed a leader waits in the
hook for the sum inside its host and the exchange (gloo takes a group's collectives in the
order they are started, which callbacks do not keep), so backward pauses on it for the
buckets it leads; only the share is left in flight.

Round order: commlayer's engine negotiates an order every rank shares, so there each round
starts from the previous one's callback. gloo does not: torch's ``powerSGD_hook`` launches its
second allreduce in a future's callback, whose timing differs between ranks, and with several
buckets on gloo we saw it hang or abort with "Received data size doesn't match expected size".
So over torch.distributed a multi-round compressor's earlier rounds are waited for in the hook,
on the thread DDP calls it from, and only the last round is left in flight.

This module has no ``from __future__ import annotations``: DDP compares the hook's return
annotation with the real ``torch.futures.Future[torch.Tensor]`` object, not a string.
"""

import itertools
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from commlayer import algorithms, elastic
from commlayer.backends.torch_distributed import GroupTransport, host_nodes, world_group
from commlayer.comm.communicator import Communicator, EngineTransport
from commlayer.comm.hierarchy import HOST, HostLayout, HostLevels, engine_levels
from commlayer.common import config
from commlayer.common.config import HIERARCHIES
from commlayer.common.errors import NotInitializedError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import Compressed, Compressor, create
from commlayer.compression.base import (
    MULTI_ROUND,
    STATEFUL,
    CompressorBase,
    Stateful,
    hierarchy_of,
)
from commlayer.compression.none import NoneCompressor
from commlayer.core import device, runtime

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
_state_ids = itertools.count()
_NONE = NoneCompressor()


class CommState:
    """Settings and memory of :func:`hook`: process group, compressor, iteration count.

    ``compression``: a spec for :func:`commlayer.compression.create` (``"none"``, ``"fp16"``,
    ``"topk:ratio=0.01"``, ``"powersgd:rank=2"``; biased ones get error feedback) or a compressor.
    ``dense_iters``: iterations reduced uncompressed while DDP rebuilds its buckets (>= 2 for a
    stateful compressor, as torch's ``PowerSGDState.start_powerSGD_iter``).
    ``algorithm``: ``"auto"`` (torch.distributed's allreduce / all_gather of the group), or a
    name of ``commlayer.algorithms.available()``: commlayer's collectives, with commlayer
    initialised with that algorithm (module docstring). ``hierarchy``: ``"flat"`` or ``"host"``
    (module docstring; None: the compressor's spec's, else COMMLAYER_COMPRESSION_HIERARCHY;
    ``"auto"`` is flat here). Create CommStates in the same order on every rank of the group
    (their commlayer operation names are numbered), and hook them into DDP in the same order
    (the per-host path's groups are made at a state's first bucket).

    The communicator (``communicator()``), its transport and ``levels`` (the per-host path's,
    None where it does not apply) are made at the first bucket and kept for the job, made
    again where ``process_group``, ``compressor`` or ``hierarchy`` is reassigned, the process
    group or commlayer's engine is a new one, or the world is re-formed (module docstring).
    """

    __slots__ = (
        "process_group", "compressor", "algorithm", "dense_iters", "iteration", "full_path",
        "hierarchy", "levels", "_posed", "_id", "_made_from", "_communicator", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        compression: str | Compressor = "none",
        algorithm: str = "auto",
        dense_iters: int = 2,
        hierarchy: str | None = None,
    ) -> None:
        algorithm = algorithms.canonical(algorithm)  # "mpi": "native"
        _check_algorithm(algorithm)
        if isinstance(dense_iters, bool) or not isinstance(dense_iters, int) or dense_iters < 0:
            raise ValueError(f"CommState(dense_iters={dense_iters!r}): must be an integer >= 0")
        if hierarchy is not None and hierarchy not in HIERARCHIES:
            raise ValueError(
                f"CommState(hierarchy={hierarchy!r}): allowed None, {', '.join(HIERARCHIES)}"
            )
        self.process_group = process_group
        rank = dist.get_rank() if dist.is_initialized() else None  # QSGD's noise per rank
        self.compressor: CompressorBase = create(compression, rank=rank)
        self.algorithm = algorithm
        self.dense_iters = dense_iters
        self.iteration = 0
        # Reduce over one rank too (module docstring, 0.): the setting init() resolved, or the
        # environment's where commlayer is not initialised (algorithm "auto" needs no init()).
        settings = runtime.config() if runtime.is_initialized() else config.load()
        self.full_path = settings.force_full_path
        self.hierarchy = hierarchy or hierarchy_of(self.compressor, settings.compression_hierarchy)
        if self._per_host() and algorithm == algorithms.AUTO:
            _check_world(process_group)  # before the id: a refused state numbers nothing
        self._id = next(_state_ids)
        self._posed = settings.topology  # COMMLAYER_TOPOLOGY, for the per-host path's hosts
        self.levels: HostLevels | None = None
        self._made_from: tuple[Any, ...] | None = None  # what the communicator was made from
        self._communicator: Communicator | None = None
        _states.add(self)

    def __repr__(self) -> str:
        return (
            f"CommState(compressor={self.compressor!r}, algorithm={self.algorithm!r}, "
            f"iteration={self.iteration}, dense_iters={self.dense_iters})"
        )

    def _per_host(self) -> bool:
        return self.hierarchy == HOST and not self.compressor.identity

    def communicator(self) -> Communicator:
        """The communicator of this state's buckets: made at the first call (its transport,
        and the per-host path's ``levels``: a collective over the group, and over the world
        for torch.distributed's per-host groups the first time) and kept, made again where
        what it was made from changed (the class docstring)."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        engine = None if self.algorithm == algorithms.AUTO else runtime.engine()
        known = self._made_from
        if (  # the same objects (one bucket of many: no more than four identity tests)
            known is not None
            and self._communicator is not None
            and group is known[0]
            and engine is known[1]
            and self.compressor is known[2]
            and self.hierarchy is known[3]
        ):
            return self._communicator
        made_from = (group, engine, self.compressor, self.hierarchy)
        self._communicator = None  # a failed making leaves none behind
        self.levels = None
        per_host = self._per_host()
        if per_host and engine is None:
            _check_world(self.process_group)
        transport = _transport(self, group)
        self.levels = _levels(self, group) if per_host else None
        self._communicator = Communicator(
            transport, ReduceOp.Sum, what="bucket", levels=self.levels
        )
        self._made_from = made_from
        return self._communicator

    def new_world(self) -> None:
        """The world was re-formed (commlayer.elastic): the communicator, its transport and
        levels belonged to the world gone; the next bucket makes them again."""
        self._communicator = None
        self._made_from = None
        self.levels = None

    def state_dict(self) -> dict[str, Any]:
        """Iteration count and the compressor's state (error-feedback residuals per bucket)."""
        saved = None
        if STATEFUL in self.compressor.capabilities:
            saved = cast(Stateful, self.compressor).state_dict()
        return {"iteration": self.iteration, "compressor": saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        if state.get("compressor") is not None:
            if STATEFUL not in self.compressor.capabilities:
                raise ValueError(
                    f"the checkpoint holds compressor state but {self.compressor!r} keeps none"
                )
            cast(Stateful, self.compressor).load_state_dict(state["compressor"])


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
    if not runtime.is_initialized():
        raise NotInitializedError(
            f"CommState(algorithm={algorithm!r}) runs the hook's collectives through commlayer, "
            f"which is not initialised: call commlayer.init(allreduce_algorithm={algorithm!r}) "
            "first, or use algorithm='auto' (torch.distributed's collectives)"
        )
    running = runtime.engine().config.allreduce_algorithm
    if running != algorithm:
        raise ValueError(
            f"rank {runtime.rank()}: CommState(algorithm={algorithm!r}), but commlayer was "
            f"initialised with allreduce_algorithm={running!r}; its engine reduces every "
            f"allreduce of the job with one algorithm: init(allreduce_algorithm={algorithm!r}) "
            f"(or COMMLAYER_ALLREDUCE_ALGORITHM={algorithm}), or use algorithm='auto'"
        )


def _transport(state: CommState, group: Any) -> GroupTransport | EngineTransport:
    """The state's transport: torch.distributed's collectives of ``group`` (algorithm auto),
    else commlayer's engine over every commlayer rank."""
    if state.algorithm == algorithms.AUTO:
        return GroupTransport(group)
    size = runtime.size()
    if dist.get_world_size(group) != size:
        raise ValueError(
            f"rank {runtime.rank()}: CommState(algorithm=...) reduces over all "
            f"{size} commlayer ranks, but the process group has "
            f"{dist.get_world_size(group)}; use algorithm='auto' for a subgroup"
        )
    return EngineTransport(prefix=f"ddp{state._id}.")


def _levels(state: CommState, group: Any) -> HostLevels | None:
    """The per-host path's levels of the state's group (a collective over its ranks): over
    commlayer's engine for a named algorithm, else over torch.distributed groups of the
    hosts' ranks, hosts from the ranks' host names or COMMLAYER_TOPOLOGY."""
    if state.algorithm != algorithms.AUTO:
        return engine_levels(prefix=f"ddp{state._id}.")
    rank = dist.get_rank()
    layout = HostLayout.of(dist.get_process_group_ranks(group), host_nodes(group, state._posed))
    if not layout.pays():
        return None
    # every rank makes every group, in the same order (dist.new_group's contract)
    groups = {ranks: world_group(ranks) for ranks in layout.host_sets() + layout.leader_sets()}
    host, index = layout.where(rank)
    intra = groups.get(layout.hosts[host])
    across = groups[layout.leader_sets()[index]] if index < layout.leaders else None
    return HostLevels(
        layout,
        rank,
        None if intra is None else GroupTransport(intra),
        None if across is None else GroupTransport(across),
    )


def _check_world(process_group: Any) -> None:
    """ValueError unless ``process_group`` (None: the world) spans the world: the per-host
    path's groups are made by every rank of the world (``world_group``)."""
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"rank {dist.get_rank()}: CommState(hierarchy='host') over a torch.distributed "
            f"group of {dist.get_world_size(group)} of the world's {dist.get_world_size()} "
            "ranks: its per-host groups would be made by its ranks alone, and torch.distributed "
            "names a group made so by how many groups each process made before (they differ "
            "where hosts hold different numbers of the group's ranks); use the world group, "
            "hierarchy='flat', or DistributedOptimizer(process_set=...)"
        )


def _alone(state: Any) -> bool:
    """Whether ``state``'s hook reduces over one rank and takes no full path (module doc, 0.)."""
    if not isinstance(state, CommState) or state.full_path:
        return False
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    return dist.get_world_size(group) == 1


# Every CommState (weakly): an elastic re-formation drops what each made for the world gone.
_states: weakref.WeakSet[CommState] = weakref.WeakSet()


def new_world() -> None:
    """The world was re-formed (commlayer.elastic): every CommState makes its communicator
    again at its next bucket (``CommState.new_world``)."""
    for state in list(_states):
        state.new_world()


elastic.on_new_world(new_world)


def _completed(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.process_group`` with ``state.compressor`` (module doc)."""
    if _alone(state):
        if bucket.is_last():
            state.iteration += 1
        return _completed(bucket.buffer())
    communicator = state.communicator()
    buffer = bucket.buffer()
    if buffer.is_cuda:  # its futures order DDP's stream after the work queued for them
        device.mark_futures_on(buffer.device)
    buffer.div_(communicator.transport.size)
    dense = state.iteration < state.dense_iters
    if bucket.is_last():
        state.iteration += 1
    name = f"bucket{bucket.index()}"
    if dense:
        reduced = communicator.reduce([buffer], _NONE, name + ".dense")
    else:
        views = _views(state.compressor, buffer, bucket)
        if state.levels is not None:  # leaders by bytes, in DDP's bucket order
            state.levels.assign([(name, buffer.numel() * buffer.element_size())])
        per_host = state.levels is not None
        reduced = communicator.reduce(views, state.compressor, name, per_host=per_host)
    return reduced.then(lambda _: buffer).to_torch()


def _views(
    compressor: CompressorBase, buffer: torch.Tensor, bucket: dist.GradBucket
) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of ``buffer`` (which may be a wrapper's cast copy) for
    a multi-round compressor (PowerSGD needs the matrix shapes); the whole buffer otherwise
    (none, fp16: per-parameter payloads cost a concatenation, +22 ms a step on the benchmark
    mlp's 27 MB)."""
    if MULTI_ROUND not in compressor.capabilities:
        return [buffer]
    shapes = [p.shape for p in bucket.parameters()]
    sizes = [shape.numel() for shape in shapes]
    if sum(sizes) != buffer.numel():
        return [buffer]  # not a plain concatenation (never seen): compress it whole
    return [part.view(shape) for part, shape in zip(buffer.split(sizes), shapes)]


def compress_wrapper(inner: Hook, compression: str | Compressor) -> Hook:
    """``inner`` run on a cast of the bucket, like torch's ``fp16_compress_wrapper``:
    ``compress_wrapper(hook, "fp16")`` (or around torch's own hooks, e.g. ``powerSGD_hook``).

    1. Cast the bucket's buffer (``compression``: a cast compressor, "fp16" or "bf16") and hand
       the cast copy to ``inner`` through ``bucket.set_buffer``.
    2. When ``inner``'s future completes, decompress its result into the original buffer.
    """
    compressor = create(compression)
    if not (compressor.summable and compressor.compresses_small_tensors):
        raise ValueError(
            f"compress_wrapper(compression={compression!r}): allowed a cast compressor "
            "('fp16', 'bf16'); give other compressors to CommState(compression=...)"
        )

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if _alone(state):  # over one rank the inner hook (ours) returns the bucket as it is
            return inner(state, bucket)
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
