"""Kernels: every implementation this machine has (torch reference, numba CPU) against the
reference on random inputs of odd sizes; dispatch by COMMLAYER_KERNELS."""

from __future__ import annotations

import pytest
import torch

from commlayer import kernels
from commlayer.common import config
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


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
def test_add_threshold_select_adds_then_selects(choice: str, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    e, grad = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    for threshold in (0.0, 1.0 / 3.0, 2.5, 100.0):
        acc = e.clone()
        got = kernels.add_threshold_select_(acc, grad, threshold, choice=choice)
        assert torch.equal(acc, e + grad)
        assert torch.equal(got, kernels.threshold_select(e + grad, threshold, choice="torch"))


def test_uniform_hash_is_uniform_counter_based_and_keyed() -> None:
    u = reference.uniform_hash(7, 1 << 16, torch.float32, "cpu")
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert torch.equal(reference.uniform_hash(7, 10, torch.float32, "cpu"), u[:10])  # by index
    assert not torch.equal(reference.uniform_hash(8, 10, torch.float32, "cpu"), u[:10])
    assert torch.equal(reference.uniform_hash(7, 10, torch.float64, "cpu"), u[:10].double())


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (7, 4), (127, 8), (1000, 16)])
def test_qsgd_hashed_quantize_and_sum_match_the_reference(
    choice: str, dtype: torch.dtype, levels: int, bits: int
) -> None:
    """The fused kernels (draws in the loop, unpadded input; every record decoded and summed
    in one write) against the reference: padded input, uniform_hash draws, then sum of the
    decoded records over the divisor, bit for bit."""
    for n, bucket in ((1, 1), (1001, 3), (1001, 512), (65537, 512)):
        g = torch.Generator().manual_seed(n + bits)
        flats = [torch.randn(n, generator=g, dtype=dtype) for _ in range(3)]
        packed, steps = [], []
        for r, flat in enumerate(flats):
            buckets = -(-n // bucket)
            x = torch.zeros(buckets * bucket, dtype=dtype)
            x[:n] = flat
            norms = torch.linalg.vector_norm(x.view(buckets, bucket), dim=1)
            scale = torch.where(norms > 0, levels / norms, torch.zeros_like(norms))
            got = kernels.qsgd_quantize_hashed(flat, scale, bucket, levels, bits, r, choice)
            rand = reference.uniform_hash(r, x.numel(), dtype, "cpu").view(buckets, bucket)
            expect = reference.qsgd_quantize(x.view(buckets, bucket), scale, rand, levels, bits)
            assert torch.equal(got, expect), (n, bucket, r)
            packed.append(got)
            steps.append(norms / levels)
        for divisor in (1.0, 3.0):
            out = torch.full((n,), float("nan"), dtype=dtype)
            top, bad = kernels.qsgd_dequantize_sum_(
                packed, steps, levels, bits, bucket, divisor, out, choice
            )
            parts = [reference.qsgd_dequantize(p, s, levels, bits, bucket)[0][:n]
                     for p, s in zip(packed, steps)]  # fmt: skip
            expect = (parts[0] + parts[1] + parts[2]) / divisor
            assert bad == -1 and top <= levels and torch.equal(out, expect), (n, bucket)


@pytest.mark.parametrize("choice", CPU_CHOICES)
def test_qsgd_dequantize_sum_names_the_bad_record_and_writes_nothing(choice: str) -> None:
    good = torch.full((4,), 127, dtype=torch.uint8)
    bad = torch.tensor([127, 255, 0, 0], dtype=torch.uint8)  # level 128 > 127
    out = torch.zeros(4)
    top, record = kernels.qsgd_dequantize_sum_(
        [good, bad], [torch.ones(1)] * 2, 127, 8, 4, 2.0, out, choice
    )
    assert (top, record) == (128, 1) and torch.equal(out, torch.zeros(4))


@pytest.mark.parametrize("n", SIZES)
def test_densify_puts_each_value_at_its_index(n: int) -> None:
    idx, val = sorted_list(n, n // 3 + 1, n, torch.float32)
    val[val == 0] = 1.0
    dense = kernels.densify(idx, val, n)
    assert torch.equal(torch.nonzero(dense).view(-1), idx.long())
    assert torch.equal(dense[idx.long()], val)


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


def qsgd_inputs(
    n: int, bucket: int, levels: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x padded to whole buckets (zeros, one all-zero bucket when there are several), scale and
    rand as QSGDCompressor makes them."""
    g = torch.Generator().manual_seed(n + levels)
    buckets = max(1, -(-n // bucket))
    x = torch.zeros(buckets * bucket, dtype=dtype)
    x[:n] = torch.randn(n, generator=g, dtype=dtype)
    x[: min(n, bucket)] = 0.0 if buckets > 1 else x[: min(n, bucket)]
    x = x.view(buckets, bucket)
    norms = torch.linalg.vector_norm(x, dim=1)
    scale = torch.where(norms > 0, levels / norms, torch.zeros_like(norms))
    return x, scale, torch.rand(x.shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (7, 4), (127, 8), (1000, 16)])
@pytest.mark.parametrize("n", SIZES[1:])
def test_qsgd_quantize_and_dequantize_match_reference(
    choice: str, dtype: torch.dtype, levels: int, bits: int, n: int
) -> None:
    for bucket in (1, 3, 512):
        x, scale, rand = qsgd_inputs(n, bucket, levels, dtype)
        packed = kernels.qsgd_quantize(x, scale, rand, levels, bits, choice=choice)
        expect = reference.qsgd_quantize(x.clone(), scale, rand, levels, bits)
        assert packed.dtype == expect.dtype and torch.equal(packed, expect), bucket
        step = (scale.reciprocal().nan_to_num(0.0, 0.0, 0.0) * 1.0).to(dtype)
        values, top = kernels.qsgd_dequantize(packed, step, levels, bits, bucket, choice=choice)
        ref_values, ref_top = reference.qsgd_dequantize(packed, step, levels, bits, bucket)
        assert values.dtype == dtype and torch.equal(values, ref_values)
        assert top == ref_top <= levels
        # stochastic rounding to a neighbouring level: within one step of x
        assert bool(((values.view_as(x) - x).abs() <= step[:, None] * (1 + 1e-6)).all())


@pytest.mark.parametrize("choice", CPU_CHOICES)
def test_qsgd_level_never_exceeds_levels(choice: str) -> None:
    """One element per bucket: |x| * (levels / |x|) rounds above levels for some x; rounding
    up there would send level levels + 1, which every receiver refuses."""
    x = torch.randn(4096, 1, generator=torch.Generator().manual_seed(0))
    scale = 127 / x.abs().view(-1)
    assert bool((x.abs().view(-1) * scale > 127).any()), "the case this test is about"
    packed = kernels.qsgd_quantize(x, scale, torch.zeros_like(x), 127, 8, choice=choice)
    assert torch.equal(packed, torch.where(x.view(-1) > 0, 254, 0).to(torch.uint8))


@pytest.mark.parametrize("choice", CPU_CHOICES)
def test_qsgd_dequantize_reports_the_largest_level(choice: str) -> None:
    step = torch.ones(1)
    packed = torch.tensor([0xFF, 0x00], dtype=torch.uint8)  # codes 15, 15, 0, 0 at 4 bits
    values, top = kernels.qsgd_dequantize(packed, step, 7, 4, 4, choice=choice)
    assert top == 8 and values.tolist() == [8.0, 8.0, -7.0, -7.0]
    levels16 = torch.tensor([3, -32768, 5], dtype=torch.int16)
    _, top = kernels.qsgd_dequantize(levels16, step, 1000, 16, 3, choice=choice)
    assert top == 32768


@pytest.mark.parametrize("choice", CPU_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1001, 65537])
def test_sign_packing_matches_reference(choice: str, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).mul_(3).to(dtype)
    x[:: max(n // 7, 1)] = 0  # zero is non-negative
    if dtype.is_floating_point:
        x[1::5] = -0.0
        x[2::11] = float("nan")  # NaN >= 0 is false
    words = kernels.pack_signs(x, choice=choice)
    assert words.dtype == torch.int32 and torch.equal(words, reference.pack_signs(x))
    for out in (torch.float32, torch.float64):
        pos, neg = torch.tensor(0.75, dtype=out), torch.tensor(-1.0 / 3.0, dtype=out)
        got = kernels.decode_signs(words, n, pos, neg, choice=choice)
        assert got.dtype == out
        assert torch.equal(got, reference.decode_signs(words, n, pos, neg))
        assert torch.equal(got, torch.where(x >= 0, pos, neg))


@pytest.mark.parametrize(
    "spec", ["qsgd:levels=127", "qsgd:levels=7,bucket=64", "qsgd:levels=1000", "efsignsgd:ef=0",
             "onebit:ef=0"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_compressors_send_the_same_bits_with_every_kernel(spec: str, dtype: torch.dtype) -> None:
    from commlayer import compression

    x = torch.randn(4099, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[100:700] = 0.0
    sent = {}
    for choice in CPU_CHOICES:
        with config.override(kernels=choice):
            compressor = compression.create(spec)
            compressed = compressor.compress(x, "t")
            sent[choice] = (compressed.payload, compressor.decompress(compressed))
    payload, decoded = sent["torch"]
    for choice, (other, other_decoded) in sent.items():
        assert all(torch.equal(a, b) for a, b in zip(payload, other)), choice
        assert other_decoded.dtype == dtype and torch.equal(decoded, other_decoded), choice


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
    for kernel in kernels.TORCH_FASTER_ON_CPU:  # measured faster in torch: auto keeps torch
        assert kernels.implementation(kernel, x, "auto") is reference
        assert kernels.implementation(kernel, x, "numba") is numba_cpu
