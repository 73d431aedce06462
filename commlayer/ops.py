"""Collective operations with horovod.torch's names: allreduce(_)(_async), allgather, broadcast,
alltoall, reducescatter, grouped variants, barrier, join, poll, synchronize.

``name_async`` returns a Handle at once; ``synchronize(handle)`` waits and returns the result;
a trailing ``_`` means in place. The blocking forms are differentiable (functions.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from commlayer import algorithms
from commlayer.common.errors import UnsupportedOpError
from commlayer.common.reduce_ops import SUPPORTED_OPS, ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import device, runtime, wire
from commlayer.core.engine import Operation
from commlayer.core.future import Future, Handle, combined
from commlayer.core.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    REGISTER,
    Announce,
    Registration,
    dtype_name,
    shapes_of,
)
from commlayer.core.process_sets import ProcessSet, check_ranks, global_process_set

# and the operators of the combining algorithms (Adasum: algorithms/adasum.py), allreduce only
ALLREDUCE_OPS = (*SUPPORTED_OPS, *algorithms.combining_ops())
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
            _submit_all(pending)


def _submit_all(operations: list[Operation]) -> None:
    """Queue ``operations``, all or none: if they cannot be (a duplicate name, a stopped
    engine), each future fails with the error the caller gets."""
    try:
        runtime.engine().submit_all(operations)
    except Exception as exc:
        for op in operations:
            op.handle.set_exception(exc)
        raise


def _input_error(message: str) -> ValueError:
    """A bad argument, named with this rank (a 4-rank job prints four such lines)."""
    where = f"rank {runtime.rank()}: " if runtime.is_initialized() else ""
    return ValueError(where + message)


def _auto_name(kind: str, name: str | None, set_id: int) -> str:
    """The given name, or the next of a per-(kind, process set) counter: members of a set
    call its collectives in the same order, but non-members never do, so one counter across
    sets would leave the ranks' global names out of step after a set's first operation."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise _input_error(f"name must be a non-empty str, got {name!r}")
        return name
    with _counter_lock:
        counter = _counters.setdefault((kind, set_id), itertools.count())
        prefix = kind if set_id == 0 else f"{kind}.set{set_id}"
        return f"{prefix}.noname.{next(counter)}"


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise _input_error(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise _input_error(
            f"{what}: dtype {dtype_name(tensor.dtype)} is not supported; allowed: {allowed}"
        )
    if tensor.is_sparse:
        raise _input_error(
            f"{what}: sparse tensors are not supported; use sparse_allreduce or to_dense()"
        )
    where = device.check(tensor)
    if where is not None:
        raise _input_error(f"{what}: {where}")
    return tensor.detach()


def _resolve_op(
    op: ReduceOp | None,
    average: bool | None,
    default: ReduceOp,
    allowed: tuple[ReduceOp, ...] = SUPPORTED_OPS,
) -> ReduceOp:
    if op is not None and average is not None:
        raise _input_error("pass either op= or the deprecated average=, not both")
    if average is not None:
        return ReduceOp.Average if average else ReduceOp.Sum
    resolved = default if op is None else ReduceOp(op)
    if resolved not in allowed:
        error = _input_error(
            f"reduce op {resolved.name} is not supported here; allowed: "
            f"{', '.join(o.name for o in allowed)}"
        )
        raise UnsupportedOpError(*error.args)
    return resolved


def _set_id(process_set: ProcessSet) -> int:
    if not process_set.included():  # included() checks the set is registered
        raise _input_error(f"this rank is not in {process_set!r}")
    assert process_set.process_set_id is not None
    return process_set.process_set_id


def _submit(
    kind: str,
    name: str | None,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    process_set: ProcessSet,
    *,
    op: ReduceOp = ReduceOp.Sum,
    root: int = -1,
    splits: tuple[int, ...] | None = None,
    prescale: float = 1.0,
    postscale: float = 1.0,
    finish: Callable[[Any], Any] | None = None,
    shapes: tuple[tuple[int, ...], ...] | None = None,
    registration: Registration | None = None,
) -> Handle:
    if kind == ALLREDUCE and op not in SUPPORTED_OPS:
        found = algorithms.combining(op)  # Adasum's (algorithms/registry.py)
        if found is not None:
            return _combine(found, name, inputs, outputs, process_set, prescale, postscale, finish)
    engine = runtime.engine()
    set_id = _set_id(process_set)
    dtype = dtype_name(inputs[0].dtype) if inputs else "uint8"
    if op == ReduceOp.Average and inputs and inputs[0].dtype == torch.bool:
        raise _input_error(
            f"{kind}: Average is not defined for bool tensors; use Sum or Max (logical or), "
            "Min or Product (logical and)"
        )
    try:  # CUDA tensors: taken by the backend directly, or staged in host memory (device.py)
        inputs, outputs, staged, channel = device.prepare(inputs, outputs, engine.backend(set_id))
    except ValueError as exc:
        raise _input_error(f"{kind}: {exc}") from None
    announce = Announce(
        _auto_name(kind, name, set_id),
        kind,
        dtype,
        shapes if shapes is not None else shapes_of(inputs),
        int(op),
        root,
        splits,
        channel,
        registration,
    )
    operation = Operation(
        announce,
        inputs,
        outputs,
        set_id,
        float(prescale),
        float(postscale),
        finish if staged is None else staged.wrap(finish),
    )
    if staged is not None:
        operation.ready = staged.ready
    pending = _batch.get()
    if pending is None:
        return engine.submit(operation)
    pending.append(operation)
    return operation.handle


def _in_place(tensor: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[Any], Any]]:
    """(contiguous working tensor, finish that writes it back if it was a copy and returns
    ``tensor`` itself, as horovod.torch's in-place forms do: a Parameter stays a Parameter)."""
    checked = _check_tensor(tensor, what)  # detached: the engine writes outside autograd
    if checked.is_contiguous():
        return checked, lambda _: tensor
    work = checked.contiguous()

    def finish(_: Any) -> torch.Tensor:
        checked.copy_(work)
        return tensor

    return work, finish


def _combine(
    algorithm: algorithms.Combine,
    name: str | None,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    process_set: ProcessSet,
    prescale: float,
    postscale: float,
    finish: Callable[[Any], Any] | None,
) -> Future:
    """allreduce under a combining algorithm (``op=Adasum``: algorithms/adasum.py): every
    rank's tensors gathered, one allgather each (its ``moves``), and combined on every rank
    (Adasum: in Horovod's tree); the results are written to ``outputs``."""
    bad = [dtype_name(t.dtype) for t in inputs if not t.is_floating_point()]
    if bad and algorithm.floating_only:
        raise _input_error(
            f"{algorithm.op.name} needs floating-point tensors, got {', '.join(bad)}"
        )
    base = _auto_name(ALLREDUCE, name, _set_id(process_set))
    with batch():
        parts = [
            allgather_async(
                (t * prescale if prescale != 1.0 else t).reshape(1, -1),
                name=base if len(inputs) == 1 else f"{base}.{i}",
                process_set=process_set,
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


# -- allreduce -----------------------------------------------------------------------------------
def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start an allreduce of ``tensor`` (not modified); synchronize() returns a new tensor."""
    source = _check_tensor(tensor, "allreduce").contiguous()
    output = torch.empty_like(source)
    return _submit(
        ALLREDUCE,
        name,
        [source],
        [output],
        process_set,
        op=_resolve_op(op, average, ReduceOp.Average, ALLREDUCE_OPS),
        prescale=prescale_factor,
        postscale=postscale_factor,
        finish=lambda outs: outs[0],
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start an in-place allreduce; synchronize() returns ``tensor`` holding the result."""
    work, finish = _in_place(tensor, "allreduce_")
    return _submit(
        ALLREDUCE,
        name,
        [work],
        [work],
        process_set,
        op=_resolve_op(op, average, ReduceOp.Average, ALLREDUCE_OPS),
        prescale=prescale_factor,
        postscale=postscale_factor,
        finish=finish,
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place allreduce (blocking)."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Allreduce a list of tensors as one unit (negotiated and fused together)."""
    sources = _plain_group(tensors)
    if sources is None:
        sources = [_check_tensor(t, "grouped_allreduce").contiguous() for t in tensors]
        _check_group(sources, "grouped_allreduce")
    outputs = [torch.empty_like(s) for s in sources]
    return _submit(
        ALLREDUCE,
        name,
        sources,
        outputs,
        process_set,
        op=_resolve_op(op, average, ReduceOp.Average, ALLREDUCE_OPS),
        prescale=prescale_factor,
        postscale=postscale_factor,
        finish=list,
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """In-place grouped allreduce."""
    plain = _plain_group(tensors)
    if plain is not None:  # written where they lie (the engine writes outside autograd)
        works: Sequence[torch.Tensor] = plain
        finishes: Sequence[Callable[[Any], Any]] = ()
        done: Callable[[Any], Any] = lambda _: list(plain)  # noqa: E731
    else:
        pairs = [_in_place(t, "grouped_allreduce_") for t in tensors]
        _check_group([work for work, _ in pairs], "grouped_allreduce_")
        works, finishes = zip(*pairs)
        done = lambda _: [f(None) for f in finishes]  # noqa: E731
    return _submit(
        ALLREDUCE,
        name,
        list(works),
        list(works),
        process_set,
        op=_resolve_op(op, average, ReduceOp.Average, ALLREDUCE_OPS),
        prescale=prescale_factor,
        postscale=postscale_factor,
        finish=done,
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def _plain_group(tensors: Sequence[Any]) -> list[torch.Tensor] | None:
    """The tensors as a list when all are dense contiguous CPU tensors of one supported dtype,
    checked in one cheap pass (~0.3 us a tensor, where ``_check_tensor`` takes ~2); None sends
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


def _check_group(tensors: Sequence[torch.Tensor], what: str) -> None:
    if not tensors:
        raise _input_error(f"{what} needs at least one tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise _input_error(
            f"{what}: all tensors of a group must share one dtype, got "
            f"{sorted(dtype_name(d) for d in dtypes)}"
        )


# -- allgather, broadcast, alltoall, reducescatter -----------------------------------------------
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Concatenate every rank's tensor along dim 0 (first dimension may differ per rank)."""
    source = _check_tensor(tensor, "allgather").contiguous()
    if source.dim() == 0:
        raise _input_error("allgather needs a tensor with at least one dimension")
    return _submit(ALLGATHER, name, [source], [], process_set)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Copy root_rank's tensor to every rank (result is a new tensor)."""
    source = _check_tensor(tensor, "broadcast").contiguous()
    return _submit(
        BROADCAST,
        name,
        [source],
        [torch.empty_like(source)],
        process_set,
        root=_check_root(root_rank, process_set),
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Overwrite ``tensor`` with root_rank's, in place."""
    work, finish = _in_place(tensor, "broadcast_")
    return _submit(
        BROADCAST,
        name,
        [work],
        [work],
        process_set,
        root=_check_root(root_rank, process_set),
        finish=finish,
    )


def _check_root(root_rank: int, process_set: ProcessSet) -> int:
    """The root's position in the set's communicator. ``root_rank`` is a global rank, also with
    ``process_set=`` (as in Horovod), and must belong to the set."""
    process_set._check()
    ranks = process_set.ranks
    try:
        root = None if isinstance(root_rank, bool) else operator.index(root_rank)
    except TypeError:
        root = None
    if root not in ranks:
        where = (
            f"in [0, {len(ranks)})"
            if process_set.process_set_id == 0
            else f"a global rank of the process set {ranks}"
        )
        raise _input_error(f"root_rank must be an int {where}, got {root_rank!r}")
    return ranks.index(root)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Send splits[q] rows of ``tensor`` to rank q; receive what each rank sends here.
    synchronize() returns (output, received_splits)."""
    source = _check_tensor(tensor, "alltoall").contiguous()
    if source.dim() == 0:
        raise _input_error("alltoall needs a tensor with at least one dimension")
    size = process_set.size()
    if splits is None:
        if source.shape[0] % size:
            raise _input_error(
                f"alltoall without splits needs dim 0 ({source.shape[0]}) divisible "
                f"by the number of ranks ({size})"
            )
        rows = (source.shape[0] // size,) * size
    else:
        rows = tuple(
            int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)
        )
        if len(rows) != size or any(s < 0 for s in rows) or sum(rows) != source.shape[0]:
            raise _input_error(
                f"alltoall splits {list(rows)} must be "
                f"{size} non-negative ints summing to dim 0 ({source.shape[0]})"
            )
    return _submit(ALLTOALL, name, [source], [], process_set, splits=rows)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Reduce over ranks, then give rank r its block of dim 0 (the first dim0 % size ranks
    get one extra row)."""
    source = _check_tensor(tensor, "reducescatter").contiguous()
    if source.dim() == 0:
        raise _input_error("reducescatter needs a tensor with at least one dimension")
    return _submit(
        REDUCESCATTER,
        name,
        [source],
        [],
        process_set,
        op=_resolve_op(op, None, ReduceOp.Average),
        prescale=prescale_factor,
        postscale=postscale_factor,
    )


# -- synchronization -------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True once the operation has completed (synchronize will not block)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its result (raises its error)."""
    if not isinstance(handle, Future):
        raise _input_error(
            f"synchronize expects a Handle (Future) from an *_async call, got {handle!r}"
        )
    return handle.wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the set has called barrier.

    Every barrier of a set has the one name ``barrier`` (as in Horovod): a per-process counter
    would give ranks different names for ever after a barrier that stalled on some ranks only.
    """
    synchronize(_submit(BARRIER, "barrier", [], [], process_set, shapes=()))


def join(device: int = -1) -> int:
    """This rank has no more data: its collectives' peers get zeros from it (nothing for
    allgather) until every rank joined. Returns the rank that joined last."""
    return int(runtime.engine().join().wait())


def topology(process_set: ProcessSet = global_process_set) -> Topology:
    """The nodes of the set's ranks as the engine's algorithms see them (the backend's, or
    COMMLAYER_TOPOLOGY for the global set)."""
    return runtime.engine().topology(_set_id(process_set))


def register_process_set(ranks: Sequence[int]) -> int:
    change = Registration(ranks=tuple(ranks))
    return int(
        synchronize(_submit(REGISTER, None, [], [], global_process_set, registration=change))
    )


def unregister_process_set(set_id: int) -> None:
    change = Registration(removed=set_id)
    synchronize(_submit(REGISTER, None, [], [], global_process_set, registration=change))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set while running; collective: every rank calls it, same ranks."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    check_ranks(ps, runtime.size())
    ps.process_set_id = register_process_set(ps.ranks)
    runtime.remember_process_set(ps, added=True)  # an elastic re-formation registers it again
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over all ranks)."""
    if process_set.process_set_id in (None, 0):
        return False
    unregister_process_set(process_set.process_set_id)
    process_set.process_set_id = None
    runtime.remember_process_set(process_set, added=False)
    return True


# -- grouped allgather and reducescatter, sparse allreduce ---------------------------------------
def _grouped(
    kind: str,
    tensors: Sequence[torch.Tensor],
    name: str | None,
    process_set: ProcessSet,
    start: Callable[[torch.Tensor, str], Handle],
) -> Handle:
    """One operation per tensor, named ``<name>.<i>``, submitted together (so they are
    negotiated in the same cycle); synchronize() returns the list of results."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise _input_error(f"grouped_{kind} needs a non-empty list of tensors, got {tensors!r}")
    base = _auto_name(f"grouped_{kind}", name, _set_id(process_set))
    with batch():
        handles = [start(tensor, f"{base}.{i}") for i, tensor in enumerate(tensors)]
    return combined(base, handles, list)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Allgather each tensor of a list (dim 0 may differ per rank and per tensor);
    synchronize() returns the list of gathered tensors."""
    return _grouped(
        "allgather", tensors, name, process_set, lambda t, n: allgather_async(t, n, process_set)
    )


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Reducescatter each tensor of a list (default op Average); synchronize() returns the
    list of this rank's blocks."""
    return _grouped(
        "reducescatter",
        tensors,
        name,
        process_set,
        lambda t, n: reducescatter_async(t, n, op, prescale_factor, postscale_factor, process_set),
    )


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Sum or average a sparse COO tensor over the ranks, as Horovod does: allgather every
    rank's indices and values (nnz may differ per rank); synchronize() returns the coalesced
    sparse sum (entries at one index added), divided by the set's size for Average (integer
    values truncated toward zero, as the dense Average).

    The entries travel as rows of index and value bytes (core/wire.py ``pack_rows``, as the
    sparse reduction of top-k payloads moves them) in one allgather named ``name``: one
    operation of that name, so a rank that submits another kind under it (a dense gradient
    where the others have a sparse one) is a mismatch negotiation reports."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        raise _input_error(
            "sparse_allreduce_async expects a sparse COO tensor (torch.sparse_coo), got "
            + (f"layout {tensor.layout}" if isinstance(tensor, torch.Tensor) else repr(tensor))
        )
    resolved = _resolve_op(op, None, ReduceOp.Average)
    if resolved not in (ReduceOp.Sum, ReduceOp.Average):
        raise _input_error(
            f"sparse_allreduce_async: op {resolved.name} is not supported; allowed: Sum, Average"
        )
    base = _auto_name("sparse_allreduce", name, _set_id(process_set))
    source = tensor.detach()
    values = source._values()  # (nnz, *dense dims)
    index_shape, value_shape = (source.sparse_dim(),), tuple(values.shape[1:])
    rows = wire.pack_rows(source._indices().t(), values)  # dim 0 (entries) concatenates
    handle = allgather_async(rows, base, process_set)
    divisor = process_set.size() if resolved == ReduceOp.Average else 1

    def combine(results: list[Any]) -> torch.Tensor:
        all_indices, all_values = wire.split_rows(
            results[0], torch.int64, index_shape, source.dtype, value_shape
        )
        # Checked: the indices come from other ranks, whose tensors may be of another shape
        # (one pass over them, against memory errors in coalesce). Saying so also keeps torch's
        # "Sparse invariant checks are implicitly disabled" warning off every rank.
        summed = torch.sparse_coo_tensor(
            all_indices.t(), all_values, source.shape, dtype=source.dtype, check_invariants=True
        ).coalesce()
        if divisor == 1:
            return summed
        divided = (
            summed.values() / divisor
            if summed.dtype.is_floating_point
            else torch.div(summed.values(), divisor, rounding_mode="trunc")
        )
        return torch.sparse_coo_tensor(
            summed.indices(),
            divided,
            source.shape,
            check_invariants=False,  # summed's own
        ).coalesce()

    return combined(base, [handle], combine)


# -- timeline --------------------------------------------------------------------------------------
_timeline_lock = threading.Lock()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome trace of the engine's work to ``file_path`` from now on, as
    COMMLAYER_TIMELINE does from init(): rank 0 writes it, or every rank its own file when the
    path contains ``{rank}``. A timeline already running is closed first. ``mark_cycles`` adds a
    CYCLE_START instant on a "cycles" row at each negotiation cycle. Not collective."""
    if not isinstance(file_path, str) or not file_path:
        raise _input_error(f"start_timeline: file_path must be a non-empty str, got {file_path!r}")
    from commlayer.core.timeline import open_timeline

    engine = runtime.engine()
    with _timeline_lock:
        timeline = open_timeline(file_path, engine.rank)  # OSError names the file and rank
        engine.set_timeline(timeline, bool(mark_cycles)).close()


def stop_timeline() -> None:
    """Stop the timeline (started here or by COMMLAYER_TIMELINE) and close its file, which is
    then valid JSON. Does nothing when no timeline runs."""
    from commlayer.core.timeline import NullTimeline

    engine = runtime.engine()
    with _timeline_lock:
        engine.set_timeline(NullTimeline()).close()
