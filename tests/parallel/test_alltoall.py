"""alltoall (issue #2) under real MPI: equal blocks without splits, explicit splits with zero
splits (and a rank that sends nothing at all), splits given as a tensor, every dtype, and the
async form. Each rank regenerates every rank's input and splits, so it knows what it must
receive from whom.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from collective_reference import ALL_DTYPES, dtype_id, seed_of, small_ints

import commlayer as cl

# splits(sender, receiver): rows sender sends to receiver.
SPLITS: dict[str, Callable[[int, int], int]] = {
    # 0, 1 or 2 rows: zero splits between some pairs, a rank may send itself nothing.
    "mixed": lambda q, r: (q + 2 * r) % 3,
    # rank 0 sends no rows at all (a zero-row input), the others send 1 to 2 rows to everyone.
    "rank0_sends_nothing": lambda q, r: 0 if q == 0 else 1 + (q + r) % 2,
}


def _splits(pattern: str, sender: int) -> list[int]:
    return [SPLITS[pattern](sender, r) for r in range(cl.size())]


def _inputs(
    name: str, pattern: str, rest: tuple[int, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    return [
        small_ints(seed_of(name), q, (sum(_splits(pattern, q)), *rest), dtype)
        for q in range(cl.size())
    ]


def _expected(inputs: list[torch.Tensor], pattern: str) -> tuple[torch.Tensor, list[int]]:
    """(what this rank receives, rows from each sender)."""
    me = cl.rank()
    pieces, rows = [], []
    for q, tensor in enumerate(inputs):
        splits = _splits(pattern, q)
        start = sum(splits[:me])
        pieces.append(tensor[start : start + splits[me]])
        rows.append(splits[me])
    return torch.cat(pieces), rows


def _assert_received(
    output: torch.Tensor, received: torch.Tensor, inputs: list[torch.Tensor], pattern: str
) -> None:
    expected, rows = _expected(inputs, pattern)
    assert received.tolist() == rows, f"rank {cl.rank()}: received splits {received.tolist()}"
    assert output.dtype == expected.dtype and output.shape == expected.shape, (
        f"rank {cl.rank()}: {output.dtype} {tuple(output.shape)}"
    )
    assert torch.equal(output, expected), f"rank {cl.rank()}: got {output.tolist()}"


@pytest.mark.parametrize("pattern", sorted(SPLITS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_with_splits(dtype: torch.dtype, pattern: str) -> None:
    name = f"alltoall.splits.{dtype_id(dtype)}.{pattern}"
    inputs = _inputs(name, pattern, (2,), dtype)
    output, received = cl.alltoall(inputs[cl.rank()], splits=_splits(pattern, cl.rank()), name=name)
    _assert_received(output, received, inputs, pattern)


@pytest.mark.parametrize("rest", [(), (2, 3)], ids=["1d", "3d"])
def test_without_splits_sends_equal_blocks(rest: tuple[int, ...]) -> None:
    name = f"alltoall.equal.{rest}"
    inputs = [
        small_ints(seed_of(name), q, (2 * cl.size(), *rest), torch.int64) for q in range(cl.size())
    ]
    output = cl.alltoall(inputs[cl.rank()], name=name)
    me = cl.rank()
    expected = torch.cat([t[2 * me : 2 * me + 2] for t in inputs])
    assert isinstance(output, torch.Tensor), f"without splits alltoall returned {type(output)}"
    assert output.shape == expected.shape and torch.equal(output, expected)


def test_splits_as_tensor_and_async_form() -> None:
    name = "alltoall.async"
    inputs = _inputs(name, "mixed", (3,), torch.float32)
    splits = torch.tensor(_splits("mixed", cl.rank()), dtype=torch.int32)
    handle = cl.alltoall_async(inputs[cl.rank()], splits=splits, name=name)
    output, received = cl.synchronize(handle)
    _assert_received(output, received, inputs, "mixed")
    assert cl.poll(handle) is True
