"""CUDA kernels on CUDA tensors (issue 25): every kernel of commlayer.kernels under each CUDA
implementation this machine has (CuPy, numba-cuda, and torch itself on the device) against the
torch reference run on the CPU on the same inputs, built on the CPU from seeded generators and
copied to the device (the same bits on both).

Exact comparisons wherever the result is determined bit for bit: indices, packed codes and
signs, and values made by one IEEE operation (a copy, a product, a sum of two terms, a sum of
integer-valued floats); allclose only for sums of arbitrary floats into one element, whose
order the hardware's atomics pick. Plus: a kernel launched while a non-default torch stream is
current is ordered with that stream's work (the launch-stream fix of cupy_cuda.py and
numba_cuda.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

from commlayer import kernels  # noqa: E402
from commlayer.kernels import reference  # noqa: E402

CUDA = torch.device("cuda")
SIZES = (0, 1, 33, 1000, (1 << 20) + 3)
DTYPES = (torch.float32, torch.float64)
_AVAILABLE = kernels.available()
# torch: the reference itself on the device; cupy, numba: run the reference for a kernel they
# lack (merge under numba-cuda), which is compared the same way.
CHOICES = (
    ["torch"] + (["cupy"] if _AVAILABLE["cupy"] else [])
    + (["numba"] if _AVAILABLE["numba-cuda"] else [])
)  # fmt: skip
CUDA_CHOICES = [c for c in CHOICES if c != "torch"]
QSGD = ((1, 2), (7, 4), (127, 8), (1000, 16))  # (levels, bits): every packed width
QSGD_BUCKET = 64


def _cuda(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return pair[0].to(CUDA), pair[1].to(CUDA)


def _assert_on_cuda(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.is_cuda, f"a kernel's output is on {t.device}, expected the input's CUDA device"


@functools.cache
def _sorted_list(
    n: int, nnz: int, seed: int, dtype: torch.dtype, index: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[: min(nnz, n)].sort().values.to(index)
    return idx, torch.randn(idx.numel(), generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_merge_sum(choice: str, dtype: torch.dtype, index: torch.dtype, n: int) -> None:
    # Exact: each output value is one input value or the sum of two (a + b), one IEEE addition.
    for nnz_a, nnz_b in ((n // 3, n // 2), (n, 0), (0, n), (n, n)):
        a = _sorted_list(n, nnz_a, 2 * n + nnz_a, dtype, index)
        b = _sorted_list(n, nnz_b, 3 * n + nnz_b + 1, dtype, index)
        (idx_a, val_a), (idx_b, val_b) = _cuda(a), _cuda(b)
        idx, val = kernels.merge_sum(idx_a, val_a, idx_b, val_b, choice=choice)
        _assert_on_cuda(idx, val)
        ref_idx, ref_val = reference.merge_sum(*a, *b)
        assert idx.dtype == index and val.dtype == dtype
        assert torch.equal(idx.cpu(), ref_idx), (nnz_a, nnz_b)
        assert torch.equal(val.cpu(), ref_val), (nnz_a, nnz_b)


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_scatter_add_with_repeated_indices(
    choice: str, dtype: torch.dtype, index: torch.dtype, n: int
) -> None:
    g = torch.Generator().manual_seed(n + 11)
    idx = torch.randint(0, max(n, 1), (2 * n + 3 if n else 0,), generator=g).to(index)
    base = torch.randint(-4, 5, (n,), generator=g).to(dtype)
    # Integer-valued floats: every order of the atomic additions gives the same exact sum.
    val = torch.randint(-4, 5, (idx.numel(),), generator=g).to(dtype)
    dense = base.to(CUDA, copy=True)
    out = kernels.scatter_add_(dense, idx.to(CUDA), val.to(CUDA), choice=choice)
    _assert_on_cuda(out)
    assert torch.equal(out.cpu(), reference.scatter_add_(base.clone(), idx, val))
    # Arbitrary floats: the atomics add in an order the hardware picks, so the sums round
    # differently. At most ~12 terms meet in one element (Poisson(2) tail over 2^20 elements),
    # each rounding <= half an ulp of a partial sum below 64: <= 12 * 32 eps apart per order.
    val = torch.randn(idx.numel(), generator=g, dtype=torch.float64).to(dtype)
    dense = base.to(CUDA, copy=True)
    out = kernels.scatter_add_(dense, idx.to(CUDA), val.to(CUDA), choice=choice)
    expect = reference.scatter_add_(base.clone(), idx, val)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.cpu(), expect, rtol=16 * eps, atol=1024 * eps)


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_threshold_select(choice: str, dtype: torch.dtype, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    x_cuda = x.to(CUDA)
    for threshold in (0.0, 0.5, 1.0 / 3.0, 2.5, 100.0):
        got = kernels.threshold_select(x_cuda, threshold, choice=choice)
        _assert_on_cuda(got)
        expect = reference.threshold_select(x, threshold)
        assert got.dtype == expect.dtype
        assert torch.equal(got.cpu(), expect), threshold


def _qsgd_inputs(
    n: int, levels: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as buckets x bucket, scale, rand, step), as QSGDCompressor makes them."""
    g = torch.Generator().manual_seed(n + levels)
    buckets = -(-n // QSGD_BUCKET)
    x = torch.zeros(buckets * QSGD_BUCKET, dtype=dtype)
    x[:n] = torch.randn(n, generator=g, dtype=dtype)
    x[:n:7] = 0.0  # zeros code as the middle level
    x = x.view(buckets, QSGD_BUCKET)
    norms = torch.linalg.vector_norm(x, dim=1)
    scale = torch.where(norms > 0, levels / norms, torch.zeros_like(norms))
    rand = torch.rand(x.shape, generator=g, dtype=dtype)
    return x, scale, rand, norms / levels


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("levels", "bits"), QSGD, ids=[f"{b}bits" for _, b in QSGD])
@pytest.mark.parametrize("n", SIZES)
def test_qsgd_quantize_and_dequantize(
    choice: str, dtype: torch.dtype, levels: int, bits: int, n: int
) -> None:
    # Exact: each code is a rounded product, a floor and a comparison (the CUDA kernels keep
    # the product rounded, never fused into an FMA); each decoded value one product.
    x, scale, rand, step = _qsgd_inputs(n, levels, dtype)
    cuda_args = x.to(CUDA), scale.to(CUDA), rand.to(CUDA)
    packed = kernels.qsgd_quantize(*cuda_args, levels, bits, choice=choice)
    _assert_on_cuda(packed)
    expect = reference.qsgd_quantize(x.clone(), scale, rand, levels, bits)
    assert packed.dtype == expect.dtype
    assert torch.equal(packed.cpu(), expect)
    values, top = kernels.qsgd_dequantize(
        packed, step.to(CUDA), levels, bits, QSGD_BUCKET, choice=choice
    )
    _assert_on_cuda(values)
    ref_values, ref_top = reference.qsgd_dequantize(expect, step, levels, bits, QSGD_BUCKET)
    assert torch.equal(values.cpu(), ref_values)
    assert top == ref_top


def _at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` on the device whose data starts ``offset`` elements into a buffer (not
    on a 16-byte boundary for an odd offset: the kernels then read element by element)."""
    flat = t.reshape(-1)
    buffer = torch.empty(flat.numel() + offset, dtype=t.dtype, device=CUDA)
    return buffer[offset:].copy_(flat).view(t.shape)


@pytest.mark.skipif(not CUDA_CHOICES, reason="neither CuPy nor numba-cuda is importable here")
@pytest.mark.parametrize("choice", CUDA_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("levels", "bits"), QSGD, ids=[f"{b}bits" for _, b in QSGD])
@pytest.mark.parametrize(("buckets", "bucket"), [(7, 3), (5, 5), (4099, 3), (1025, 6)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_qsgd_kernels_on_odd_buckets_and_offsets(
    choice: str, dtype: torch.dtype, levels: int, bits: int, buckets: int, bucket: int,
    offset: int,
) -> None:  # fmt: skip
    """The CUDA kernels take four elements a thread and move them as vectors where aligned:
    element counts that are not a multiple of 4, buckets shorter than 4 (a thread's elements
    in two or more buckets), and inputs (x, rand, the received payload) at an odd offset."""
    g = torch.Generator().manual_seed(buckets * bucket + bits)
    x = torch.randn(buckets, bucket, generator=g, dtype=dtype)
    x.view(-1)[::5] = 0.0
    norms = torch.linalg.vector_norm(x, dim=1)
    scale = torch.where(norms > 0, levels / norms, torch.zeros_like(norms))
    rand = torch.rand(x.shape, generator=g, dtype=dtype)
    packed = kernels.qsgd_quantize(
        _at_offset(x, offset), scale.to(CUDA), _at_offset(rand, offset), levels, bits,
        choice=choice,
    )  # fmt: skip
    expect = reference.qsgd_quantize(x.clone(), scale, rand, levels, bits)
    assert torch.equal(packed.cpu(), expect)
    step = norms / levels
    values, top = kernels.qsgd_dequantize(
        _at_offset(expect, offset), step.to(CUDA), levels, bits, bucket, choice=choice
    )
    ref_values, ref_top = reference.qsgd_dequantize(expect, step, levels, bits, bucket)
    assert torch.equal(values.cpu(), ref_values) and top == ref_top


def _signed_inputs(n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + 5), dtype=dtype)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")], dtype=dtype)
    x[: min(n, 5)] = specials[: min(n, 5)]  # 0 and -0 count as non-negative, NaN as negative
    return x


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_pack_and_decode_signs(choice: str, dtype: torch.dtype, n: int) -> None:
    x = _signed_inputs(n, dtype)
    words = kernels.pack_signs(x.to(CUDA), choice=choice)
    _assert_on_cuda(words)
    expect = reference.pack_signs(x)
    assert words.dtype == torch.int32 and torch.equal(words.cpu(), expect)
    positive, negative = torch.tensor(0.25, dtype=dtype), torch.tensor(-3.0, dtype=dtype)
    decoded = kernels.decode_signs(words, n, *_cuda((positive, negative)), choice=choice)
    _assert_on_cuda(decoded)
    assert torch.equal(decoded.cpu(), reference.decode_signs(expect, n, positive, negative))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_topk(dtype: torch.dtype, n: int) -> None:
    # topk has only the torch implementation (kernels/__init__.py). Distinct magnitudes (a
    # permutation, exact in float32 below 2^24), so the k largest are one set on any device.
    g = torch.Generator().manual_seed(n + 3)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    x = ((torch.randperm(n, generator=g) + 1) * signs).to(dtype)
    for k in {0, 1, max(1, n // 100), n}:
        idx, val = kernels.topk(x.to(CUDA), k)
        _assert_on_cuda(idx, val)
        ref_idx, ref_val = reference.topk(x, k)
        assert torch.equal(idx.cpu(), ref_idx) and torch.equal(val.cpu(), ref_val), k


@pytest.mark.skipif(not CUDA_CHOICES, reason="neither CuPy nor numba-cuda is importable here")
@pytest.mark.parametrize("choice", CUDA_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [3, 37, 1001, (1 << 16) + 5])
def test_signs_at_an_offset(choice: str, dtype: torch.dtype, n: int) -> None:
    """pack_signs of a view that does not start on a 16-byte boundary, decode of its words
    at an offset too (the kernels read element by element there)."""
    x = _signed_inputs(n, dtype)
    words = kernels.pack_signs(_at_offset(x, 1), choice=choice)
    expect = reference.pack_signs(x)
    assert torch.equal(words.cpu(), expect)
    positive, negative = torch.tensor(1.5, dtype=dtype), torch.tensor(-0.5, dtype=dtype)
    decoded = kernels.decode_signs(
        _at_offset(expect, 1), n, *_cuda((positive, negative)), choice=choice
    )
    assert torch.equal(decoded.cpu(), reference.decode_signs(expect, n, positive, negative))


@pytest.mark.skipif(not CUDA_CHOICES, reason="neither CuPy nor numba-cuda is importable here")
@pytest.mark.parametrize("choice", CUDA_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [5, 1001, (1 << 18) + 7])
def test_threshold_select_at_an_offset_with_nan(choice: str, dtype: torch.dtype, n: int) -> None:
    """An input that does not start on a 16-byte boundary (read element by element), NaN and
    infinities among the values (NaN is never selected, as |NaN| >= t is false in torch)."""
    x = _signed_inputs(n, dtype)
    for threshold in (0.0, 1.0, 3.0):
        got = kernels.threshold_select(_at_offset(x, 1), threshold, choice=choice)
        assert torch.equal(got.cpu(), reference.threshold_select(x, threshold)), threshold


# -- the launch stream ---------------------------------------------------------------------------
Case = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]  # (input on the host, run)


def _sign_case(choice: str) -> Case:
    host = torch.randn(1 << 22, generator=torch.Generator().manual_seed(1))
    return host, functools.partial(kernels.pack_signs, choice=choice)


def _scatter_case(choice: str) -> Case:
    n = 1 << 22
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, n, (n,), generator=g, dtype=torch.int32).to(CUDA)

    def run(x: torch.Tensor) -> torch.Tensor:  # x's values land on idx: ones scattered onto x
        return kernels.scatter_add_(x, idx, torch.ones(n, device=CUDA), choice=choice)

    return torch.randint(-4, 5, (n,), generator=g).float(), run


def _qsgd_case(choice: str) -> Case:
    rows = torch.randn(1 << 22, generator=torch.Generator().manual_seed(3)).view(-1, 512)
    rand = torch.rand(rows.shape, generator=torch.Generator().manual_seed(4)).to(CUDA)

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 512)
        scale = 127 / torch.linalg.vector_norm(x, dim=1)
        return kernels.qsgd_quantize(x, scale, rand, 127, 8, choice=choice)

    return rows.reshape(-1), run


STREAM_CASES = {"pack_signs": _sign_case, "scatter_add_": _scatter_case, "qsgd": _qsgd_case}


@pytest.mark.skipif(not CUDA_CHOICES, reason="neither CuPy nor numba-cuda is importable here")
@pytest.mark.parametrize("choice", CUDA_CHOICES)
@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_kernel_is_ordered_on_a_non_default_torch_stream(choice: str, case: str) -> None:
    """On a side stream (torch makes them non-blocking: they do not wait for the legacy default
    stream), the input is written after ~50 ms of device work, then the kernel runs, then the
    result is read on the same stream. A kernel launched on another stream would read the
    input before it is written (a pattern giving a different result) or leave its output
    unwritten when the stream is synchronized."""
    host, run = STREAM_CASES[case](choice)
    expect = run(host.to(CUDA)).cpu()  # also compiles / loads the kernel before timing matters
    torch.cuda.synchronize()
    x = torch.full_like(host, -1.0, device=CUDA)  # a pattern whose result differs from expect
    assert not torch.equal(run(x.clone()).cpu(), expect), "the test's pattern is not telling"
    source = host.to(CUDA)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles on the side stream
        x.copy_(source)
        got = run(x)
        torch.cuda.current_stream().synchronize()
        result = got.cpu()
    torch.cuda.synchronize()
    assert torch.equal(result, expect)
