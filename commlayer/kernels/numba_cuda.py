"""Kernels written with numba-cuda: scatter-add and threshold selection.

Run on a GPU with CUDA tensors (zero-copy through ``__cuda_array_interface__``), and in CI under
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba.cuda is first imported) on CPU
tensors, against the torch reference. Imported only when numba-cuda is present.

1. ``scatter_add_``: one thread per sparse entry, ``atomic.add`` into the dense buffer (repeated
   indices accumulate, in an order the hardware picks: exact for integer-valued floats).
2. ``threshold_select``: one thread per element; a passing element takes an output slot from an
   atomic counter (the selected set equals the reference's, in an arbitrary order), then the
   indices are sorted.
"""

from __future__ import annotations

from typing import Any

import torch
from numba import cuda

from commlayer.kernels.reference import index_dtype

DTYPES = (torch.float32, torch.float64)
_THREADS = 256


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


def _array(t: torch.Tensor) -> Any:
    """A device array over a CUDA tensor's memory, or the numpy view of a CPU tensor (the
    simulator, or numba's automatic host transfer)."""
    return cuda.as_cuda_array(t) if t.is_cuda else t.numpy()


def _blocks(n: int) -> int:
    return max(1, (n + _THREADS - 1) // _THREADS)


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if not dense.is_contiguous():
        raise ValueError("scatter_add_: the dense buffer must be contiguous")
    if idx.numel():
        val = val.to(dense.dtype).contiguous()
        _scatter_add[_blocks(idx.numel()), _THREADS](
            _array(dense), _array(idx.contiguous()), _array(val)
        )
    return dense


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.numel(), dtype=index_dtype(x.numel()), device=x.device)
    count = torch.zeros(1, dtype=torch.int32, device=x.device)
    if x.numel():
        limit = x.new_tensor(threshold).item()  # compared in x's dtype, as torch does
        _threshold[_blocks(x.numel()), _THREADS](_array(x), limit, _array(out), _array(count))
    return out[: int(count.item())].sort().values
