"""Kernels written with numba-cuda: scatter-add, threshold selection, QSGD, sign packing.

Run on a GPU with CUDA tensors (zero-copy through ``__cuda_array_interface__``), and in CI under
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba.cuda is first imported) on CPU
tensors, against the torch reference. Imported only when numba-cuda is present.

1. ``scatter_add_``: one thread per sparse entry, ``atomic.add`` into the dense buffer (repeated
   indices accumulate, in an order the hardware picks: exact for integer-valued floats).
2. ``threshold_select``: one thread per element; a passing element takes an output slot from an
   atomic counter (the selected set equals the reference's, in an arbitrary order), then the
   indices are sorted.
3. ``qsgd_quantize``: one thread per output byte (8 // bits codes, or one int16 level), so
   no two threads write one byte; the codes as numba_cpu.py computes them (math shared).
   ``qsgd_dequantize``: one thread per element, the largest |level| by ``atomic.max``.
4. ``pack_signs``: one thread per int32 word (32 elements); ``decode_signs``: one per element.

On a GPU every kernel runs on the tensor's device and on torch's current stream there
(``_launching``), not on numba's default stream (the legacy null stream, which a non-default
torch stream, created non-blocking, does not wait for): the kernel is ordered after the caller's
earlier torch work and before its later work, with no synchronization.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from numba import cuda
from numba.core import config as numba_core_config
from numba.cuda import libdevice

from commlayer.kernels.reference import index_dtype

DTYPES = (torch.float32, torch.float64)
_THREADS = 256


def _probe_compile() -> None:
    """Compile one trivial kernel now, so that a numba-cuda that is installed but cannot
    compile here counts as unavailable (``kernels.available()``, ``auto`` skips it, naming it
    is a clear ValueError) instead of failing inside a compressor. Seen on an H200 image:
    numba-cuda 0.30.4 with numpy 2.5 raised AttributeError (numpy.row_stack, removed) on every
    compile. The simulator compiles nothing: no probe there."""
    if numba_core_config.ENABLE_CUDASIM:  # type: ignore[attr-defined]
        return
    try:
        cuda.jit("void(int32[:])")(_probe_kernel)
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here
        message = f"numba-cuda cannot compile kernels here ({type(exc).__name__}: {exc})"
        logging.getLogger("commlayer").warning("commlayer: %s; its kernels are not used", message)
        raise ImportError(message) from exc


def _probe_kernel(a):  # type: ignore[no-untyped-def]
    a[0] = 1


_probe_compile()


@cuda.jit
def _scatter_add(dense, idx, val):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < idx.size:
        cuda.atomic.add(dense, idx[i], val[i])


@cuda.jit
def _threshold(x, threshold, out, count):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.size and abs(x[i]) >= threshold:
        slot = cuda.atomic.add(count, 0, 1)
        out[slot] = i


# The fractional part of |x| * scale by an addition NVVM cannot fuse with the product: it
# contracts a multiply and an addition into an FMA by default (-fma=1, which numba-cuda leaves
# on), and an FMA adds to the unrounded product, rounding up other elements than the reference
# does (quantize_kernels.cu uses __fmul_rn for the same reason). libdevice's dadd_rn is a call,
# never contracted; in float64 it is exact for either dtype (level - floor(level) is exact in
# level's own dtype already). The simulator runs Python, which never contracts, and has no
# libdevice.
if numba_core_config.ENABLE_CUDASIM:  # type: ignore[attr-defined]  # set from the environment

    @cuda.jit(device=True)
    def _add(a, b):  # type: ignore[no-untyped-def]
        return a + b

else:
    _add = libdevice.dadd_rn


@cuda.jit(device=True)
def _qsgd_code(x, scale, rand, levels):  # type: ignore[no-untyped-def]
    level = abs(x) * scale  # rounded in x's dtype, as the reference rounds it
    low = math.floor(level)
    step = min(low + (1 if rand < _add(float(level), -float(low)) else 0), levels)
    if x > 0:
        return levels + step
    if x < 0:
        return levels - step
    return levels


@cuda.jit
def _qsgd_pack(x, scale, rand, bucket, levels, bits, out):  # type: ignore[no-untyped-def]
    b = cuda.grid(1)
    if b < out.size:
        per_byte = 8 // bits
        acc = 0
        for j in range(per_byte):
            e = b * per_byte + j
            if e < x.size:
                acc |= _qsgd_code(x[e], scale[e // bucket], rand[e], levels) << (j * bits)
        out[b] = acc


@cuda.jit
def _qsgd_levels16(x, scale, rand, bucket, levels, out):  # type: ignore[no-untyped-def]
    e = cuda.grid(1)
    if e < x.size:
        out[e] = _qsgd_code(x[e], scale[e // bucket], rand[e], levels) - levels


@cuda.jit
def _qsgd_unpack(packed, step, bucket, levels, bits, out, top):  # type: ignore[no-untyped-def]
    e = cuda.grid(1)
    if e < out.size:
        per_byte = 8 // bits
        code = int(packed[e // per_byte]) >> ((e % per_byte) * bits)  # int: no uint8 wrap
        signed = (code & ((1 << bits) - 1)) - levels
        cuda.atomic.max(top, 0, abs(signed))
        out[e] = signed
        out[e] *= step[e // bucket]


@cuda.jit
def _levels16(packed, step, bucket, out, top):  # type: ignore[no-untyped-def]
    e = cuda.grid(1)
    if e < out.size:
        signed = packed[e]
        cuda.atomic.max(top, 0, abs(int(signed)))
        out[e] = signed
        out[e] *= step[e // bucket]


@cuda.jit
def _pack_signs(x, words):  # type: ignore[no-untyped-def]
    w = cuda.grid(1)
    if w < words.size:
        acc = 0
        for t in range(min(32, x.size - 32 * w)):
            if x[32 * w + t] >= 0:
                acc |= 1 << t
        words[w] = acc - (1 << 32) if acc >= 1 << 31 else acc


@cuda.jit
def _decode_signs(words, positive, negative, out):  # type: ignore[no-untyped-def]
    e = cuda.grid(1)
    if e < out.size:
        out[e] = positive if (words[e >> 5] >> (e & 31)) & 1 else negative


def _array(t: torch.Tensor) -> Any:
    """A device array over a CUDA tensor's memory, or the numpy view of a CPU tensor (the
    simulator, or numba's automatic host transfer). detach: torch refuses the array interface
    of a tensor that requires grad, and the kernels never need its graph."""
    t = t.detach()
    return cuda.as_cuda_array(t) if t.is_cuda else t.numpy()


@contextlib.contextmanager
def _launching(t: torch.Tensor) -> Iterator[Any]:
    """The stream to launch kernels over ``t`` on, with t's GPU current (``_array`` must be
    called inside: numba maps the memory into the current device's context). A CPU tensor
    means the simulator, where torch has no CUDA and numba no external streams: its default
    stream (0), on which execution is synchronous anyway."""
    if not t.is_cuda:
        yield 0
        return
    with cuda.gpus[t.device.index]:
        yield cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


def _blocks(n: int) -> int:
    return max(1, (n + _THREADS - 1) // _THREADS)


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if not dense.is_contiguous():
        raise ValueError("scatter_add_: the dense buffer must be contiguous")
    if idx.numel():
        val = val.to(dense.dtype).contiguous()
        with _launching(dense) as stream:
            _scatter_add[_blocks(idx.numel()), _THREADS, stream](
                _array(dense), _array(idx.contiguous()), _array(val)
            )
    return dense


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.numel(), dtype=index_dtype(x.numel()), device=x.device)
    count = torch.zeros(1, dtype=torch.int32, device=x.device)
    if x.numel():
        limit = x.new_tensor(threshold).item()  # compared in x's dtype, as torch does
        with _launching(x) as stream:
            kernel = _threshold[_blocks(x.numel()), _THREADS, stream]
            kernel(_array(x), limit, _array(out), _array(count))
    return out[: int(count.item())].sort().values


def qsgd_quantize(
    x: torch.Tensor, scale: torch.Tensor, rand: torch.Tensor, levels: int, bits: int
) -> torch.Tensor:
    flat, bucket = x.contiguous().view(-1), x.shape[1]
    if bits == 16:
        out = torch.empty(flat.numel(), dtype=torch.int16, device=x.device)
    else:
        out = torch.empty(-(-flat.numel() * bits // 8), dtype=torch.uint8, device=x.device)
    if not out.numel():
        return out
    with _launching(x) as stream:
        args = (_array(flat), _array(scale.contiguous()), _array(rand.contiguous().view(-1)),
                bucket, levels)  # fmt: skip
        if bits == 16:
            _qsgd_levels16[_blocks(out.numel()), _THREADS, stream](*args, _array(out))
        else:
            _qsgd_pack[_blocks(out.numel()), _THREADS, stream](*args, bits, _array(out))
    return out


def qsgd_dequantize(
    packed: torch.Tensor, step: torch.Tensor, levels: int, bits: int, bucket: int
) -> tuple[torch.Tensor, int]:
    out = torch.empty(step.numel() * bucket, dtype=step.dtype, device=step.device)
    top = torch.zeros(1, dtype=torch.int64, device=step.device)
    if out.numel():
        with _launching(step) as stream:
            args = (_array(packed.contiguous()), _array(step.contiguous()), bucket)
            if bits == 16:
                _levels16[_blocks(out.numel()), _THREADS, stream](*args, _array(out), _array(top))
            else:
                kernel = _qsgd_unpack[_blocks(out.numel()), _THREADS, stream]
                kernel(*args, levels, bits, _array(out), _array(top))
    return out, int(top.item())


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    flat = x.contiguous().view(-1)
    words = torch.empty(-(-flat.numel() // 32), dtype=torch.int32, device=x.device)
    if words.numel():
        with _launching(x) as stream:
            _pack_signs[_blocks(words.numel()), _THREADS, stream](_array(flat), _array(words))
    return words


def decode_signs(
    words: torch.Tensor, count: int, positive: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    out = torch.empty(count, dtype=positive.dtype, device=words.device)
    if count:
        values = positive.item(), negative.item()
        with _launching(words) as stream:
            kernel = _decode_signs[_blocks(count), _THREADS, stream]
            kernel(_array(words.contiguous()), *values, _array(out))
    return out
