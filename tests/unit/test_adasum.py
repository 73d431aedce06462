"""Adasum's combination (algorithms/adasum.py): orthogonal gradients add, equal ones average,
a zero one leaves the other, and ranks pair in Horovod's tree; it is the registry's combine
algorithm of ``ReduceOp.Adasum``."""

from __future__ import annotations

import pytest
import torch

from commlayer import algorithms, cli
from commlayer.algorithms import adasum
from commlayer.common.reduce_ops import ReduceOp


def test_pair_adds_orthogonal_and_averages_equal_vectors() -> None:
    a = torch.tensor([3.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.0, 4.0], dtype=torch.float64)
    assert torch.equal(adasum.pair(a, b), a + b)
    assert torch.equal(adasum.pair(a, a.clone()), a)
    assert torch.equal(adasum.pair(a, torch.zeros(2, dtype=torch.float64)), a)


def test_pair_matches_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(50, generator=g, dtype=torch.float64),
        torch.randn(50, generator=g, dtype=torch.float64),
    )
    dot = a @ b
    want = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    torch.testing.assert_close(adasum.pair(a, b), want, rtol=1e-12, atol=0)


def test_combine_pairs_neighbours_then_pairs_of_pairs() -> None:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 3, 4, generator=g)
    v = [r.double().reshape(-1) for r in rows]
    # 5 ranks: (0,1) (2,3) 4 alone, then (01, 23), 4 still alone, then (0123, 4)
    want = adasum.pair(adasum.pair(adasum.pair(v[0], v[1]), adasum.pair(v[2], v[3])), v[4])
    got = adasum.combine(rows)
    assert got.dtype == rows.dtype and got.shape == (12,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(adasum.combine(rows[:1]), rows[0].reshape(-1))


def test_adasum_is_the_registered_combine_of_its_operator() -> None:
    """Registered where the other algorithms are (issue 49, item 5), as a combine: reached by
    ``op=Adasum``, not a choice for COMMLAYER_ALLREDUCE_ALGORITHM, nor a name another kind of
    algorithm may take."""
    found = algorithms.combining(ReduceOp.Adasum)
    assert found is not None and found.name == "adasum" and found.combine is adasum.combine
    assert found.moves == "allgather" and found.floating_only
    assert algorithms.kinds()["adasum"] == "combine"
    assert algorithms.kinds()["ring"] == "schedule" and algorithms.kinds()["auto"] == "selection"
    assert "adasum" not in algorithms.available()
    assert algorithms.combining(ReduceOp.Sum) is None
    assert ReduceOp.Adasum in algorithms.combining_ops()
    with pytest.raises(ValueError, match="combine algorithm named 'adasum'"):
        algorithms.register("adasum")(lambda *args: [])
    with pytest.raises(ValueError, match="Adasum already has"):
        algorithms.register_combine("adasum2", ReduceOp.Adasum)
    with pytest.raises(ValueError, match="schedule algorithm named 'ring'"):
        algorithms.register_combine("ring", ReduceOp.Max)(adasum.combine)


def test_commlayer_algorithms_lists_every_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["algorithms", "--list"]) == 0
    lines = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert lines["adasum"] == "combine" and lines["ring"] == "schedule"
    assert lines["native"] == "native" and lines["dsar"] == "sparse"
