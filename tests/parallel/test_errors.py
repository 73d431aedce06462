"""Bad input is refused on the user thread (issue #2): a ValueError (DuplicateNameError for a
name already in flight) raised by the call itself, before anything is communicated, and the
engine keeps working afterwards.

Only errors each rank decides alone are here; mismatches across ranks, stalls and dead ranks
are tests/system's. Every rank makes the same bad calls, so the per-process counters that name
unnamed operations stay in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import commlayer as cl


def _x() -> torch.Tensor:
    return torch.ones(2 * cl.size(), 3)


# name -> (call that must raise ValueError, regex the message must match)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "complex_allreduce": (lambda: cl.allreduce(_x().to(torch.complex64)), "complex64"),
    "complex_allreduce_async_": (
        lambda: cl.allreduce_async_(_x().to(torch.complex64)),
        "complex64",
    ),
    "complex_grouped": (
        lambda: cl.grouped_allreduce([_x(), _x().to(torch.complex64)]),
        "complex64",
    ),
    "complex_allgather": (lambda: cl.allgather(_x().to(torch.complex64)), "complex64"),
    "complex_broadcast": (lambda: cl.broadcast_(_x().to(torch.complex128), 0), "complex128"),
    "complex_alltoall": (lambda: cl.alltoall(_x().to(torch.complex64)), "complex64"),
    "complex_reducescatter": (lambda: cl.reducescatter(_x().to(torch.complex64)), "complex64"),
    "list_allreduce": (lambda: cl.allreduce([1.0, 2.0]), "Tensor"),
    "none_allgather": (lambda: cl.allgather(None), "Tensor"),
    "numpy_broadcast": (lambda: cl.broadcast(_x().numpy(), 0), "Tensor"),
    "sparse_allreduce": (lambda: cl.allreduce(_x().to_sparse()), "sparse"),
    "adasum_reducescatter": (lambda: cl.reducescatter(_x(), op=cl.Adasum), "Adasum"),
    "adasum_integers": (
        lambda: cl.allreduce_async(_x().long(), op=cl.Adasum),
        "Adasum needs floating-point tensors, got int64",
    ),
    "adasum_optimizer": (
        lambda: cl.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(_x())], lr=0.1), op=cl.Adasum
        ),
        "Adasum",
    ),
    "op_and_average": (lambda: cl.allreduce(_x(), average=True, op=cl.Sum), "average"),
    "scalar_allgather": (lambda: cl.allgather(torch.tensor(1.0)), "dimension"),
    "scalar_alltoall": (lambda: cl.alltoall(torch.tensor(1.0)), "dimension"),
    "scalar_reducescatter": (lambda: cl.reducescatter(torch.tensor(1.0)), "dimension"),
    "root_too_large": (lambda: cl.broadcast(_x(), cl.size()), "root_rank"),
    "root_negative": (lambda: cl.broadcast_async_(_x(), -1), "root_rank"),
    "splits_too_few": (lambda: cl.alltoall(_x(), splits=[2] * (cl.size() - 1)), "splits"),
    "splits_negative": (
        lambda: cl.alltoall(_x(), splits=[-1] + [0] * (cl.size() - 2) + [2 * cl.size() + 1]),
        "splits",
    ),
    "splits_wrong_sum": (lambda: cl.alltoall(_x(), splits=[1] * cl.size()), "splits"),
    "grouped_empty": (lambda: cl.grouped_allreduce([]), "at least one"),
    "grouped_mixed_dtypes": (
        lambda: cl.grouped_allreduce_([_x(), _x().double()]),
        "dtype",
    ),
    "synchronize_non_handle": (lambda: cl.synchronize(_x()), "Handle"),
    "empty_name": (lambda: cl.allreduce(_x(), name=""), "name"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_value_error(case: str) -> None:
    call, match = CASES[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_alltoall_without_splits_needs_divisible_first_dimension() -> None:
    if cl.size() == 1:
        pytest.skip("every first dimension is divisible by 1 rank")
    with pytest.raises(ValueError, match="divisible"):
        cl.alltoall(torch.ones(cl.size() + 1, 2))


def _lacking_rank() -> list[str]:
    """Cases whose message does not name this rank."""
    lacking = []
    for case, (call, _) in sorted(CASES.items()):
        try:
            call()
        except ValueError as exc:
            if f"rank {cl.rank()}" not in str(exc):
                lacking.append(case)
    return lacking


def test_every_input_error_names_the_rank() -> None:
    lacking = _lacking_rank()
    assert not lacking, f"rank {cl.rank()}: messages without the rank: {lacking}"


def test_name_already_in_flight_raises_duplicate_name_error() -> None:
    """The first operation must still be in flight when the second is submitted. At 2+ ranks
    that is certain: the ranks that submit late do so only after a barrier the early ones pass
    after their second submit. Each rank is early once."""
    n = cl.size()
    if n == 1:
        raised, results = _duplicate_alone()
    else:
        raised, results = [], []
        for early_ranks in ({0}, set(range(1, n))):
            name = f"errors.duplicate.{min(early_ranks)}"
            early = cl.rank() in early_ranks
            x = torch.full((3,), float(cl.rank()))
            if early:
                handle = cl.allreduce_async(x, op=cl.Sum, name=name)
                raised.append(_submit_again(name))
            cl.barrier()
            if not early:
                handle = cl.allreduce_async(x, op=cl.Sum, name=name)
            results.append(cl.synchronize(handle))
    expected = torch.full((3,), float(sum(range(n))))
    assert all(torch.equal(result, expected) for result in results), results
    assert raised and all(isinstance(exc, cl.DuplicateNameError) for exc in raised), raised
    assert all("in flight" in str(exc) and f"rank {cl.rank()}" in str(exc) for exc in raised)


def _submit_again(name: str) -> Exception | None:
    """Submit ``name`` a second time; the error it raised (None if it was accepted, which is
    then left unsynchronized: waiting on it could hang the ranks)."""
    try:
        cl.allreduce_async(torch.zeros(3), op=cl.Sum, name=name)
    except ValueError as exc:
        return exc
    return None


def _duplicate_alone() -> tuple[list[Exception | None], list[torch.Tensor]]:
    """1 rank: nothing holds the first operation back, so retry until the second submit wins
    the race against the engine (a 4 MiB first tensor makes that nearly certain at once)."""
    for attempt in range(20):
        name = f"errors.duplicate.alone.{attempt}"
        big = torch.zeros(1 << 20)
        handle = cl.allreduce_async(big, op=cl.Sum, name=name)
        again = _submit_again(name)
        result = cl.synchronize(handle)[:3]
        if again is not None:
            return [again], [result]
    return [], []


def test_engine_still_works_after_refused_calls() -> None:
    for call, _ in CASES.values():
        with pytest.raises(ValueError):
            call()
    result = cl.allreduce(torch.ones(3), op=cl.Sum)
    assert torch.equal(result, torch.full((3,), float(cl.size())))
