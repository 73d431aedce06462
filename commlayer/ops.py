"""Collective operations with horovod.torch's names: allreduce(_)(_async), allgather, broadcast,
alltoall, reducescatter, grouped variants, barrier, join, poll, synchronize.

``name_async`` returns a Handle at once; ``synchronize(handle)`` waits and returns the result;
a trailing ``_`` means in place. The blocking forms are differentiable (functions.py).

Each function checks the user's arguments, then hands a ``Request`` to the core's one
``submit`` (core/submit.py), which the communicator (comm/) calls directly.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commlayer import algorithms
from commlayer.common.errors import UnsupportedOpError
from commlayer.common.reduce_ops import SUPPORTED_OPS, ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import runtime, wire
from commlayer.core.future import Future, Handle, combined
from commlayer.core.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
)
from commlayer.core.process_sets import ProcessSet, check_ranks, global_process_set
from commlayer.core.submit import (
    SUPPORTED_DTYPES as SUPPORTED_DTYPES,  # what the engine moves (re-exported)
)
from commlayer.core.submit import (
    Request,
    auto_name,
    check_group,
    check_tensor,
    in_place,
    in_place_group,
    input_error,
    plain_group,
    set_id,
    submit,
)
from commlayer.core.submit import (
    batch as batch,  # the same context manager, re-exported
)
from commlayer.core.submit import (
    register_process_set as register_process_set,
)
from commlayer.core.submit import (
    topology as _topology,
)
from commlayer.core.submit import (
    unregister_process_set as unregister_process_set,
)

_input_error = input_error  # functions.py's name for it

# and the operators of the combining algorithms (Adasum: algorithms/adasum.py), allreduce only
ALLREDUCE_OPS = (*SUPPORTED_OPS, *algorithms.combining_ops())


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


# -- allreduce -----------------------------------------------------------------------------------


def _allreduce(
    name: str | None,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    process_set: ProcessSet,
    op: ReduceOp | None,
    average: bool | None,
    prescale: float,
    postscale: float,
    finish: Callable[[Any], Any],
) -> Handle:
    """The allreduce forms' request (their tensors checked): the operator resolved, Average by
    default, combining operators (Adasum) allowed."""
    return submit(
        Request(
            ALLREDUCE,
            name,
            inputs,
            outputs,
            process_set,
            op=_resolve_op(op, average, ReduceOp.Average, ALLREDUCE_OPS),
            prescale=prescale,
            postscale=postscale,
            finish=finish,
        )
    )


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
    source = check_tensor(tensor, "allreduce").contiguous()
    output = torch.empty_like(source)
    return _allreduce(
        name, [source], [output], process_set, op, average, prescale_factor,
        postscale_factor, lambda outs: outs[0],
    )  # fmt: skip


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
    work, finish = in_place(tensor, "allreduce_")
    return _allreduce(
        name, [work], [work], process_set, op, average, prescale_factor,
        postscale_factor, finish,
    )  # fmt: skip


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
    sources = plain_group(tensors)
    if sources is None:
        sources = [check_tensor(t, "grouped_allreduce").contiguous() for t in tensors]
        check_group(sources, "grouped_allreduce")
    outputs = [torch.empty_like(s) for s in sources]
    return _allreduce(
        name, sources, outputs, process_set, op, average, prescale_factor,
        postscale_factor, list,
    )  # fmt: skip


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
    works, done = in_place_group(tensors, "grouped_allreduce_")
    return _allreduce(
        name, works, works, process_set, op, average, prescale_factor,
        postscale_factor, done,
    )  # fmt: skip


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


# -- allgather, broadcast, alltoall, reducescatter -----------------------------------------------
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Concatenate every rank's tensor along dim 0 (first dimension may differ per rank)."""
    source = check_tensor(tensor, "allgather").contiguous()
    if source.dim() == 0:
        raise _input_error("allgather needs a tensor with at least one dimension")
    return submit(Request(ALLGATHER, name, [source], [], process_set))


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Copy root_rank's tensor to every rank (result is a new tensor)."""
    source = check_tensor(tensor, "broadcast").contiguous()
    return submit(
        Request(
            BROADCAST,
            name,
            [source],
            [torch.empty_like(source)],
            process_set,
            root=_check_root(root_rank, process_set),
        )
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Overwrite ``tensor`` with root_rank's, in place."""
    work, finish = in_place(tensor, "broadcast_")
    return submit(
        Request(
            BROADCAST,
            name,
            [work],
            [work],
            process_set,
            root=_check_root(root_rank, process_set),
            finish=finish,
        )
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
    source = check_tensor(tensor, "alltoall").contiguous()
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
    return submit(Request(ALLTOALL, name, [source], [], process_set, splits=rows))


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
    source = check_tensor(tensor, "reducescatter").contiguous()
    if source.dim() == 0:
        raise _input_error("reducescatter needs a tensor with at least one dimension")
    return submit(
        Request(
            REDUCESCATTER,
            name,
            [source],
            [],
            process_set,
            op=_resolve_op(op, None, ReduceOp.Average),
            prescale=prescale_factor,
            postscale=postscale_factor,
        )
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
    synchronize(submit(Request(BARRIER, "barrier", [], [], process_set, shapes=())))


def join(device: int = -1) -> int:
    """This rank has no more data: its collectives' peers get zeros from it (nothing for
    allgather) until every rank joined. Returns the rank that joined last."""
    return int(runtime.engine().join().wait())


def topology(process_set: ProcessSet = global_process_set) -> Topology:
    """The nodes of the set's ranks as the engine's algorithms see them (the backend's, or
    COMMLAYER_TOPOLOGY for the global set)."""
    return _topology(process_set)


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
    base = auto_name(f"grouped_{kind}", name, set_id(process_set))
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
    base = auto_name("sparse_allreduce", name, set_id(process_set))
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
