"""allgather (issue #2) under real MPI: every dtype, a first dimension that differs per rank
(zero rows included), trailing dimensions, and the async form, against the concatenation of
every rank's regenerated input.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

import pytest
import torch
from collective_reference import ALL_DTYPES, dtype_id, seed_of, small_ints

import commlayer as cl


def _rows(rank: int) -> int:
    """Rows rank ``rank`` contributes: 1, 2, 0, 1, ... (rank 2 sends nothing; rank 0 always
    sends something, so a 1-rank run gathers a non-empty tensor)."""
    return (rank + 1) % 3


def _every_rank(name: str, rest: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    return [small_ints(seed_of(name), r, (_rows(r), *rest), dtype) for r in range(cl.size())]


def _assert_gathered(result: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    expected = torch.cat(inputs)
    assert result.dtype == expected.dtype, f"rank {cl.rank()}: dtype {result.dtype}"
    assert result.shape == expected.shape, f"rank {cl.rank()}: shape {tuple(result.shape)}"
    assert torch.equal(result, expected), f"rank {cl.rank()}: got {result.tolist()}"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_first_dimension_differs_per_rank(dtype: torch.dtype) -> None:
    name = f"allgather.dtype.{dtype_id(dtype)}"
    inputs = _every_rank(name, (2, 3), dtype)
    result = cl.allgather(inputs[cl.rank()], name=name)
    _assert_gathered(result, inputs)


@pytest.mark.parametrize("rest", [(), (1,), (3, 1, 2)], ids=["1d", "2d", "4d"])
def test_trailing_dimensions(rest: tuple[int, ...]) -> None:
    name = f"allgather.rest.{rest}"
    inputs = _every_rank(name, rest, torch.int64)
    result = cl.allgather(inputs[cl.rank()], name=name)
    _assert_gathered(result, inputs)


def test_async_form_and_non_contiguous_input() -> None:
    name = "allgather.async"
    inputs = _every_rank(name, (4,), torch.float32)
    mine = inputs[cl.rank()].t().contiguous().t()  # non-contiguous when it has 2+ rows
    handle = cl.allgather_async(mine, name=name)
    result = cl.synchronize(handle)
    _assert_gathered(result, inputs)
    assert cl.poll(handle) is True


def test_every_rank_sends_zero_rows() -> None:
    result = cl.allgather(torch.empty(0, 5, dtype=torch.float16), name="allgather.none")
    assert result.shape == (0, 5) and result.dtype == torch.float16


def test_same_name_again_with_other_row_counts() -> None:
    # Steady state: the second call hits the response cache although row counts changed.
    first = _every_rank("allgather.again.0", (2,), torch.int32)
    again = [t.repeat(2, 1) for t in _every_rank("allgather.again.1", (2,), torch.int32)]
    results = [cl.allgather(inputs[cl.rank()], name="allgather.again") for inputs in (first, again)]
    _assert_gathered(results[0], first)
    _assert_gathered(results[1], again)
