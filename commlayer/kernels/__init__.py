"""Kernels: the local work of the sparse allreduce and of the compressors.

Every kernel has a torch reference (reference.py: the ground truth of the tests) and, where
it pays, faster implementations picked per call by ``COMMLAYER_KERNELS`` (resolved once by
``init()``, which hands it down with ``use()``; a call may name one with ``choice=``):

| setting | CPU tensors | CUDA tensors |
| --- | --- | --- |
| ``auto`` (default) | numba if installed, else torch | cupy, else numba-cuda, else torch |
| ``numba`` | numba ``@njit`` (numba_cpu.py) | numba-cuda (numba_cuda.py) |
| ``cupy`` | torch (CuPy has no CPU path) | ext/cuda via CuPy (cupy_cuda.py) |
| ``torch`` | torch | torch |

A kernel an implementation lacks (top-k everywhere, densify, merge under numba-cuda)
or a dtype it does not handle (float16, bfloat16) runs the reference. Under ``auto`` on the CPU
a kernel listed in ``TORCH_FASTER_ON_CPU`` runs the reference too: benchmarks/kernels.py
measured torch at least as fast as numba for it (benchmarks/results/kernels.md). Naming
``numba`` or ``cupy`` when that library is missing is a ValueError saying so, not a silent
fallback.

Sparse lists: (indices, values), 1-D, indices strictly increasing, int32 below 2^31
elements and int64 from there (``index_dtype``).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from commlayer.common import config
from commlayer.kernels import reference
from commlayer.kernels.reference import densify, index_dtype, topk

__all__ = [
    "CHOICES",
    "add_threshold_select_",
    "available",
    "configured",
    "cuda_ptx_dir",
    "decode_signs",
    "densify",
    "implementation",
    "index_dtype",
    "merge_sum",
    "pack_signs",
    "qsgd_dequantize",
    "qsgd_dequantize_sum_",
    "qsgd_quantize",
    "qsgd_quantize_hashed",
    "scatter_add_",
    "threshold_select",
    "topk",
    "use",
]

CHOICES = ("auto", "cupy", "numba", "torch")
_MODULES = {
    ("numba", False): "commlayer.kernels.numba_cpu",
    ("numba", True): "commlayer.kernels.numba_cuda",
    ("cupy", True): "commlayer.kernels.cupy_cuda",
}
TORCH_FASTER_ON_CPU: frozenset[str] = frozenset()
_choice = "auto"  # set once by use(): init() hands down its Config's kernels
_cuda_ptx_dir = ""


@functools.cache
def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:  # the library is not installed (or, for CUDA, not usable)
        return None


def available() -> dict[str, bool]:
    """Which implementations this process can use: {'numba': ..., 'numba-cuda': ..., 'cupy':
    ...} (torch always can)."""
    return {
        "numba": _load(_MODULES["numba", False]) is not None,
        "numba-cuda": _load(_MODULES["numba", True]) is not None,
        "cupy": _load(_MODULES["cupy", True]) is not None,
    }


def use(choice: str, cuda_ptx_dir: str = "") -> None:
    """Set this process's implementation (``init()`` hands down its resolved COMMLAYER_KERNELS
    and COMMLAYER_CUDA_PTX_DIR; the kernels never read the environment). Before any call:
    ``auto``."""
    global _choice, _cuda_ptx_dir
    if choice not in CHOICES:
        raise ValueError(f"kernel implementation {choice!r}; allowed: {', '.join(CHOICES)}")
    _choice, _cuda_ptx_dir = choice, cuda_ptx_dir


def configured() -> str:
    """The implementation set by ``use()`` (``auto`` before), or the one an active
    ``config.override(kernels=...)`` block names (tests)."""
    return str(config.overrides().get("kernels", _choice))


def cuda_ptx_dir() -> str:
    """Folder of a prebuilt sparse_kernels.ptx set by ``use()`` ("" : none given)."""
    return _cuda_ptx_dir


def implementation(kernel: str, tensor: torch.Tensor, choice: str | None = None) -> ModuleType:
    """The module whose ``kernel`` runs on ``tensor``: ``choice`` (default ``configured()``)
    resolved as in the table above."""
    choice = choice or configured()
    if choice not in CHOICES:
        raise ValueError(f"kernel implementation {choice!r}; allowed: {', '.join(CHOICES)}")
    cuda = tensor.is_cuda
    auto = ("cupy", "numba") if cuda else () if kernel in TORCH_FASTER_ON_CPU else ("numba",)
    order = {"auto": auto, "torch": ()}.get(choice, (choice,))
    for name in order:
        path = _MODULES.get((name, cuda))
        if path is None:
            continue
        module = _load(path)
        if module is None:
            if choice == name:
                raise ValueError(
                    f"COMMLAYER_KERNELS={choice} but {name} cannot be imported here; install it "
                    "or use auto (picks what is available) or torch"
                )
            continue
        if hasattr(module, kernel) and tensor.dtype in module.DTYPES:
            return module
    return reference


def merge_sum(
    idx_a: torch.Tensor,
    val_a: torch.Tensor,
    idx_b: torch.Tensor,
    val_b: torch.Tensor,
    choice: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of two sorted sparse lists with values at common indices summed (a + b)."""
    impl = implementation("merge_sum", val_a, choice)
    return impl.merge_sum(idx_a, val_a, idx_b, val_b)  # type: ignore[no-any-return]


def scatter_add_(
    dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, choice: str | None = None
) -> torch.Tensor:
    """dense[idx[i]] += val[i] (repeated indices accumulate); returns ``dense``."""
    impl = implementation("scatter_add_", dense, choice)
    return impl.scatter_add_(dense, idx, val)  # type: ignore[no-any-return]


def threshold_select(x: torch.Tensor, threshold: float, choice: str | None = None) -> torch.Tensor:
    """Indices, ascending, of the entries with |x| >= threshold (compared in x's dtype)."""
    impl = implementation("threshold_select", x, choice)
    return impl.threshold_select(x, threshold)  # type: ignore[no-any-return]


def add_threshold_select_(
    e: torch.Tensor, g: torch.Tensor, threshold: float, choice: str | None = None
) -> torch.Tensor:
    """``e += g`` in place and the indices, ascending, where |e| >= threshold: error feedback's
    correction and top-k's candidates in one read (numba on the CPU)."""
    impl = implementation("add_threshold_select_", e, choice)
    return impl.add_threshold_select_(e, g, threshold)  # type: ignore[no-any-return]


def qsgd_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    rand: torch.Tensor,
    levels: int,
    bits: int,
    choice: str | None = None,
) -> torch.Tensor:
    """QSGD's stochastic rounding of ``x`` (buckets x bucket) with ``scale`` = levels / norm
    per bucket and uniform ``rand``: int16 levels (``bits`` 16) or codes packed ``bits``
    (2, 4, 8) to a code (reference.qsgd_quantize)."""
    impl = implementation("qsgd_quantize", x, choice)
    return impl.qsgd_quantize(x, scale, rand, levels, bits)  # type: ignore[no-any-return]


def qsgd_quantize_hashed(
    flat: torch.Tensor,
    scale: torch.Tensor,
    bucket: int,
    levels: int,
    bits: int,
    key: int,
    choice: str | None = None,
) -> torch.Tensor:
    """:func:`qsgd_quantize` of the flat, unpadded ``flat`` (the last bucket completed with
    zeros) with ``rand`` = ``reference.uniform_hash(key, ...)``: numba on the CPU draws each
    number in the loop (no rand tensor: one read of ``flat``); elsewhere the padded tensor and
    the draws are made with torch ops on the tensor's device, then :func:`qsgd_quantize`
    (the CUDA kernels on a GPU). The same bits either way."""
    impl = implementation("qsgd_quantize_hashed", flat, choice)
    if impl is not reference:
        return impl.qsgd_quantize_hashed(flat, scale, bucket, levels, bits, key)  # type: ignore[no-any-return]
    x = torch.zeros(scale.numel() * bucket, dtype=flat.dtype, device=flat.device)
    x[: flat.numel()] = flat
    rand = reference.uniform_hash(key, x.numel(), x.dtype, x.device)
    return qsgd_quantize(x.view(-1, bucket), scale, rand.view(-1, bucket), levels, bits, choice)


def qsgd_dequantize_sum_(
    records: list[torch.Tensor],
    steps: list[torch.Tensor],
    levels: int,
    bits: int,
    bucket: int,
    divisor: float,
    out: torch.Tensor,
    choice: str | None = None,
) -> tuple[int, int]:
    """Every rank's QSGD record decoded and summed into ``out`` (flat, contiguous), divided by
    ``divisor``: reference.qsgd_dequantize_sum_ (numba: one write of ``out``)."""
    impl = implementation("qsgd_dequantize_sum_", out, choice)
    return impl.qsgd_dequantize_sum_(records, steps, levels, bits, bucket, divisor, out)  # type: ignore[no-any-return]


def qsgd_dequantize(
    packed: torch.Tensor,
    step: torch.Tensor,
    levels: int,
    bits: int,
    bucket: int,
    choice: str | None = None,
) -> tuple[torch.Tensor, int]:
    """Levels times ``step`` per bucket, flat in step's dtype, and the largest |level| met."""
    impl = implementation("qsgd_dequantize", step, choice)
    return impl.qsgd_dequantize(packed, step, levels, bits, bucket)  # type: ignore[no-any-return]


def pack_signs(x: torch.Tensor, choice: str | None = None) -> torch.Tensor:
    """One bit per element, 1 where x >= 0, 32 to an int32 word."""
    impl = implementation("pack_signs", x, choice)
    return impl.pack_signs(x)  # type: ignore[no-any-return]


def decode_signs(
    words: torch.Tensor,
    count: int,
    positive: torch.Tensor,
    negative: torch.Tensor,
    choice: str | None = None,
) -> torch.Tensor:
    """``count`` elements: ``positive`` where the sign bit is 1, else ``negative`` (0-dim
    tensors of the output dtype)."""
    impl = implementation("decode_signs", positive, choice)
    return impl.decode_signs(words, count, positive, negative)  # type: ignore[no-any-return]
