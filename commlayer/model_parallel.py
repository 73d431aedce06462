"""Model parallelism's communication as differentiable operations: the oracle's strategies run.

ParaDL's strategies (commlayer/oracle/) need, besides data parallelism's gradient allreduce:

1. filter parallelism (a layer's output channels divided among the ranks): the input's
   gradient summed over ranks backward (``reduce_grad``) and the outputs gathered forward
   (``gather``, its backward the rank's own slice);
2. channel parallelism (the input channels divided): the input sliced forward (``split``, its
   backward an allgather of the slices' gradients) and the partial outputs summed forward
   (``reduce_partial``, its backward the identity);
3. spatial parallelism (the width divided): each rank's input extended by ``halo`` columns of
   its neighbours (``halo_exchange``, one alltoall each way; zeros beyond the ends, which is a
   convolution's zero padding), the outputs gathered along the width where the split ends.
The backward of ``gather`` and ``reduce_partial`` assume what holds in these strategies: after
them every rank computes the same thing, so every rank holds the same output gradient.
Slices are ``shard(n, rank, size)``: rank r holds [n r / size, n (r + 1) / size).
``FilterParallelConv2d``, ``ChannelParallelConv2d`` and ``SpatialParallelConv2d`` wrap a
``torch.nn.Conv2d`` (its weights sliced, copied from the full layer) with them.

4. hybrids (data+filter, data+spatial): ``grid(model_ways)`` registers the process sets, the
   ranks as size / model_ways groups of model_ways consecutive ranks (filter or spatial inside a
   group, the layers above given the group's set) and model_ways data-parallel sets across
   the groups (the gradients averaged there);
5. pipeline: ``send`` and ``recv`` within a 2-rank process set, differentiable. The engine has
   no point-to-point operation; both are one alltoall in the pair in which only the sender
   brings rows (splits [0, n] or [n, 0]; the receiver brings none). The alltoall's own backward
   (an alltoall with the received splits) carries the gradient back the other way, so nothing
   else is needed, and exactly the activation's bytes go over the wire. A broadcast in the pair
   would do the forward too, but its backward (a sum to the root) is not a send, and the
   receiver would have to bring a zero tensor of the full size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from commlayer import functions, ops
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import runtime
from commlayer.core.process_sets import ProcessSet, global_process_set


def shard(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank's part of n items among size ranks."""
    return n * rank // size, n * (rank + 1) // size


def _sum(tensor: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    handle = ops.allreduce_async(tensor, op=ReduceOp.Sum, process_set=process_set)
    return ops.synchronize(handle)  # type: ignore[no-any-return]


def _gather(tensor: torch.Tensor, dim: int, process_set: ProcessSet) -> torch.Tensor:
    moved = tensor.movedim(dim, 0).contiguous()
    gathered = ops.synchronize(ops.allgather_async(moved, process_set=process_set))
    return gathered.movedim(0, dim)  # type: ignore[no-any-return]


def _own(tensor: torch.Tensor, dim: int, process_set: ProcessSet) -> torch.Tensor:
    start, stop = shard(tensor.shape[dim], process_set.rank(), process_set.size())
    return tensor.narrow(dim, start, stop - start).contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, process_set: ProcessSet) -> Any:
        ctx.dim, ctx.process_set = dim, process_set
        return _gather(tensor, dim, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _own(grad, ctx.dim, ctx.process_set), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, process_set: ProcessSet) -> Any:
        ctx.dim, ctx.process_set = dim, process_set
        return _own(tensor, dim, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather(grad, ctx.dim, ctx.process_set), None, None


class _ReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: ProcessSet) -> Any:
        return _sum(tensor, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: ProcessSet) -> Any:
        ctx.process_set = process_set
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _sum(grad.contiguous(), ctx.process_set), None


def gather(tensor: torch.Tensor, dim: int, process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's slice along ``dim`` (``shard`` sizes), concatenated; backward: own slice."""
    return _Gather.apply(tensor, dim, process_set)


def split(tensor: torch.Tensor, dim: int, process_set: ProcessSet = global_process_set) -> Any:
    """This rank's ``shard`` of ``tensor`` along ``dim``; backward: the slices' allgather."""
    return _Split.apply(tensor, dim, process_set)


def reduce_partial(tensor: torch.Tensor, process_set: ProcessSet = global_process_set) -> Any:
    """The sum of every rank's partial ``tensor``; backward: the identity."""
    return _ReducePartial.apply(tensor, process_set)


def reduce_grad(tensor: torch.Tensor, process_set: ProcessSet = global_process_set) -> Any:
    """``tensor`` unchanged; backward: its gradient summed over the ranks."""
    return _ReduceGrad.apply(tensor, process_set)


def halo_exchange(
    tensor: torch.Tensor, halo: int, dim: int = -1, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """``tensor`` extended along ``dim`` by ``halo`` slices of each neighbour's (rank - 1 on
    the low side, rank + 1 on the high side), zeros beyond the first and last rank; one
    differentiable alltoall (its backward sends the halos' gradients back)."""
    if halo <= 0:
        return tensor
    rank, size = process_set.rank(), process_set.size()
    rows = tensor.movedim(dim, 0)
    if rows.shape[0] < halo:
        raise ValueError(f"halo_exchange: halo {halo} wider than this rank's {rows.shape[0]}")
    low, high = rows[:halo], rows[-halo:]
    sends, splits = [], [0] * size
    if rank > 0:
        sends.append(low)
        splits[rank - 1] = halo
    if rank < size - 1:
        sends.append(high)
        splits[rank + 1] = halo
    zeros = rows.new_zeros((halo, *rows.shape[1:]))
    if sends:
        received, _ = functions.alltoall(
            torch.cat(sends).contiguous(), splits, process_set=process_set
        )
    else:
        received = rows[:0]
    before = received[:halo] if rank > 0 else zeros
    after = received[-halo:] if rank < size - 1 else zeros
    return torch.cat([before, rows, after]).movedim(0, dim)


def _check_conv(conv: nn.Conv2d, what: str) -> None:
    if conv.groups != 1 or conv.dilation != (1, 1) or isinstance(conv.padding, str):
        raise ValueError(f"{what}: only groups=1, dilation 1 and integer padding, got {conv!r}")


class FilterParallelConv2d(nn.Module):
    """``conv`` with its output channels divided among the ranks (this rank's copied)."""

    def __init__(self, conv: nn.Conv2d, process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        _check_conv(conv, "FilterParallelConv2d")
        self.process_set = process_set
        start, stop = shard(conv.out_channels, process_set.rank(), process_set.size())
        self.weight = nn.Parameter(conv.weight.detach()[start:stop].clone())
        self.bias = (
            nn.Parameter(conv.bias.detach()[start:stop].clone()) if conv.bias is not None else None
        )
        self.stride, self.padding = conv.stride, conv.padding

    def forward(self, x: torch.Tensor) -> Any:
        x = reduce_grad(x, self.process_set)
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding)
        return gather(y, 1, self.process_set)


class ChannelParallelConv2d(nn.Module):
    """``conv`` with its input channels divided among the ranks; the bias on rank 0."""

    def __init__(self, conv: nn.Conv2d, process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        _check_conv(conv, "ChannelParallelConv2d")
        self.process_set = process_set
        start, stop = shard(conv.in_channels, process_set.rank(), process_set.size())
        self.weight = nn.Parameter(conv.weight.detach()[:, start:stop].clone())
        keep_bias = conv.bias is not None and process_set.rank() == 0
        self.bias = nn.Parameter(conv.bias.detach().clone()) if keep_bias else None  # type: ignore[union-attr]
        self.stride, self.padding = conv.stride, conv.padding

    def forward(self, x: torch.Tensor) -> Any:
        x = split(x, 1, self.process_set)
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding)
        return reduce_partial(y, self.process_set)


class SpatialParallelConv2d(nn.Module):
    """``conv`` (stride 1, odd kernel) on this rank's columns of the width: a halo of
    (K - 1) // 2 columns from each neighbour replaces the padding along the width. Its weight
    gradients are this rank's part: sum them over the ranks (an allreduce with op=Sum)."""

    def __init__(self, conv: nn.Conv2d, process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        _check_conv(conv, "SpatialParallelConv2d")
        k = conv.kernel_size[1]
        if conv.stride != (1, 1) or k % 2 == 0 or conv.padding[1] != (k - 1) // 2:
            raise ValueError(
                f"SpatialParallelConv2d: stride 1, odd kernel, 'same' width, got {conv!r}"
            )
        self.process_set = process_set
        self.weight = nn.Parameter(conv.weight.detach().clone())
        self.bias = nn.Parameter(conv.bias.detach().clone()) if conv.bias is not None else None
        self.halo, self.padding_h = (k - 1) // 2, int(conv.padding[0])

    def forward(self, x: torch.Tensor) -> Any:
        x = halo_exchange(x, self.halo, -1, self.process_set)
        return F.conv2d(x, self.weight, self.bias, 1, (self.padding_h, 0))


def grid(model_ways: int) -> tuple[ProcessSet, ProcessSet]:
    """Hybrid parallelism's process sets, registered on every rank (collective, every rank calls
    it with the same ``model_ways``): groups of ``model_ways`` consecutive ranks (the model
    split inside one: filter or spatial) and, across the groups, the data-parallel sets of the
    ranks at the same place in their group. Returns (this rank's group, its data set)."""
    rank, size = runtime.rank(), runtime.size()
    if model_ways < 1 or size % model_ways:
        raise ValueError(
            f"rank {rank}: {size} ranks do not divide into groups of {model_ways} "
            "(model_ways must divide the number of ranks)"
        )
    groups = [list(range(g, g + model_ways)) for g in range(0, size, model_ways)]
    datas = [list(range(i, size, model_ways)) for i in range(model_ways)]
    registered = [ops.add_process_set(ranks) for ranks in groups + datas]
    mine = [ps for ps in registered if rank in ps.ranks]
    return mine[0], mine[1]


def _pair(process_set: ProcessSet, what: str) -> tuple[int, int]:
    if process_set.size() != 2 or not process_set.included():
        raise ValueError(
            f"{what}: needs a 2-rank process set this rank belongs to, got {process_set!r} "
            f"on rank {runtime.rank()}"
        )
    me = process_set.rank()
    return me, 1 - me


def send(tensor: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    """Send ``tensor`` (its rows, dim 0) to the other rank of the 2-rank ``process_set``, which
    calls ``recv``. Returns a 0-row tensor in the graph: calling backward on it (a zero
    gradient, ``backward_sent``) receives the gradient of ``tensor`` from the other rank and
    goes on into this rank's graph."""
    me, other = _pair(process_set, "send")
    splits = [0, 0]
    splits[other] = tensor.shape[0]
    out, _ = functions.alltoall(tensor.contiguous(), splits, process_set=process_set)
    return out  # type: ignore[no-any-return]


def recv(shape: tuple[int, ...], dtype: torch.dtype, process_set: ProcessSet) -> torch.Tensor:
    """What the other rank of the 2-rank ``process_set`` sends (``shape``: its shape, rows
    first); requires grad: this rank's backward through it sends the gradient back."""
    _pair(process_set, "recv")
    nothing = torch.zeros((0, *shape[1:]), dtype=dtype, requires_grad=True)
    out, received = functions.alltoall(nothing, [0, 0], process_set=process_set)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(
            f"recv on rank {runtime.rank()}: expected {tuple(shape)}, the other rank sent "
            f"{tuple(out.shape)}"
        )
    return out  # type: ignore[no-any-return]


def backward_sent(token: torch.Tensor) -> None:
    """Backward from ``send``'s result: the gradient of what was sent comes back from the
    receiver, then flows through this rank's graph."""
    torch.autograd.backward(token, token.new_zeros(token.shape))
