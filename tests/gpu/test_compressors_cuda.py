"""Compressors on CUDA tensors (issue 25): every built-in compressor given a CUDA gradient
makes its payloads, its context's tensors, its decompressed result and its error-feedback
residual on that device, and they equal what the same compressor (same spec, rank, seed and
name) makes from the same gradient on the CPU; under ``auto`` the kernels they call run the CUDA
implementations, not the torch reference.

Exact where the result is determined bit for bit given the same random draws, which the
compressors take from CPU generators on either device: casts, random-k and top-k (selections
and copies), QSGD, 1-bit and EF-SignSGD on gradients of small multiples of 1/64, whose sums and
norms are exact in any summation order (so the GPU's reductions give the CPU's bits). Within a
tolerance where a reduction's last rounding or order may differ (stated where used): PowerSGD
(matrix products and QR), EF-SignSGD's mean, and the float parts of later error-feedback steps
(the residual carries an earlier step's rounding into arbitrary floats).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

from commlayer import compression, kernels  # noqa: E402
from commlayer.compression import Compressor, create  # noqa: E402
from commlayer.compression import base as compression_base  # noqa: E402
from commlayer.compression.base import kept  # noqa: E402
from commlayer.kernels import reference  # noqa: E402

CUDA = torch.device("cuda")
RANK, SEED, NAME = 1, 7, "layer.weight"
SPECS = {
    "none": ["none"],
    "fp16": ["fp16"],
    "bf16": ["bf16"],
    "qsgd": [
        "qsgd", "qsgd:levels=7,bucket=64", "qsgd:levels=1,bucket=100",
        "qsgd:levels=1000,bucket=256",
    ],
    "topk": ["topk:ratio=0.01", "topk:ratio=0.01,mode=sampled", "topk:ratio=0.3"],
    "randomk": ["randomk:ratio=0.01", "randomk:ratio=0.2"],
    "efsignsgd": ["efsignsgd"],
    "onebit": ["onebit"],
    "powersgd": ["powersgd:rank=2"],
}  # fmt: skip
ALL_SPECS = [spec for specs in SPECS.values() for spec in specs]
BIASED_SPECS = ["topk:ratio=0.01", "randomk:ratio=0.01", "efsignsgd", "onebit", "powersgd:rank=2"]
# A matrix (PowerSGD compresses it), a vector QSGD pads, an odd 3-D tensor, and one large enough
# for top-k's sampled selection (which falls back to exact below 16384 elements).
SHAPES = [(64, 64), (1000,), (5, 7, 11), (1 << 17,)]
DTYPES = [torch.float32, torch.float64, torch.float16]
CUDA_KERNELS = (
    "merge_sum", "scatter_add_", "threshold_select", "qsgd_quantize", "qsgd_dequantize",
    "pack_signs", "decode_signs",
)  # fmt: skip
# kernels' auto order on CUDA: (name in kernels.available(), package, module)
CUDA_IMPLEMENTATIONS = (
    ("cupy", "cupy", "commlayer.kernels.cupy_cuda"),
    ("numba-cuda", "numba_cuda", "commlayer.kernels.numba_cuda"),
)


@pytest.fixture(autouse=True)
def _ieee_matmul() -> Iterator[None]:
    """PowerSGD's tolerances assume IEEE float32 products; TF32 (10-bit mantissa) would need
    1e-3. "highest" is torch's default; set here in case the environment changed it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


# -- inputs --------------------------------------------------------------------------------------
def _dyadic(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Multiples of 1/64 up to 127/64: exact in float16, bfloat16 and wider, and every sum of
    up to 2^24 / 127 of them (and of their squares, up to a 512-element QSGD bucket) is exact
    in float32, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, shape, generator=g) / 64).to(dtype)


def _separated(shape: tuple[int, ...], dtype: torch.dtype, seed: int, k: int) -> torch.Tensor:
    """Normal values, plus or minus 100 at k random positions: the k largest magnitudes are
    one set on any device, with a gap of ~90 to the rest (top-k's result does not depend on
    how torch.topk breaks ties, which differs between the CPU and CUDA)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    top = torch.randperm(n, generator=g)[:k]
    x[top] += torch.where(x[top] >= 0, 100.0, -100.0)
    return x.to(dtype).view(shape)


def _gradient(spec: str, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    name = spec.partition(":")[0]
    seed = 1000 * step + sum(shape) + len(spec)
    if name == "topk":
        ratio = _inner(create(spec)).ratio
        return _separated(shape, dtype, seed, kept(math.prod(shape), ratio))
    return _dyadic(shape, dtype, seed)


# -- running and comparing -----------------------------------------------------------------------
def _inner(compressor: Compressor) -> Any:
    return getattr(compressor, "inner", compressor)  # through an ErrorFeedback


def _step(compressor: Compressor, tensor: torch.Tensor) -> dict[str, Any]:
    """One step as the communicator runs it on one rank (a reduction over one rank leaves a
    payload as it is): compress, every further round, decompress; what each produced."""
    compressed = compressor.compress(tensor, NAME)
    rounds = [compressed]
    while not compressed.final:
        compressed = compressor.next_round(compressed, NAME)  # type: ignore[attr-defined]
        rounds.append(compressed)
    residual = getattr(compressor, "residuals", {}).get(NAME)
    return {
        "payloads": [[t.clone() for t in c.payload] for c in rounds],
        "contexts": [c.ctx for c in rounds],
        "result": compressor.decompress(compressed),
        "residual": None if residual is None else residual.clone(),
    }


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a context (tuples, lists, tensors; sizes and dtypes are not tensors)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        for item in value:
            yield from _tensors(item)


def _comparable(name: str, payload: list[torch.Tensor]) -> list[torch.Tensor]:
    """Payload tensors in a device-independent form: top-k's pairs by index (torch.topk lists
    them in an order that differs between devices), PowerSGD's factors up to each column's
    sign (QR may flip a column of P_hat, and with it Q's; P_hat Q^T does not change)."""
    if name == "topk":
        values, indices = payload
        order = indices.argsort()
        return [values[order], indices[order]]
    if name == "powersgd":
        return [t.abs() for t in payload]
    return payload


def _tolerance(name: str, step: int, dtype: torch.dtype) -> tuple[float, float] | None:
    """(rtol, atol as a fraction of the larger of 1 and the largest expected magnitude) for
    float tensors of ``name`` at ``step`` (1 = first), None for exact. Never below 4 units in
    the last place of ``dtype``: a result rounded to float16 from float32 values one unit
    apart may land one float16 unit apart, and a residual computed from it one more."""
    if not dtype.is_floating_point:
        return None
    eps = 4 * torch.finfo(dtype).eps
    if name == "powersgd":
        # float32: products over <= 77 terms and a QR of a well-conditioned 64 x 2 (or 5 x 2)
        # factor, ~1e-6 relative; float64 the same at ~1e-15. A 100x margin.
        return (max(1e-10 if dtype == torch.float64 else 1e-4, eps),) * 2
    if step > 1 and name in ("efsignsgd", "onebit"):
        # A residual of earlier steps makes the sums arbitrary floats: summed in another order
        # on the GPU, ~log2(4096) * eps32 = 1.4e-6 relative; 1e-5 leaves a 7x margin.
        return (max(1e-5, eps),) * 2
    if name == "qsgd":
        # The payload (codes and norms) is compared exactly and matched on an H200; the decoded
        # values level x norm / levels came out a few units in the last place apart there (the
        # device's division and product, fused or ordered otherwise): 4 units allowed, far
        # below one quantization level, so a wrong code still fails.
        return (eps, eps)
    if name == "efsignsgd":
        # Its float32 mean: the CUDA kernel multiplies the (exact) sum by 1/n, the CPU divides
        # by n; one rounding apart (none for n a power of 2), so one float32 unit at most.
        return (max(4 * torch.finfo(torch.float32).eps, eps),) * 2
    return None


def _same(what: str, got: torch.Tensor, expect: torch.Tensor, tol: Any) -> None:
    assert got.is_cuda, f"{what} is on {got.device}, expected CUDA"
    assert got.dtype == expect.dtype and got.shape == expect.shape, (what, got.dtype, got.shape)
    if tol is None:
        assert torch.equal(got.cpu(), expect), f"{what} differs from the CPU's"
        return
    rtol, atol = tol
    scale = max(float(expect.abs().max()) if expect.numel() else 0.0, 1.0)
    torch.testing.assert_close(
        got.cpu(), expect, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}"
    )


def _compare(spec: str, on_cuda: dict[str, Any], on_cpu: dict[str, Any], step: int) -> None:
    name = spec.partition(":")[0]
    for r, (got, expect) in enumerate(zip(on_cuda["payloads"], on_cpu["payloads"])):
        assert len(got) == len(expect), f"{spec}: round {r} has {len(got)} payload tensors"
        pairs = zip(_comparable(name, got), _comparable(name, expect))
        for j, (g, e) in enumerate(pairs):
            _same(
                f"{spec} step {step} round {r} payload {j}", g, e, _tolerance(name, step, e.dtype)
            )
    for r, ctx in enumerate(on_cuda["contexts"]):
        for t in _tensors(ctx):
            assert t.is_cuda, f"{spec}: a tensor of round {r}'s context is on {t.device}"
    for part in ("result", "residual"):
        got, expect = on_cuda[part], on_cpu[part]
        assert (got is None) == (expect is None), f"{spec}: {part} on one device only"
        if got is not None:
            _same(f"{spec} step {step} {part}", got, expect, _tolerance(name, step, expect.dtype))


def _both(spec: str, shape: tuple[int, ...], dtype: torch.dtype, steps: int) -> None:
    on_cuda = create(spec, rank=RANK, seed=SEED)
    on_cpu = create(spec, rank=RANK, seed=SEED)
    for step in range(1, steps + 1):
        gradient = _gradient(spec, shape, dtype, step)
        _compare(spec, _step(on_cuda, gradient.to(CUDA)), _step(on_cpu, gradient), step)


# -- the tests -----------------------------------------------------------------------------------
def test_every_built_in_compressor_is_covered() -> None:
    built_in = {"none", "fp16", "bf16", "qsgd", "topk", "randomk", "efsignsgd", "onebit"}
    built_in |= {"powersgd"}
    assert built_in <= set(compression.available())
    assert set(SPECS) == built_in, "a built-in compressor without a CUDA test"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_compressor_on_cuda_matches_the_cpu(
    spec: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    _both(spec, shape, dtype, steps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("spec", BIASED_SPECS)
def test_error_feedback_residuals_stay_on_cuda(spec: str, dtype: torch.dtype) -> None:
    """Two steps with error feedback: the residual is made on the device, added there to the
    next gradient, and matches the CPU's; (64, 64): 4096 elements, a power of 2, so the first
    step is exact for every compressor but PowerSGD."""
    assert isinstance(create(spec), compression.ErrorFeedback), "biased: wrapped by default"
    _both(spec, (64, 64), dtype, steps=2)


def test_host_draws_are_logged_once_and_qsgd_draws_none(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random-k's positions are drawn on the CPU for a CUDA tensor (every rank's must be equal,
    compression/randomk.py): said once in the 'commlayer' log, naming the compressor and the
    device. QSGD's rounding draws are counter-based hashes made on the device (issue 39): it
    does no host work and says none."""
    monkeypatch.setattr(compression_base, "_host_work_logged", set())
    randomk = create("randomk:ratio=0.01", rank=RANK, seed=SEED)
    qsgd = create("qsgd", rank=RANK, seed=SEED)
    with caplog.at_level(logging.INFO, logger="commlayer"):
        for _ in range(3):
            randomk.compress(_dyadic((4096,), torch.float32, 0).to(CUDA), NAME)
            qsgd.compress(_dyadic((4096,), torch.float32, 0).to(CUDA), NAME)
    messages = [r.getMessage() for r in caplog.records]
    said = [m for m in messages if "randomk" in m]
    assert len(said) == 1, messages
    assert "cuda" in said[0] and "CPU" in said[0], said
    assert not [m for m in messages if "qsgd" in m], messages


def test_auto_runs_the_cuda_kernels_not_the_reference() -> None:
    """Under ``auto`` every kernel CuPy or numba-cuda implements runs there for a CUDA tensor
    (CuPy first): an installed library that fails to import would otherwise turn every
    compressor's kernels into the torch reference without a word."""
    installed = [
        (n, m) for n, package, m in CUDA_IMPLEMENTATIONS if importlib.util.find_spec(package)
    ]
    if not installed:
        pytest.skip("neither CuPy nor numba-cuda is installed: torch is all there is on CUDA")
    usable = kernels.available()
    reasons = {}
    for name, module in installed:
        if not usable[name]:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                reasons[name] = str(exc)
    # A library installed but unusable must say why (numba_cuda.py's probe compile, with a
    # warning): on an H200 image numba-cuda 0.30.4 could not compile under numpy 2.5.
    unexplained = {n: r for n, r in reasons.items() if "cannot compile kernels here" not in r}
    assert not unexplained, f"installed but not importable: auto falls back to torch: {unexplained}"
    modules = [importlib.import_module(module) for name, module in installed if usable[name]]
    if not modules:
        pytest.skip(f"no usable CUDA kernel library: {reasons}")
    for dtype in (torch.float32, torch.float64):
        x = torch.zeros(8, dtype=dtype, device=CUDA)
        for kernel in CUDA_KERNELS:
            offered = [m for m in modules if hasattr(m, kernel)]
            chosen = kernels.implementation(kernel, x, "auto")
            expect = offered[0] if offered else reference
            assert chosen is expect, (kernel, dtype, chosen.__name__, expect.__name__)
