"""Gradients of the blocking collectives (issue #2; Horovod's conventions since issue 20): each
is a torch.autograd.Function whose backward is horovod.torch's.

Every rank r computes ``loss_r = (output_r * weight_r).sum()`` with its own seeded weight and
calls backward. The gradient with respect to rank r's input is known in closed form from every
rank's regenerated weight: allreduce -> the same allreduce of the weights; allgather -> rank
r's rows of the weights averaged over ranks; broadcast -> the averaged weights on the root,
zeros elsewhere; alltoall -> the weights sent back; reducescatter -> the allgather, times
size() for Sum (Horovod's factors: its test_torch.py checks them). Everything is float64, so
only summation order separates result and reference.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from collective_reference import block_rows, random_floats, seed_of

import commlayer as cl

F64 = torch.float64
Shape = tuple[int, ...]
CLOSE = {"rtol": 1e-12, "atol": 1e-12}


def _every_rank(name: str, shape: Shape | Callable[[int], Shape]) -> list[torch.Tensor]:
    """Seeded float64 tensor of every rank; ``shape``: one shape, or rank -> shape."""
    shape_of = shape if callable(shape) else (lambda _: shape)
    return [random_floats(seed_of(name), r, shape_of(r), F64) for r in range(cl.size())]


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().requires_grad_()


def _backward(output: torch.Tensor, weight: torch.Tensor) -> None:
    (output * weight).sum().backward()


@pytest.mark.parametrize("op", [cl.Sum, cl.Average], ids=lambda op: op.name)
def test_allreduce_gradient_is_an_allreduce(op: cl.ReduceOp) -> None:
    name = f"autograd.allreduce.{op.name}"
    inputs, weights = _every_rank(name, (2, 3)), _every_rank(f"{name}.w", (2, 3))
    x = _leaf(inputs[cl.rank()])
    y = cl.allreduce(x, op=op, prescale_factor=0.5, postscale_factor=3.0, name=name)
    _backward(y, weights[cl.rank()])
    factor = 1.5 / (cl.size() if op == cl.Average else 1)
    torch.testing.assert_close(y.detach(), factor * sum(inputs), **CLOSE)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, factor * sum(weights), **CLOSE)


def test_grouped_allreduce_gradients() -> None:
    name = "autograd.grouped"
    shapes = [(3,), (2, 2)]
    inputs = [_every_rank(f"{name}.{i}", s) for i, s in enumerate(shapes)]
    weights = [_every_rank(f"{name}.{i}.w", s) for i, s in enumerate(shapes)]
    xs = [_leaf(per_rank[cl.rank()]) for per_rank in inputs]
    ys = cl.grouped_allreduce(xs, op=cl.Sum, name=name)
    sum((y * w[cl.rank()]).sum() for y, w in zip(ys, weights)).backward()
    for x, w in zip(xs, weights):
        assert x.grad is not None
        torch.testing.assert_close(x.grad, sum(w), **CLOSE)


def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient() -> None:
    name = "autograd.allgather"
    inputs = _every_rank(name, lambda r: (r + 1, 2))
    total = sum(r + 1 for r in range(cl.size()))
    weights = _every_rank(f"{name}.w", (total, 2))
    x = _leaf(inputs[cl.rank()])
    y = cl.allgather(x, name=name)
    _backward(y, weights[cl.rank()])
    start = sum(r + 1 for r in range(cl.rank()))
    torch.testing.assert_close(y.detach(), torch.cat(inputs), **CLOSE)
    assert x.grad is not None
    averaged = sum(weights) / cl.size()
    torch.testing.assert_close(x.grad, averaged[start : start + cl.rank() + 1], **CLOSE)


def test_broadcast_gradient_is_averaged_onto_the_root() -> None:
    name = "autograd.broadcast"
    inputs, weights = _every_rank(name, (4,)), _every_rank(f"{name}.w", (4,))
    grads = []
    for root in range(cl.size()):
        x = _leaf(inputs[cl.rank()])
        _backward(cl.broadcast(x, root, name=f"{name}.{root}"), weights[cl.rank()])
        grads.append(x.grad)
    for root, grad in enumerate(grads):
        expected = sum(weights) / cl.size() if root == cl.rank() else torch.zeros(4, dtype=F64)
        assert grad is not None
        torch.testing.assert_close(grad, expected, **CLOSE)


def test_alltoall_gradient_is_the_reverse_alltoall() -> None:
    name = "autograd.alltoall"
    n, me = cl.size(), cl.rank()

    def splits(q: int) -> list[int]:
        return [(q + 2 * r) % 3 for r in range(n)]

    inputs = _every_rank(name, lambda q: (sum(splits(q)), 2))
    received = [[splits(q)[r] for q in range(n)] for r in range(n)]
    weights = _every_rank(f"{name}.w", lambda r: (sum(received[r]), 2))
    x = _leaf(inputs[me])
    output, _ = cl.alltoall(x, splits=splits(me), name=name)
    _backward(output, weights[me])
    # Rows of x that went to rank r come back as the rows of weights[r] received from me.
    expected = torch.cat([weights[r][sum(received[r][:me]) :][: splits(me)[r]] for r in range(n)])
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected, **CLOSE)


@pytest.mark.parametrize("op", [cl.Sum, cl.Average], ids=lambda op: op.name)
def test_reducescatter_gradient_is_an_allgather(op: cl.ReduceOp) -> None:
    name = f"autograd.reducescatter.{op.name}"
    rows = block_rows(2 * cl.size() + 1, cl.size())
    inputs = _every_rank(name, (sum(rows), 2))
    weights = _every_rank(f"{name}.w", lambda r: (rows[r], 2))
    x = _leaf(inputs[cl.rank()])
    y = cl.reducescatter(x, op=op, name=name, prescale_factor=0.5, postscale_factor=3.0)
    _backward(y, weights[cl.rank()])
    factor = 1.5 * (cl.size() if op == cl.Sum else 1)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, factor * torch.cat(weights), **CLOSE)


def test_grouped_allgather_and_reducescatter_gradients_follow_the_single_forms() -> None:
    name = "autograd.grouped_ag_rs"
    n, me = cl.size(), cl.rank()
    rows = block_rows(2 * n + 1, n)
    gathered_in = _every_rank(f"{name}.g", lambda r: (r + 1, 2))
    total = sum(r + 1 for r in range(n))
    gathered_w = _every_rank(f"{name}.gw", (total, 2))
    scattered_in = _every_rank(f"{name}.s", (sum(rows), 3))
    scattered_w = _every_rank(f"{name}.sw", lambda r: (rows[r], 3))
    g, s = _leaf(gathered_in[me]), _leaf(scattered_in[me])
    (yg,) = cl.grouped_allgather([g], name=f"{name}.ag")
    (ys,) = cl.grouped_reducescatter([s], op=cl.Sum, name=f"{name}.rs")
    ((yg * gathered_w[me]).sum() + (ys * scattered_w[me]).sum()).backward()
    start = sum(r + 1 for r in range(me))
    assert g.grad is not None and s.grad is not None
    torch.testing.assert_close(g.grad, (sum(gathered_w) / n)[start : start + me + 1], **CLOSE)
    torch.testing.assert_close(s.grad, n * torch.cat(scattered_w), **CLOSE)
