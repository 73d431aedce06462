"""Adasum's combination (algorithms/adasum.py): orthogonal gradients add, equal ones average,
a zero one leaves the other, and ranks pair in Horovod's tree."""

from __future__ import annotations

import torch

from commlayer.algorithms import adasum


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
