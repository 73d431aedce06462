"""Kernels on CUDA tensors through CuPy: ext/cuda/sparse_kernels.cu loaded as a RawModule.

The module is the PTX that CMakeLists.txt builds with nvcc (looked for in
``$COMMLAYER_CUDA_PTX_DIR`` and ``build/ext/cuda`` of the source tree), else the .cu source
compiled at run time by NVRTC. Tensors cross to CuPy without a copy (DLPack), and kernels run
on the current CuPy stream. Imported only when CuPy is present; used only for CUDA tensors.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import cupy
import torch

from commlayer.kernels.reference import index_dtype

DTYPES = (torch.float32, torch.float64)
_THREADS = 256
_ROOT = Path(__file__).resolve().parents[2]
_SOURCE = _ROOT / "ext" / "cuda" / "sparse_kernels.cu"
_NAMES = {torch.float32: "f32", torch.float64: "f64", torch.int32: "i32", torch.int64: "i64"}


@functools.lru_cache(maxsize=1)
def module() -> Any:
    """The loaded RawModule: prebuilt PTX if found, else NVRTC on the source."""
    from commlayer import config  # here: config imports the algorithms, which import us

    for folder in (config.load().cuda_ptx_dir, _ROOT / "build" / "ext" / "cuda"):
        ptx = Path(folder) / "sparse_kernels.ptx"
        if folder and ptx.is_file():
            return cupy.RawModule(path=str(ptx))
    return cupy.RawModule(code=_SOURCE.read_text(), options=("--std=c++17",))


def _kernel(kind: str, values: torch.dtype, indices: torch.dtype) -> Any:
    return module().get_function(f"{kind}_{_NAMES[values]}_{_NAMES[indices]}")


def _cp(t: torch.Tensor) -> Any:
    return cupy.from_dlpack(t.contiguous())


def _grid(n: int) -> tuple[int]:
    return (max(1, (n + _THREADS - 1) // _THREADS),)


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if idx.numel():
        kernel = _kernel("scatter_add", dense.dtype, idx.dtype)
        args = (_cp(dense), _cp(idx), _cp(val.to(dense.dtype)), cupy.int64(idx.numel()))
        kernel(_grid(idx.numel()), (_THREADS,), args)
    return dense


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    dtype = index_dtype(x.numel())
    out = torch.empty(x.numel(), dtype=dtype, device=x.device)
    count = torch.zeros(1, dtype=torch.int64, device=x.device)
    if x.numel():
        limit = cupy.dtype(str(x.dtype).removeprefix("torch.")).type(threshold)
        kernel = _kernel("threshold", x.dtype, dtype)
        kernel(_grid(x.numel()), (_THREADS,), (_cp(x), limit, _cp(out), _cp(count),
                                               cupy.int64(x.numel())))  # fmt: skip
    return out[: int(count.item())].sort().values


def merge_sum(
    idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor, val_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    na, nb = idx_a.numel(), idx_b.numel()
    idx_b, val_b = idx_b.to(idx_a.dtype), val_b.to(val_a.dtype)
    match = torch.zeros(na + 1, dtype=torch.int64, device=idx_a.device)
    if na:
        _kernel("match", val_a.dtype, idx_a.dtype)(
            _grid(na),
            (_THREADS,),
            (_cp(idx_a), cupy.int64(na), _cp(idx_b), cupy.int64(nb), _cp(match)),  # fmt: skip
        )
    before = torch.zeros_like(match)
    before[1:] = torch.cumsum(match[:-1], 0)  # exclusive prefix; before[na] = matches in all
    total = na + nb - int(before[na].item())
    out_i = torch.empty(total, dtype=idx_a.dtype, device=idx_a.device)
    out_v = torch.empty(total, dtype=val_a.dtype, device=val_a.device)
    common = (_cp(before), _cp(out_i), _cp(out_v))
    if na:
        _kernel("merge_a", val_a.dtype, idx_a.dtype)(
            _grid(na), (_THREADS,),
            (_cp(idx_a), _cp(val_a), cupy.int64(na), _cp(idx_b), _cp(val_b), cupy.int64(nb),
             *common),
        )  # fmt: skip
    if nb:
        _kernel("merge_b", val_a.dtype, idx_a.dtype)(
            _grid(nb), (_THREADS,),
            (_cp(idx_a), cupy.int64(na), _cp(idx_b), _cp(val_b), cupy.int64(nb), *common),
        )  # fmt: skip
    return out_i, out_v
