"""Kernels on CUDA tensors through CuPy: ext/cuda/*.cu loaded as RawModules.

sparse_kernels.cu (scatter-add, threshold, merge) and quantize_kernels.cu (QSGD, sign
packing). Each module is the PTX that CMakeLists.txt builds with nvcc (looked for in
``$COMMLAYER_CUDA_PTX_DIR`` and ``build/ext/cuda`` of the source tree), else the .cu source
compiled at run time by NVRTC. Tensors reach a kernel as their device addresses (``_ptr``: no
CuPy array is made; DLPack's export and CuPy's stream contexts cost more than a 64 M-element
kernel's worth of time per call, benchmarks/results/kernels_cuda.md). Every kernel runs on the
tensor's GPU and on torch's current stream there (``_on`` gives it to the launch), not on CuPy's
own current stream: a caller working on a non-default torch stream (created non-blocking, so it
does not wait for the legacy default stream CuPy would use) gets the kernel ordered after its
earlier work and before its later work, with no synchronization. A temporary made for a launch
(a contiguous copy, a dtype conversion) is allocated on that same stream, so torch's caching
allocator reuses its memory only for work ordered after the kernel. Imported only when CuPy is
present; used only for CUDA tensors.
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


def _threshold_kernel(kind: str, dtype: torch.dtype) -> Any:
    """threshold_mask_<values> or threshold_scatter_<indices> (sparse_kernels.cu)."""
    return module().get_function(f"{kind}_{_NAMES[dtype]}")


def _quantize_kernel(kind: str, values: torch.dtype) -> Any:
    return module("quantize_kernels").get_function(f"{kind}_{_NAMES[values]}")


def _scalar(value: float, dtype: torch.dtype) -> Any:
    return cupy.dtype(str(dtype).removeprefix("torch.")).type(value)


def _ptr(t: torch.Tensor) -> Any:
    """t's device address as a kernel argument (a 64-bit scalar, which the kernel reads as its
    pointer parameter); t must be contiguous."""
    return cupy.uint64(t.data_ptr())


class _Stream:
    """What CuPy's launch reads of a stream: its handle, ``ptr`` (torch's stream here)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


@contextlib.contextmanager
def _on(t: torch.Tensor) -> Iterator[_Stream]:
    """CuPy work inside runs on t's GPU (modules load there, kernels launch there); the stream
    it gives is torch's current stream of that GPU, for every launch inside (module
    docstring). The device is switched only when it is not the current one already."""
    stream = _Stream(torch.cuda.current_stream(t.device).cuda_stream)  # 0: torch's default
    if cupy.cuda.runtime.getDevice() == t.device.index:
        yield stream
        return
    with cupy.cuda.Device(t.device.index):
        yield stream


def _grid(n: int) -> tuple[int]:
    return (max(1, (n + _THREADS - 1) // _THREADS),)


def _grid4(n: int) -> tuple[int]:
    """Blocks for quantize_kernels.cu, whose threads take four elements each."""
    return _grid(-(-n // 4))


def _aligned(*tensors: torch.Tensor) -> Any:
    """1 where every tensor's data starts on a 16-byte boundary (quantize_kernels.cu then moves
    its values as vectors; a view at an odd offset does not), else 0."""
    return cupy.int32(all(t.data_ptr() % 16 == 0 for t in tensors))


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if idx.numel():
        target = dense if dense.is_contiguous() else dense.contiguous()
        idx, val = idx.contiguous(), val.to(dense.dtype).contiguous()
        with _on(dense) as stream:
            kernel = _kernel("scatter_add", dense.dtype, idx.dtype)
            args = (_ptr(target), _ptr(idx), _ptr(val), cupy.int64(idx.numel()))
            kernel(_grid(idx.numel()), (_THREADS,), args, stream=stream)
        if target is not dense:
            dense.copy_(target)
    return dense


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    dtype = index_dtype(x.numel())
    n = x.numel()
    if not n:
        return torch.empty(0, dtype=dtype, device=x.device)
    x = x.contiguous()
    blocks = _grid4(n)
    words = torch.empty(-(-n // 32), dtype=torch.int32, device=x.device)
    counts = torch.empty(blocks[0], dtype=torch.int64, device=x.device)
    with _on(x) as stream:
        # pass 1: the bit |x| >= threshold per element, and each block's count of them
        _threshold_kernel("threshold_mask", x.dtype)(
            blocks, (_THREADS,),
            (_ptr(x), _scalar(threshold, x.dtype), cupy.int64(n), _ptr(words),
             cupy.int64(words.numel()), _ptr(counts), _aligned(x)),
            stream=stream,
        )  # fmt: skip
    offsets = torch.cumsum(counts, 0)
    out = torch.empty(int(offsets[-1].item()), dtype=dtype, device=x.device)
    offsets -= counts  # exclusive: where each block's indices start
    if out.numel():
        with _on(x) as stream:
            # pass 2, the same grid: each thread writes its indices at its place, ascending
            _threshold_kernel("threshold_scatter", dtype)(
                blocks,
                (_THREADS,),
                (_ptr(words), cupy.int64(n), _ptr(offsets), _ptr(out)),
                stream=stream,
            )
    return out


def merge_sum(
    idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor, val_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    na, nb = idx_a.numel(), idx_b.numel()
    idx_a, val_a = idx_a.contiguous(), val_a.contiguous()
    idx_b, val_b = idx_b.to(idx_a.dtype).contiguous(), val_b.to(val_a.dtype).contiguous()
    match = torch.zeros(na + 1, dtype=torch.int64, device=idx_a.device)
    if na:
        with _on(idx_a) as stream:
            _kernel("match", val_a.dtype, idx_a.dtype)(
                _grid(na), (_THREADS,),
                (_ptr(idx_a), cupy.int64(na), _ptr(idx_b), cupy.int64(nb), _ptr(match)),
                stream=stream,
            )  # fmt: skip
    before = torch.zeros_like(match)
    before[1:] = torch.cumsum(match[:-1], 0)  # exclusive prefix; before[na] = matches in all
    total = na + nb - int(before[na].item())
    out_i = torch.empty(total, dtype=idx_a.dtype, device=idx_a.device)
    out_v = torch.empty(total, dtype=val_a.dtype, device=val_a.device)
    with _on(idx_a) as stream:
        common = (_ptr(before), _ptr(out_i), _ptr(out_v))
        if na:
            _kernel("merge_a", val_a.dtype, idx_a.dtype)(
                _grid(na), (_THREADS,),
                (_ptr(idx_a), _ptr(val_a), cupy.int64(na), _ptr(idx_b), _ptr(val_b),
                 cupy.int64(nb), *common),
                stream=stream,
            )  # fmt: skip
        if nb:
            _kernel("merge_b", val_a.dtype, idx_a.dtype)(
                _grid(nb), (_THREADS,),
                (_ptr(idx_a), cupy.int64(na), _ptr(idx_b), _ptr(val_b), cupy.int64(nb), *common),
                stream=stream,
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
    x, scale, rand = x.contiguous(), scale.contiguous(), rand.contiguous()
    with _on(x) as stream:
        args = (_ptr(x), _ptr(scale), _ptr(rand), cupy.int64(n), cupy.int64(bucket),
                cupy.int64(levels))  # fmt: skip
        aligned = _aligned(x, rand)
        if bits == 16:
            _quantize_kernel("qsgd_levels16", x.dtype)(
                _grid4(n), (_THREADS,), (*args, _ptr(out), aligned), stream=stream
            )
        else:
            # four elements per thread (at 1 bit two lanes make a byte by a warp shuffle)
            _quantize_kernel("qsgd_pack", x.dtype)(
                _grid4(n), (_THREADS,),
                (*args, cupy.int32(bits), _ptr(out), cupy.int64(out.numel()), aligned),
                stream=stream,
            )  # fmt: skip
    return out


def qsgd_dequantize(
    packed: torch.Tensor, step: torch.Tensor, levels: int, bits: int, bucket: int
) -> tuple[torch.Tensor, int]:
    n = step.numel() * bucket
    out = torch.empty(n, dtype=step.dtype, device=step.device)
    top = torch.zeros(1, dtype=torch.int64, device=step.device)
    if n:
        packed, step = packed.contiguous(), step.contiguous()
        with _on(step) as stream:
            head = (_ptr(packed), _ptr(step), cupy.int64(n), cupy.int64(bucket))
            args: tuple[Any, ...]
            tail = (_ptr(out), _ptr(top), _aligned(packed))
            if bits == 16:
                kind, args = "qsgd_unpack16", (*head, *tail)
            else:
                kind, args = "qsgd_unpack", (*head, cupy.int64(levels), cupy.int32(bits), *tail)
            _quantize_kernel(kind, step.dtype)(_grid4(n), (_THREADS,), args, stream=stream)
    return out, int(top.item())


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    words = torch.empty(-(-n // 32), dtype=torch.int32, device=x.device)
    if n:
        x = x.contiguous()
        with _on(x) as stream:
            args = (_ptr(x), cupy.int64(n), _ptr(words), cupy.int64(words.numel()), _aligned(x))
            # four elements per thread, the 8 lanes of a word combined by warp shuffles
            _quantize_kernel("sign_pack", x.dtype)(_grid4(n), (_THREADS,), args, stream=stream)
    return words


def decode_signs(
    words: torch.Tensor, count: int, positive: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    dtype = positive.dtype
    out = torch.empty(count, dtype=dtype, device=words.device)
    if count:
        # the two values stay on the device (the kernel reads them): no host synchronization
        words = words.contiguous()
        positive = positive.to(words.device).contiguous()
        negative = negative.to(device=words.device, dtype=dtype).contiguous()
        with _on(words) as stream:
            args = (_ptr(words), cupy.int64(count), _ptr(positive), _ptr(negative), _ptr(out))
            _quantize_kernel("sign_decode", dtype)(_grid4(count), (_THREADS,), args, stream=stream)
    return out
