"""Model parallelism's differentiable operations (commlayer/model_parallel.py): a filter-,
channel- and spatial-parallel convolution give the single-process layer's output and
gradients (input and weights) at any number of ranks. Every rank builds the same full layer
and input from one seed and computes the single-process reference itself; float64, so only
summation order separates them. Collectives first, asserts last.

The hybrids (data+filter, data+spatial) need the ranks to factor into groups of 2: at 1 and 3
ranks those cases skip (every rank alike); groups of 1 (data alone across) and of all ranks run
at every size. The pipeline's send and recv run between neighbouring ranks at 2-4 ranks, and
examples/model_parallel_cnn.py's training (its ``train``, in these processes) is checked
against one process for each strategy that applies at this size."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import pytest
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


def _factor_or_skip(model_ways: int) -> None:
    if cl.size() % model_ways:
        pytest.skip(f"{cl.size()} ranks do not factor into groups of {model_ways}")


@pytest.mark.parametrize("ways", [1, 2, "all"])
def test_grid_sets(ways: int | str) -> None:
    size, rank = cl.size(), cl.rank()
    model_ways = size if ways == "all" else int(ways)
    _factor_or_skip(model_ways)
    group, data = mp.grid(model_ways)
    first = rank - rank % model_ways
    assert group.ranks == list(range(first, first + model_ways))
    assert data.ranks == list(range(rank % model_ways, size, model_ways))
    assert group.rank() == rank % model_ways and data.rank() == rank // model_ways


def test_grid_refuses_a_bad_factor() -> None:
    with pytest.raises(ValueError, match=f"rank {cl.rank()}: {cl.size()} ranks do not divide"):
        mp.grid(cl.size() + 1)


@pytest.mark.parametrize("split", ["filter", "spatial"])
def test_hybrid_conv(split: str) -> None:
    """A layer split in a group of 2 and the batch among the groups: outputs, input gradients
    and (summed over the data set; spatial: over the group too) weight gradients as one
    process's on the whole batch."""
    _factor_or_skip(2)
    size = cl.size()
    group, data = mp.grid(2)
    torch.manual_seed(23)
    conv = nn.Conv2d(3, 4, 3, padding=1).to(F64)
    x = torch.randn(size, 3, 5, 6, dtype=F64)  # a sample per rank: size / 2 per group
    w = torch.randn(size, 4, 5, 6, dtype=F64)
    y_ref, dx_ref = _grads(conv, x, w)
    rows = slice(*mp.shard(size, data.rank(), data.size()))
    cols = slice(*mp.shard(6, group.rank(), 2)) if split == "spatial" else slice(None)
    if split == "filter":
        layer: nn.Module = mp.FilterParallelConv2d(conv, group)
    else:
        layer = mp.SpatialParallelConv2d(conv, group)
    y, dx = _grads(layer, x[rows][..., cols], w[rows][..., cols])
    grad = layer.weight.grad
    assert grad is not None and conv.weight.grad is not None
    if split == "spatial":
        grad = cl.allreduce(grad, op=cl.Sum, process_set=group)
    grad = cl.allreduce(grad, op=cl.Sum, process_set=data)
    start, stop = mp.shard(4, group.rank(), 2) if split == "filter" else (0, 4)
    torch.testing.assert_close(y, y_ref[rows][..., cols], **CLOSE)
    torch.testing.assert_close(dx, dx_ref[rows][..., cols], **CLOSE)
    torch.testing.assert_close(grad, conv.weight.grad[start:stop], **CLOSE)


def test_send_recv_chain() -> None:
    """x through every rank in turn, rank k multiplying by k + 2 (send and recv between
    neighbours), the last summing x * weight: each rank's output and the first rank's input
    gradient as computed by hand."""
    size, rank = cl.size(), cl.rank()
    if size < 2:
        pytest.skip("send and recv need 2 ranks")
    pairs = [cl.add_process_set([k, k + 1]) for k in range(size - 1)]
    x0 = torch.arange(6, dtype=F64).reshape(3, 2)
    weight = torch.linspace(-1.0, 1.0, 6, dtype=F64).reshape(3, 2)
    x = x0.clone().requires_grad_() if rank == 0 else mp.recv((3, 2), F64, pairs[rank - 1])
    y = x * (rank + 2)
    if rank < size - 1:
        token = mp.send(y, pairs[rank])
        assert token.shape == (0, 2)
        mp.backward_sent(token)
    else:
        (y * weight).sum().backward()
    factor = 1.0
    for k in range(rank + 1):
        factor *= k + 2
    torch.testing.assert_close(y.detach(), x0 * factor, **CLOSE)
    if rank == 0:
        total = 1.0
        for k in range(size):
            total *= k + 2
        assert x.grad is not None
        torch.testing.assert_close(x.grad, weight * total, **CLOSE)


def test_recv_refuses_a_wrong_set() -> None:
    with pytest.raises(ValueError, match="recv: needs a 2-rank process set"):
        mp.recv((1, 2), F64, cl.global_process_set if cl.size() != 2 else _singleton())


def _singleton() -> cl.ProcessSet:
    return cl.add_process_set([0])


_EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _example() -> Any:
    sys.path.insert(0, os.path.abspath(_EXAMPLES))
    try:
        import model_parallel_cnn
    finally:
        sys.path.pop(0)
    return model_parallel_cnn


@pytest.mark.parametrize(
    ("strategy", "model_ways", "micro", "cuts"),
    [
        ("data+filter", 2, 1, None),
        ("data+spatial", 2, 1, None),
        ("data+filter", 1, 1, None),
        ("data+spatial", "all", 1, None),
        ("pipeline", 1, 1, None),
        ("pipeline", 1, 3, None),
        ("pipeline", 1, 8, None),
        ("pipeline", 1, 5, "2"),  # 2 ranks only: [conv1, conv2], [fc]
    ],
)
def test_example_matches_one_process(
    strategy: str, model_ways: int | str, micro: int, cuts: str | None
) -> None:
    """examples/model_parallel_cnn.py's training, 3 steps of SGD in float64: the losses as one
    process's at every step (its ``--check``, rank 0's worst difference sent to all)."""
    example = _example()
    size = cl.size()
    ways = size if model_ways == "all" else int(model_ways)
    args = argparse.Namespace(
        strategy=strategy, model_ways=ways, micro_batches=micro, cuts=cuts, channels=4,
        size=6, batch=12, steps=3, warmup=0, check=True, dtype="float64",
    )  # fmt: skip
    problem = example.arguments_problem(args, size)
    if problem:
        pytest.skip(f"at {size} ranks: {problem}")
    result = example.train(args)
    worst = cl.broadcast(torch.tensor(result.get("max_loss_diff", 0.0), dtype=F64), 0)
    assert float(worst) < 1e-9
