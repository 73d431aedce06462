"""Kernels' torch reference: the ground truth every other implementation is tested against.

Sparse lists are (indices, values) pairs of 1-D tensors with strictly increasing indices
(int32 below 2^31 elements, int64 above: ``index_dtype``). Works on any device torch does.
"""

from __future__ import annotations

import torch


def index_dtype(numel: int) -> torch.dtype:
    """int32 for buffers below 2^31 elements (half the index bytes on the wire), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def merge_sum(
    idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor, val_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of two sorted lists; values at an index both hold are summed (a + b)."""
    idx = torch.cat([idx_a, idx_b])
    unique, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    out = torch.zeros(unique.numel(), dtype=val_a.dtype, device=val_a.device)
    # index_add_ adds in input order: a's value first, then b's, so the result is a + b.
    out.index_add_(0, inverse, torch.cat([val_a, val_b.to(val_a.dtype)]))
    return unique.to(idx_a.dtype), out


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """dense[idx[i]] += val[i] for every i (repeated indices accumulate); returns dense."""
    return dense.index_add_(0, idx, val.to(dense.dtype))


def densify(idx: torch.Tensor, val: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=val.dtype, device=val.device)
    return scatter_add_(out, idx, val)


def sparsify(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero entries of a 1-D tensor, indices ascending."""
    idx = torch.nonzero(dense).view(-1)
    return idx.to(index_dtype(dense.numel())), dense[idx]


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (ascending) of the entries with |x| >= threshold."""
    return torch.nonzero(x.abs() >= threshold).view(-1).to(index_dtype(x.numel()))


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude as a sorted sparse list (ties: torch.topk's pick)."""
    k = min(k, x.numel())
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return idx.to(index_dtype(x.numel())), x[idx]
