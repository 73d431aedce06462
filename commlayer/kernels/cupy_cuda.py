"""Kernels on CUDA tensors through CuPy: ext/cuda/*.cu loaded as RawModules.

sparse_kernels.cu (scatter-add, threshold, merge) and quantize_kernels.cu (QSGD, sign
packing). Each module is the PTX that CMakeLists.txt builds with nvcc (looked for in
``$COMMLAYER_CUDA_PTX_DIR`` and ``build/ext/cuda`` of the source tree), else the .cu source
compiled at run time by NVRTC. Tensors cross to CuPy without a copy (DLPack). Every kernel runs
on the tensor's GPU and on torch's current stream there (``_on``), not on CuPy's own current
stream: a caller working on a non-default torch stream (created non-blocking, so it does not wait
for the legacy default stream CuPy would use) gets the kernel ordered after its earlier work and
before its later work, with no synchronization. Imported only when CuPy is present; used only for
CUDA tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cupy
import torch

from commlayer.kernels.reference import index_dtype

DTYPES = (torch.float32, torch.float64)
_THREADS = 256  # must stay a multiple of 32: the kernels use full-warp ballots and shuffles
_ROOT = Path(__file__).resolve().parents[2]
_SOURCES = _ROOT / "ext" / "cuda"
_NAMES = {torch.float32: "f32", torch.float64: "f64", torch.int32: "i32", torch.int64: "i64"}


@functools.cache
def module(name: str = "sparse_kernels") -> Any:
    """The loaded RawModule ``name``: prebuilt PTX if found, else NVRTC on the source."""
    from commlayer import kernels  # the package, which loads this module by name

    for folder in (kernels.cuda_ptx_dir(), _ROOT / "build" / "ext" / "cuda"):
        ptx = Path(folder) / f"{name}.ptx"
        if folder and ptx.is_file():
            return cupy.RawModule(path=str(ptx))
    source = (_SOURCES / f"{name}.cu").read_text()
    # -I: the sources include commlayer_types.cuh from their own folder
    return cupy.RawModule(code=source, options=("--std=c++17", f"-I{_SOURCES}"))


def _kernel(kind: str, values: torch.dtype, indices: torch.dtype) -> Any:
    return module().get_function(f"{kind}_{_NAMES[values]}_{_NAMES[indices]}")


def _quantize_kernel(kind: str, values: torch.dtype) -> Any:
    return module("quantize_kernels").get_function(f"{kind}_{_NAMES[values]}")


def _scalar(value: float, dtype: torch.dtype) -> Any:
    return cupy.dtype(str(dtype).removeprefix("torch.")).type(value)


def _cp(t: torch.Tensor) -> Any:
    # detach: DLPack refuses a tensor that requires grad; the kernels never need its graph
    return cupy.from_dlpack(t.detach().contiguous())


@contextlib.contextmanager
def _on(t: torch.Tensor) -> Iterator[None]:
    """CuPy work inside runs on t's GPU (modules load, kernels launch there) and on torch's
    current stream of that GPU (module docstring). DLPack exports inside then see a consumer
    stream equal to torch's current one, so they add no event wait either."""
    with cupy.cuda.Device(t.device.index):
        stream = torch.cuda.current_stream(t.device).cuda_stream  # 0: torch's default stream
        with cupy.cuda.ExternalStream(stream, t.device.index):
            yield


def _grid(n: int) -> tuple[int]:
    return (max(1, (n + _THREADS - 1) // _THREADS),)


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if idx.numel():
        with _on(dense):
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
        with _on(x):
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
        with _on(idx_a):
            _kernel("match", val_a.dtype, idx_a.dtype)(
                _grid(na),
                (_THREADS,),
                (_cp(idx_a), cupy.int64(na), _cp(idx_b), cupy.int64(nb), _cp(match)),
            )
    before = torch.zeros_like(match)
    before[1:] = torch.cumsum(match[:-1], 0)  # exclusive prefix; before[na] = matches in all
    total = na + nb - int(before[na].item())
    out_i = torch.empty(total, dtype=idx_a.dtype, device=idx_a.device)
    out_v = torch.empty(total, dtype=val_a.dtype, device=val_a.device)
    with _on(idx_a):
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


def qsgd_quantize(
    x: torch.Tensor, scale: torch.Tensor, rand: torch.Tensor, levels: int, bits: int
) -> torch.Tensor:
    n, bucket = x.numel(), x.shape[1]
    if bits == 16:
        out = torch.empty(n, dtype=torch.int16, device=x.device)
    else:
        out = torch.empty(-(-n * bits // 8), dtype=torch.uint8, device=x.device)
    if not n:
        return out
    with _on(x):
        args = (_cp(x), _cp(scale), _cp(rand), cupy.int64(n), cupy.int64(bucket),
                cupy.int64(levels))  # fmt: skip
        if bits == 16:
            _quantize_kernel("qsgd_levels16", x.dtype)(_grid(n), (_THREADS,), (*args, _cp(out)))
        else:
            # one thread per element (the lanes of a byte combine by warp shuffles)
            _quantize_kernel("qsgd_pack", x.dtype)(
                _grid(n), (_THREADS,),
                (*args, cupy.int32(bits), _cp(out), cupy.int64(out.numel())),
            )  # fmt: skip
    return out


def qsgd_dequantize(
    packed: torch.Tensor, step: torch.Tensor, levels: int, bits: int, bucket: int
) -> tuple[torch.Tensor, int]:
    n = step.numel() * bucket
    out = torch.empty(n, dtype=step.dtype, device=step.device)
    top = torch.zeros(1, dtype=torch.int64, device=step.device)
    if n:
        with _on(step):
            head = (_cp(packed), _cp(step), cupy.int64(n), cupy.int64(bucket))
            args: tuple[Any, ...]
            if bits == 16:
                kind, args = "qsgd_unpack16", (*head, _cp(out), _cp(top))
            else:
                kind, args = "qsgd_unpack", (*head, cupy.int64(levels), cupy.int32(bits),
                                             _cp(out), _cp(top))  # fmt: skip
            _quantize_kernel(kind, step.dtype)(_grid(n), (_THREADS,), args)
    return out, int(top.item())


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    words = torch.empty(-(-n // 32), dtype=torch.int32, device=x.device)
    if n:
        with _on(x):
            args = (_cp(x.reshape(-1)), cupy.int64(n), _cp(words), cupy.int64(words.numel()))
            # one thread per element (each warp's 32 signs by __ballot_sync), not per word
            _quantize_kernel("sign_pack", x.dtype)(_grid(n), (_THREADS,), args)
    return words


def decode_signs(
    words: torch.Tensor, count: int, positive: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    dtype = positive.dtype
    out = torch.empty(count, dtype=dtype, device=words.device)
    if count:
        values = _scalar(positive.item(), dtype), _scalar(negative.item(), dtype)
        with _on(words):
            args = (_cp(words), cupy.int64(count), *values, _cp(out))
            _quantize_kernel("sign_decode", dtype)(_grid(count), (_THREADS,), args)
    return out
