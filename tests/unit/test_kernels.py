"""Kernels: every implementation this machine has (torch reference, numba CPU) against the
reference on random inputs of odd sizes; dispatch by COMMLAYER_KERNELS."""

from __future__ import annotations

import pytest
import torch

from commlayer import config, kernels
from commlayer.kernels import reference

SIZES = (0, 1, 7, 1001, 65537)
CPU_CHOICES = ["torch"] + (["numba"] if kernels.available()["numba"] else [])
needs_numba = pytest.mark.skipif(not kernels.available()["numba"], reason="numba not installed")


def sorted_list(
    n: int, nnz: int, seed: int, dtype: torch.dtype, index: torch.dtype = torch.int32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[: min(nnz, n)].sort().values.to(index)
    val = torch.randint(-9, 10, (idx.numel(),), generator=g).to(dtype)
    return idx, val


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", SIZES)
def test_merge_sum_matches_dense_sum(
    choice: str, dtype: torch.dtype, index: torch.dtype, n: int
) -> None:
    for nnz_a, nnz_b in ((n // 3, n // 2), (n, 0), (0, n), (n, n)):
        a = sorted_list(n, nnz_a, n + nnz_a, dtype, index)
        b = sorted_list(n, nnz_b, 7 * n + nnz_b + 1, dtype, index)
        idx, val = kernels.merge_sum(*a, *b, choice=choice)
        assert idx.dtype == index and val.dtype == dtype
        assert bool((idx[1:] > idx[:-1]).all()), "merged indices strictly increasing"
        ref_idx, ref_val = reference.merge_sum(*a, *b)
        assert torch.equal(idx, ref_idx) and torch.equal(val, ref_val)
        expect = reference.densify(*a, n) + reference.densify(*b, n)
        assert torch.equal(reference.densify(idx, val, n), expect)


@pytest.mark.parametrize("choice", CPU_CHOICES)
def test_merge_of_random_floats_is_a_plus_b_bitwise(choice: str) -> None:
    g = torch.Generator().manual_seed(3)
    idx_a = torch.arange(0, 999, 2, dtype=torch.int32)
    idx_b = torch.arange(0, 999, 3, dtype=torch.int32)
    val_a, val_b = torch.randn(idx_a.numel(), generator=g), torch.randn(idx_b.numel(), generator=g)
    idx, val = kernels.merge_sum(idx_a, val_a, idx_b, val_b, choice=choice)
    ref_idx, ref_val = reference.merge_sum(idx_a, val_a, idx_b, val_b)
    assert torch.equal(idx, ref_idx) and torch.equal(val, ref_val)
    both = idx.remainder(6) == 0  # in both lists
    assert torch.equal(val[both], val_a[::3] + val_b[::2])


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("n", SIZES[1:])
def test_scatter_add_with_repeated_indices(choice: str, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    idx = torch.randint(0, n, (2 * n + 3,), generator=g, dtype=torch.int32)
    val = torch.randint(-4, 5, (idx.numel(),), generator=g).to(dtype)
    base = torch.randint(-4, 5, (n,), generator=g).to(dtype)
    out = kernels.scatter_add_(base.clone(), idx, val, choice=choice)
    assert torch.equal(out, reference.scatter_add_(base.clone(), idx, val))
    expect = base.double().index_add_(0, idx.long(), val.double())
    assert torch.equal(out.double(), expect)


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
def test_threshold_select(choice: str, dtype: torch.dtype, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    for threshold in (0.0, 0.1, 1.0 / 3.0, 2.5, 100.0):
        got = kernels.threshold_select(x, threshold, choice=choice)
        expect = torch.nonzero(x.abs() >= torch.tensor(threshold, dtype=dtype)).view(-1)
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), expect)


@pytest.mark.parametrize("n", SIZES)
def test_densify_sparsify_round_trip(n: int) -> None:
    idx, val = sorted_list(n, n // 3 + 1, n, torch.float32)
    val[val == 0] = 1.0
    dense = kernels.densify(idx, val, n)
    back_idx, back_val = kernels.sparsify(dense)
    assert back_idx.dtype == torch.int32
    assert torch.equal(back_idx, idx) and torch.equal(back_val, val)


@pytest.mark.parametrize("n", SIZES[1:])
def test_topk_is_the_k_largest_magnitudes_sorted_by_index(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for k in (1, n // 2, n, n + 5):
        idx, val = kernels.topk(x, k)
        assert idx.numel() == min(k, n)
        assert bool((idx[1:] > idx[:-1]).all())
        assert torch.equal(val, x[idx.long()])
        expect = torch.topk(x.abs(), min(k, n)).indices.sort().values
        assert torch.equal(idx.long(), expect)


def test_dispatch_follows_the_setting() -> None:
    x = torch.zeros(4)
    assert kernels.implementation("merge_sum", x, "torch") is reference
    assert kernels.implementation("merge_sum", x, "cupy") is reference  # no CPU path in CuPy
    with config.override(kernels="torch"):
        assert kernels.implementation("merge_sum", x) is reference
    with pytest.raises(ValueError, match="allowed: auto, cupy, numba, torch"):
        kernels.implementation("merge_sum", x, "triton")
    half = torch.zeros(4, dtype=torch.float16)
    assert kernels.implementation("merge_sum", half, "numba") is reference  # no float16 there
    assert kernels.implementation("topk", x, "numba") is reference  # no numba top-k


@needs_numba
def test_auto_uses_numba_on_cpu() -> None:
    from commlayer.kernels import numba_cpu

    x = torch.zeros(4)
    assert kernels.implementation("merge_sum", x, "auto") is numba_cpu
    assert kernels.implementation("merge_sum", x, "numba") is numba_cpu
