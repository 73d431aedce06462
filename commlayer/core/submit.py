"""The one way into the engine: ``submit(Request) -> Future``.

A :class:`Request` is one collective as the engine takes it: tensors it can move (dense,
contiguous, of a supported dtype, on the CPU or a CUDA device), a process set this rank is in,
an operator, a root's index in the set. ``submit`` names it (the caller's name, or the next of
a per-kind counter), brings CUDA tensors to the backend (core/device.py), and queues it, or
adds it to the enclosing :func:`batch`. An allreduce under a combining operator (Adasum:
algorithms/adasum.py) becomes its allgathers and the combine.

Two callers: commlayer/ops.py, the public collectives, which checks the user's arguments and
builds requests; and comm/ (the communicator, its sparse reduction, the per-host levels), which
builds requests from tensors it made or already knows. The checks here are what the engine
needs of a tensor (``check_tensor``, ``in_place_group``); a group of plain tensors passes them
in one cheap pass, the path every gradient bucket takes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from commlayer import algorithms
from commlayer.backends import shm
from commlayer.common.reduce_ops import SUPPORTED_OPS, ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import device, runtime
from commlayer.core.engine import Operation
from commlayer.core.future import Future, combined
from commlayer.core.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    REGISTER,
    WINDOW,
    Announce,
    Registration,
    dtype_name,
    shapes_of,
)
from commlayer.core.process_sets import ProcessSet, global_process_set

SUPPORTED_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)


@dataclasses.dataclass(slots=True)
class Request:
    """One collective for the engine. ``inputs`` and ``outputs`` are what the engine reads and
    writes (the same list for in-place forms; no outputs where the engine allocates the result:
    allgather, alltoall, reducescatter). ``name`` None: the next of a per-(kind, set) counter.
    ``root``: the root's index in the process set. ``finish`` maps the engine's raw result to
    the future's value. ``shapes``: announced instead of the inputs' (a barrier's ``()``).
    ``registration``: a REGISTER request's change of the process sets (or a planned lane).
    ``planned``: (lane, index in the plan, step since the plan or -1 where it could not be sent
    as planned) of a planned part, reduced on its lane without negotiation (core/planned.py)."""

    kind: str
    name: str | None
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    process_set: ProcessSet = global_process_set
    op: ReduceOp = ReduceOp.Sum
    root: int = -1
    splits: tuple[int, ...] | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    finish: Callable[[Any], Any] | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    registration: Registration | None = None
    planned: tuple[int, int, int] | None = None  # a planned part: core/planned.py


_counters: dict[tuple[str, int], itertools.count[int]] = {}
_counter_lock = threading.Lock()
_batch: contextvars.ContextVar[list[Operation] | None] = contextvars.ContextVar(
    "commlayer_batch", default=None
)


@contextlib.contextmanager
def batch() -> Iterator[None]:
    """Operations started in this block are handed to the engine together when it ends (one
    wake-up, negotiated in one cycle) instead of one by one: the caller batches, the engine
    does not wait for company (engine.py, constraint 3). Do not wait on them inside the block:
    they are not submitted yet. A nested block joins the outer one."""
    if _batch.get() is not None:
        yield
        return
    pending: list[Operation] = []
    token = _batch.set(pending)
    try:
        yield
    finally:
        _batch.reset(token)
        if pending:
            submit_all(pending)


def submit_all(operations: list[Operation]) -> None:
    """Queue ``operations``, all or none: if they cannot be (a duplicate name, a stopped
    engine), each future fails with the error the caller gets."""
    try:
        runtime.engine().submit_all(operations)
    except Exception as exc:
        for op in operations:
            op.handle.set_exception(exc)
        raise


def input_error(message: str) -> ValueError:
    """A bad argument, named with this rank (a 4-rank job prints four such lines)."""
    where = f"rank {runtime.rank()}: " if runtime.is_initialized() else ""
    return ValueError(where + message)


def auto_name(kind: str, name: str | None, set_id: int) -> str:
    """The given name, or the next of a per-(kind, process set) counter: members of a set
    call its collectives in the same order, but non-members never do, so one counter across
    sets would leave the ranks' global names out of step after a set's first operation."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise input_error(f"name must be a non-empty str, got {name!r}")
        return name
    with _counter_lock:
        counter = _counters.setdefault((kind, set_id), itertools.count())
        prefix = kind if set_id == 0 else f"{kind}.set{set_id}"
        return f"{prefix}.noname.{next(counter)}"


def set_id(process_set: ProcessSet) -> int:
    """The engine's id of ``process_set``, which this rank must belong to."""
    if not process_set.included():  # included() checks the set is registered
        raise input_error(f"this rank is not in {process_set!r}")
    assert process_set.process_set_id is not None
    return process_set.process_set_id


# -- the tensors the engine takes ------------------------------------------------------------------
def check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """``tensor`` detached, if the engine can move it: a dense torch.Tensor of a supported
    dtype on a device it reaches; else a ValueError naming ``what``."""
    if not isinstance(tensor, torch.Tensor):
        raise input_error(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise input_error(
            f"{what}: dtype {dtype_name(tensor.dtype)} is not supported; allowed: {allowed}"
        )
    if tensor.is_sparse:
        raise input_error(
            f"{what}: sparse tensors are not supported; use sparse_allreduce or to_dense()"
        )
    where = device.check(tensor)
    if where is not None:
        raise input_error(f"{what}: {where}")
    return tensor.detach()


def check_group(tensors: Sequence[torch.Tensor], what: str) -> None:
    """A group travels as one operation: at least one tensor, all of one dtype."""
    if not tensors:
        raise input_error(f"{what} needs at least one tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise input_error(
            f"{what}: all tensors of a group must share one dtype, got "
            f"{sorted(dtype_name(d) for d in dtypes)}"
        )


def in_place(tensor: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[Any], Any]]:
    """(contiguous working tensor, finish that writes it back if it was a copy and returns
    ``tensor`` itself, as horovod.torch's in-place forms do: a Parameter stays a Parameter)."""
    checked = check_tensor(tensor, what)  # detached: the engine writes outside autograd
    if checked.is_contiguous():
        return checked, lambda _: tensor
    work = checked.contiguous()

    def finish(_: Any) -> torch.Tensor:
        checked.copy_(work)
        return tensor

    return work, finish


def in_place_group(
    tensors: Sequence[torch.Tensor], what: str
) -> tuple[list[torch.Tensor], Callable[[Any], Any]]:
    """(the tensors the engine writes, finish that returns the list of ``tensors``) for a group
    reduced in place. Plain tensors (below) are written where they lie, checked in one pass;
    any other goes through ``in_place`` (checked, copied if not contiguous, written back)."""
    plain = plain_group(tensors)
    if plain is not None:  # written where they lie (the engine writes outside autograd)
        return plain, lambda _: list(plain)
    pairs = [in_place(t, what) for t in tensors]
    check_group([work for work, _ in pairs], what)
    works, finishes = zip(*pairs)
    return list(works), lambda _: [f(None) for f in finishes]


def plain_group(tensors: Sequence[Any]) -> list[torch.Tensor] | None:
    """The tensors as a list when all are dense contiguous CPU tensors of one supported dtype,
    checked in one cheap pass (~0.3 us a tensor, where ``check_tensor`` takes ~2); None sends
    the caller to the per-tensor path, which copies what is not contiguous and names errors."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.dtype not in SUPPORTED_DTYPES:
        return None
    dtype = first.dtype
    for tensor in tensors:
        if not (
            isinstance(tensor, torch.Tensor)
            and tensor.dtype is dtype
            and tensor.is_cpu
            and tensor.layout is torch.strided
            and tensor.is_contiguous()
        ):
            return None
    return list(tensors)


# -- submit ----------------------------------------------------------------------------------------
def submit(request: Request) -> Future:
    """Hand ``request`` to the engine (or to the enclosing ``batch``); its future at once."""
    kind, inputs, outputs, op = request.kind, request.inputs, request.outputs, request.op
    if kind == ALLREDUCE and op not in SUPPORTED_OPS:
        found = algorithms.combining(op)  # Adasum's (algorithms/registry.py)
        if found is not None:
            return _combine(found, request)
    engine = runtime.engine()
    ident = set_id(request.process_set)
    dtype = dtype_name(inputs[0].dtype) if inputs else "uint8"
    if op == ReduceOp.Average and inputs and inputs[0].dtype == torch.bool:
        raise input_error(
            f"{kind}: Average is not defined for bool tensors; use Sum or Max (logical or), "
            "Min or Product (logical and)"
        )
    try:  # CUDA tensors: taken by the backend directly, or staged in host memory (device.py)
        inputs, outputs, staged, channel = device.prepare(inputs, outputs, engine.backend(ident))
    except ValueError as exc:
        raise input_error(f"{kind}: {exc}") from None
    if shm.live_windows() and kind == ALLREDUCE and len(inputs) == 1 and staged is None:
        # a planned bucket in its window (backends/shm.py's BucketWindow), reduced in place:
        # announced on the window's channel, which every rank must then use too
        if outputs and outputs[0] is inputs[0]:
            channel = shm.window_channel(inputs[0])
    announce = Announce(
        auto_name(kind, request.name, ident),
        kind,
        dtype,
        request.shapes if request.shapes is not None else shapes_of(inputs),
        int(op),
        request.root,
        request.splits,
        channel,
        request.registration,
    )
    finish = request.finish
    operation = Operation(
        announce,
        inputs,
        outputs,
        ident,
        float(request.prescale),
        float(request.postscale),
        finish if staged is None else staged.wrap(finish),
    )
    if request.planned is not None and staged is None:
        operation.planned = request.planned
    if staged is not None:
        operation.ready = staged.ready
    pending = _batch.get()
    if pending is None:
        return engine.submit(operation)
    pending.append(operation)
    return operation.handle


def _combine(algorithm: algorithms.Combine, request: Request) -> Future:
    """allreduce under a combining algorithm (``op=Adasum``: algorithms/adasum.py): every
    rank's tensors gathered, one allgather each (its ``moves``), and combined on every rank
    (Adasum: in Horovod's tree); the results are written to ``outputs``."""
    inputs, outputs, process_set = request.inputs, request.outputs, request.process_set
    prescale, postscale, finish = request.prescale, request.postscale, request.finish
    bad = [dtype_name(t.dtype) for t in inputs if not t.is_floating_point()]
    if bad and algorithm.floating_only:
        raise input_error(f"{algorithm.op.name} needs floating-point tensors, got {', '.join(bad)}")
    base = auto_name(ALLREDUCE, request.name, set_id(process_set))
    with batch():
        parts = [
            submit(
                Request(
                    ALLGATHER,
                    base if len(inputs) == 1 else f"{base}.{i}",
                    [(t.detach() * prescale if prescale != 1.0 else t.detach()).reshape(1, -1)],
                    [],
                    process_set,
                )
            )
            for i, t in enumerate(inputs)
        ]

    def combine(gathered: list[torch.Tensor]) -> Any:
        for rows, out in zip(gathered, outputs):
            out.view(-1).copy_(algorithm.combine(rows))
            if postscale != 1.0:
                out.mul_(postscale)
        return finish(outputs) if finish is not None else outputs

    return combined(base, parts, combine)


# -- the engine's process sets ---------------------------------------------------------------------
def topology(process_set: ProcessSet = global_process_set) -> Topology:
    """The nodes of the set's ranks as the engine's algorithms see them (the backend's, or
    COMMLAYER_TOPOLOGY for the global set)."""
    return runtime.engine().topology(set_id(process_set))


def register_process_set(ranks: Sequence[int]) -> int:
    """Register the set of global ``ranks`` (collective over every rank, negotiated as one
    REGISTER operation on the global set); its id."""
    change = Registration(ranks=tuple(ranks))
    return int(submit(Request(REGISTER, None, [], [], registration=change)).wait())


def bucket_window(nbytes: int, name: str, process_set: ProcessSet) -> Future:
    """A shared-memory window of ``nbytes`` a rank for DistributedOptimizer's planned buckets
    (collective over ``process_set``, negotiated as one WINDOW operation: every rank makes it
    at the same point of its collectives); its value is the window (backends/shm.py's
    BucketWindow), or None where it does not apply (the engine's ``_bucket_window``)."""
    return submit(Request(WINDOW, name, [], [], process_set, shapes=((nbytes,),)))


def unregister_process_set(ident: int) -> None:
    """Remove the set of id ``ident`` (collective over every rank)."""
    change = Registration(removed=ident)
    submit(Request(REGISTER, None, [], [], registration=change)).wait()
