"""Model parallelism's differentiable operations (commlayer/model_parallel.py): a filter-,
channel- and spatial-parallel convolution give the single-process layer's output and
gradients (input and weights) at any number of ranks. Every rank builds the same full layer
and input from one seed and computes the single-process reference itself; float64, so only
summation order separates them. Collectives first, asserts last."""

from __future__ import annotations

import torch
from torch import nn

import commlayer as cl
from commlayer import model_parallel as mp

F64 = torch.float64
CLOSE = {"rtol": 1e-10, "atol": 1e-10}


def _reference(
    in_channels: int, out_channels: int, width: int
) -> tuple[nn.Conv2d, torch.Tensor, torch.Tensor]:
    torch.manual_seed(23)
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1).to(F64)
    x = torch.randn(2, in_channels, 5, width, dtype=F64)
    weight = torch.randn(2, out_channels, 5, width, dtype=F64)  # loss = (y * weight).sum()
    return conv, x, weight


def _grads(conv: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = conv(x)
    (y * weight).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad


def test_filter_parallel_conv() -> None:
    size, rank = cl.size(), cl.rank()
    conv, x, w = _reference(3, 4 * size, 6)
    y_ref, dx_ref = _grads(conv, x, w)
    layer = mp.FilterParallelConv2d(conv)
    y, dx = _grads(layer, x, w)
    start, stop = mp.shard(4 * size, rank, size)
    assert conv.weight.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(y, y_ref, **CLOSE)
    torch.testing.assert_close(dx, dx_ref, **CLOSE)
    torch.testing.assert_close(layer.weight.grad, conv.weight.grad[start:stop], **CLOSE)


def test_channel_parallel_conv() -> None:
    size, rank = cl.size(), cl.rank()
    conv, x, w = _reference(2 * size + 1, 3, 6)  # channels not divisible: uneven shards
    y_ref, dx_ref = _grads(conv, x, w)
    layer = mp.ChannelParallelConv2d(conv)
    y, dx = _grads(layer, x, w)
    start, stop = mp.shard(2 * size + 1, rank, size)
    assert conv.weight.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(y, y_ref, **CLOSE)
    torch.testing.assert_close(dx, dx_ref, **CLOSE)
    torch.testing.assert_close(layer.weight.grad, conv.weight.grad[:, start:stop], **CLOSE)


def test_spatial_parallel_conv() -> None:
    size, rank = cl.size(), cl.rank()
    conv, x, w = _reference(3, 4, 3 * size)
    y_ref, dx_ref = _grads(conv, x, w)
    start, stop = mp.shard(3 * size, rank, size)
    layer = mp.SpatialParallelConv2d(conv)
    y, dx = _grads(layer, x[..., start:stop], w[..., start:stop])
    assert layer.weight.grad is not None and conv.weight.grad is not None
    weight_grad = cl.allreduce(layer.weight.grad, op=cl.Sum)  # each rank's part of it
    full = mp.gather(y, -1)  # what the layers after the split would read
    torch.testing.assert_close(y, y_ref[..., start:stop], **CLOSE)
    torch.testing.assert_close(dx, dx_ref[..., start:stop], **CLOSE)
    torch.testing.assert_close(weight_grad, conv.weight.grad, **CLOSE)
    torch.testing.assert_close(full, y_ref, **CLOSE)


def test_halo_exchange_values() -> None:
    size, rank = cl.size(), cl.rank()
    local = torch.full((1, 2), float(rank), dtype=F64)
    got = mp.halo_exchange(local, 1)
    low = float(rank - 1) if rank > 0 else 0.0
    high = float(rank + 1) if rank < size - 1 else 0.0
    assert got.tolist() == [[low, rank, rank, high]]
