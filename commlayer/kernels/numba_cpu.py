"""Kernels' CPU fast path, compiled by numba ``@njit`` (imported only when numba is present).

The merge is where torch is slow: it has no merge of two sorted lists, so the reference
concatenates and sorts (``torch.unique``), O((a + b) log(a + b)); the two-pointer merge here is
one linear pass. Arguments are torch CPU tensors, passed to numba as zero-copy numpy views.
float16/bfloat16 values are not handled here (numba has no bfloat16): the dispatcher sends
them to the torch reference.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from commlayer.kernels.reference import index_dtype

DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


@numba.njit(cache=True, nogil=True)
def _merge(ia, va, ib, vb, out_i, out_v):  # type: ignore[no-untyped-def]
    i = j = n = 0
    while i < ia.size and j < ib.size:
        if ia[i] < ib[j]:
            out_i[n] = ia[i]
            out_v[n] = va[i]
            i += 1
        elif ib[j] < ia[i]:
            out_i[n] = ib[j]
            out_v[n] = vb[j]
            j += 1
        else:
            out_i[n] = ia[i]
            out_v[n] = va[i] + vb[j]
            i += 1
            j += 1
        n += 1
    while i < ia.size:
        out_i[n] = ia[i]
        out_v[n] = va[i]
        i += 1
        n += 1
    while j < ib.size:
        out_i[n] = ib[j]
        out_v[n] = vb[j]
        j += 1
        n += 1
    return n


@numba.njit(cache=True, nogil=True)
def _scatter_add(dense, idx, val):  # type: ignore[no-untyped-def]
    for i in range(idx.size):
        dense[idx[i]] += val[i]


@numba.njit(cache=True, nogil=True)
def _threshold(x, threshold, out):  # type: ignore[no-untyped-def]
    n = 0
    for i in range(x.size):
        if abs(x[i]) >= threshold:
            out[n] = i
            n += 1
    return n


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def merge_sum(
    idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor, val_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    total = idx_a.numel() + idx_b.numel()
    out_i = torch.empty(total, dtype=idx_a.dtype)
    out_v = torch.empty(total, dtype=val_a.dtype)
    n = _merge(_np(idx_a), _np(val_a), _np(idx_b.to(idx_a.dtype)), _np(val_b.to(val_a.dtype)),
               out_i.numpy(), out_v.numpy())  # fmt: skip
    return out_i[:n], out_v[:n]


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if not dense.is_contiguous():
        raise ValueError("scatter_add_: the dense buffer must be contiguous")
    _scatter_add(dense.numpy(), _np(idx), _np(val.to(dense.dtype)))
    return dense


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=index_dtype(x.numel()))
    n = _threshold(_np(x), x.new_tensor(threshold).item(), out.numpy())
    return out[:n].clone()  # not a view of a buffer as large as x
