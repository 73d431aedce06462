"""reducescatter (issue #2) under real MPI: every op, every dtype, first dimensions not divisible
by the number of ranks (the first d % n ranks get one extra row; fewer rows than ranks leaves
some ranks none), prescale/postscale, the default op (Average) and the async form.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from collective_reference import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    OPS,
    assert_within,
    block_rows,
    dtype_id,
    every_rank_small_ints,
    reduce_reference,
    seed_of,
)

import commlayer as cl

# First dimension as a function of the number of ranks.
DIM0: dict[str, Callable[[int], int]] = {
    "divisible": lambda n: 2 * n,
    "one_extra": lambda n: 2 * n + 1,
    "all_but_one_extra": lambda n: 3 * n - 1,
    "one_row": lambda n: 1,
}


def _assert_block(
    result: torch.Tensor,
    inputs: list[torch.Tensor],
    op: cl.ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> None:
    """result is this rank's block of dim 0 of the full reduction of inputs."""
    expected, bound = reduce_reference(inputs, op, prescale, postscale)
    rows = block_rows(inputs[0].shape[0], cl.size())
    start = sum(rows[: cl.rank()])
    block = slice(start, start + rows[cl.rank()])
    assert_within(result, expected[block], bound[block] if bound.dim() else bound, inputs[0].dtype)


@pytest.mark.parametrize("dim0", sorted(DIM0))
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_uneven_first_dimension_every_op(op: cl.ReduceOp, dim0: str) -> None:
    name = f"reducescatter.{op.name}.{dim0}"
    shape = (DIM0[dim0](cl.size()), 3)
    inputs = every_rank_small_ints(seed_of(name), shape, torch.float32, nonzero=op == cl.Product)
    result = cl.reducescatter(inputs[cl.rank()], op=op, name=name)
    _assert_block(result, inputs, op)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_every_dtype(dtype: torch.dtype) -> None:
    # Sum on bool is logical or; Max would be the same. Product exercises 16-bit float ops.
    op = cl.Product if dtype.is_floating_point else cl.Sum
    name = f"reducescatter.dtype.{dtype_id(dtype)}"
    inputs = every_rank_small_ints(
        seed_of(name), (2 * cl.size() + 1, 2), dtype, nonzero=op == cl.Product
    )
    result = cl.reducescatter(inputs[cl.rank()], op=op, name=name)
    _assert_block(result, inputs, op)


@pytest.mark.parametrize("op", [cl.Sum, cl.Average], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_prescale_postscale(dtype: torch.dtype, op: cl.ReduceOp) -> None:
    name = f"reducescatter.scale.{dtype_id(dtype)}.{op.name}"
    inputs = every_rank_small_ints(seed_of(name), (cl.size() + 1, 2), dtype)
    result = cl.reducescatter(
        inputs[cl.rank()], op=op, prescale_factor=0.3, postscale_factor=1.7, name=name
    )
    _assert_block(result, inputs, op, prescale=0.3, postscale=1.7)


def test_default_op_is_average_and_async_form() -> None:
    name = "reducescatter.default"
    inputs = every_rank_small_ints(seed_of(name), (cl.size() + 2, 2, 2), torch.float64)
    blocking = cl.reducescatter(inputs[cl.rank()], name=f"{name}.blocking")
    handle = cl.reducescatter_async(inputs[cl.rank()], name=f"{name}.async")
    asynchronous = cl.synchronize(handle)
    _assert_block(blocking, inputs, cl.Average)
    _assert_block(asynchronous, inputs, cl.Average)
    assert cl.poll(handle) is True
