"""Blocking collectives, differentiable: each is a torch.autograd.Function whose backward is
horovod.torch's (allreduce -> the same allreduce; allgather -> the rank's slice of the gradient
averaged over the set; broadcast -> the averaged gradient on the root, zeros elsewhere;
alltoall -> alltoall back; reducescatter -> allgather, times the set's size for Sum). Averaging
is Horovod's convention: every rank's loss counts 1/size, as in DistributedOptimizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from commlayer import compression as compression_
from commlayer import ops
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import Compressed, Compression, Compressor
from commlayer.compression.cast import CastCompressor
from commlayer.compression.none import NoneCompressor
from commlayer.core import runtime
from commlayer.core.process_sets import ProcessSet, global_process_set


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return ops.synchronize(
            ops.allreduce_async(tensor, None, name, op, prescale, postscale, process_set)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        reduced = ops.synchronize(
            ops.allreduce_async(grad, None, None, op, prescale, postscale, process_set)
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Compressor | str = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default op Average) and return the result."""
    resolved = ops._resolve_op(op, average, ReduceOp.Average, ops.ALLREDUCE_OPS)
    cast = _cast(compression, "allreduce")
    packed = cast.compress(tensor, name or "")
    reduced = _Allreduce.apply(
        packed.payload[0], name, resolved, prescale_factor, postscale_factor, process_set
    )
    return cast.decompress(Compressed([reduced], packed.ctx))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(
            ops.synchronize(
                ops.grouped_allreduce_async(
                    tensors, None, name, op, prescale, postscale, process_set
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        reduced = ops.synchronize(
            ops.grouped_allreduce_async(
                list(grads), None, None, op, prescale, postscale, process_set
            )
        )
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Compressor | str = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allreduce several tensors as one negotiated, fused unit."""
    resolved = ops._resolve_op(op, average, ReduceOp.Average, ops.ALLREDUCE_OPS)
    cast = _cast(compression, "grouped_allreduce")
    packed = [cast.compress(t, name or "") for t in tensors]
    reduced = _GroupedAllreduce.apply(
        name, resolved, prescale_factor, postscale_factor, process_set,
        *(p.payload[0] for p in packed),
    )  # fmt: skip
    return [cast.decompress(Compressed([r], p.ctx)) for r, p in zip(reduced, packed, strict=True)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        gathered = ops.synchronize(ops.allgather_async(tensor, name, process_set))
        # After allgather_async validated tensor: a non-tensor gets its ValueError, not an
        # AttributeError from reading its shape first.
        ctx.dim0 = tensor.shape[0]
        ctx.process_set = process_set
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = ops.synchronize(
            ops.allreduce_async(grad, None, None, ReduceOp.Average, 1.0, 1.0, ctx.process_set)
        )
        dims = ops.synchronize(ops.allgather_async(torch.tensor([ctx.dim0]), None, ctx.process_set))
        offset = int(dims[: ctx.process_set.rank()].sum())
        return averaged.narrow(0, offset, ctx.dim0), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0."""
    return _Allgather.apply(tensor, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = ops.synchronize(
            ops.allreduce_async(grad, None, None, ReduceOp.Average, 1.0, 1.0, ctx.process_set)
        )
        if runtime.rank() != ctx.root_rank:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return root_rank's tensor on every rank."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` with root_rank's, in place (not differentiable)."""
    return ops.synchronize(ops.broadcast_async_(tensor, root_rank, name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
    ) -> Any:
        output, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        back, _received = ops.synchronize(
            ops.alltoall_async(grad, ctx.received, None, ctx.process_set)
        )
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter rows of ``tensor`` (splits[q] to rank q) and gather what others send here.
    Returns the output, or (output, received_splits) when ``splits`` is given."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return ops.synchronize(
            ops.reducescatter_async(tensor, name, op, prescale, postscale, process_set)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = ops.synchronize(ops.allgather_async(grad, None, ctx.args[3]))
        return gathered * _reducescatter_grad_scale(ctx.args), None, None, None, None, None


def _reducescatter_grad_scale(args: tuple[ReduceOp, float, float, ProcessSet]) -> float:
    """Horovod's backward of reducescatter: the allgathered gradient times the set's size for
    Sum (1 for Average), times the pre- and postscale factors."""
    op, prescale, postscale, process_set = args
    return prescale * postscale * (process_set.size() if op == ReduceOp.Sum else 1)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Compressor | str = Compression.none,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce over ranks (default Average); rank r gets its block of dimension 0."""
    resolved = ops._resolve_op(op, None, ReduceOp.Average)
    cast = _cast(compression, "reducescatter")
    packed = cast.compress(tensor, name or "")
    reduced = _Reducescatter.apply(
        packed.payload[0], name, resolved, prescale_factor, postscale_factor, process_set
    )
    return cast.decompress(Compressed([reduced], packed.ctx))


def _cast(compression: Compressor | str, what: str) -> Compressor:
    """Horovod's ``compression=`` of one collective: none, fp16 or bf16 (a cast there and back
    around it). Other compressors need state and rounds: DistributedOptimizer runs them."""
    compressor = compression_.create(compression)
    if not isinstance(compressor, (NoneCompressor, CastCompressor)):
        raise ops._input_error(
            f"{what}(compression={compressor.name!r}): only none, fp16 and bf16 apply to one "
            "collective (as in Horovod); pass other compressors to "
            "DistributedOptimizer(compression=...)"
        )
    return compressor


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        gathered = ops.synchronize(ops.grouped_allgather_async(tensors, name, process_set))
        ctx.dim0s, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(gathered)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.process_set
        handles = [
            ops.allreduce_async(g, None, None, ReduceOp.Average, 1.0, 1.0, ps) for g in grads
        ]
        dims = ops.synchronize(ops.allgather_async(torch.tensor([ctx.dim0s]), None, ps))
        offsets = dims[: ps.rank()].sum(0).tolist()
        summed = [ops.synchronize(h) for h in handles]
        parts = [s.narrow(0, o, d) for s, o, d in zip(summed, offsets, ctx.dim0s)]
        return (None, None, *parts)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgather each tensor of a list, submitted together; differentiable like allgather."""
    if not isinstance(tensors, (list, tuple)):
        ops.grouped_allgather_async(tensors, name, process_set)  # raises the ValueError
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(
            ops.synchronize(
                ops.grouped_reducescatter_async(tensors, name, op, process_set, prescale, postscale)
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        gathered = ops.synchronize(ops.grouped_allgather_async(list(grads), None, ctx.args[3]))
        scale = _reducescatter_grad_scale(ctx.args)
        return (None, None, None, None, None, *(g * scale for g in gathered))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list, submitted together (default op Average); rank r
    gets its block of each; differentiable like reducescatter."""
    if not isinstance(tensors, (list, tuple)):
        ops.grouped_reducescatter_async(tensors, name, op, process_set)  # raises the ValueError
    resolved = ops._resolve_op(op, None, ReduceOp.Average)
    return list(
        _GroupedReducescatter.apply(
            name, resolved, prescale_factor, postscale_factor, process_set, *tensors
        )
    )
