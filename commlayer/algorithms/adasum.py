"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021):
``allreduce(op=Adasum)``, as Horovod combines.

1. Two gradients combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``: orthogonal ones
   add, equal ones average, and a coefficient whose norm is below 1e-8 stays 1 (Horovod's
   ``ScaledAdd``). Dot products and norms are per tensor, accumulated in float64.
2. Ranks combine in Horovod's tree: rank r with r + 1 for even r, then with r + 2 for multiples
   of 4, and so on (the partners of its recursive vector halving); a rank left without a
   partner at a level (a size that is not a power of two) passes its vector up unchanged.
3. Here the tree runs on every rank over the ranks' tensors gathered by one allgather per
   tensor, so every rank computes the same bits. That moves p times the bytes of Horovod's
   vector-halving exchange: exact Adasum, meant for the modest rank counts and tensor sizes
   where allgather is cheap, not a bandwidth-optimal implementation.

Registered as the combining algorithm ``adasum`` of ``ReduceOp.Adasum`` (registry.py says why
it is a combine and not a schedule): ``allreduce(op=Adasum)`` finds it there, gathers the
tensors as it declares (``moves="allgather"``) and runs :func:`combine`.
"""

from __future__ import annotations

import torch

from commlayer.algorithms.registry import ALLGATHER, register_combine
from commlayer.common.reduce_ops import ReduceOp

_MIN_NORM_SQ = 1e-8


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two flat float64 vectors (step 1)."""
    dot = float(torch.dot(a, b))
    return a.mul(_coefficient(dot, a)).add_(b, alpha=_coefficient(dot, b))


def _coefficient(dot: float, v: torch.Tensor) -> float:
    norm_sq = float(torch.dot(v, v))
    return 1.0 - dot / (2.0 * norm_sq) if norm_sq >= _MIN_NORM_SQ else 1.0


@register_combine("adasum", ReduceOp.Adasum, moves=ALLGATHER)
def combine(rows: torch.Tensor) -> torch.Tensor:
    """Adasum over the ranks' vectors, one per row of ``rows`` in rank order (step 2), in
    ``rows``' dtype."""
    vectors = [row.double() for row in rows.reshape(rows.shape[0], -1)]
    distance = 1
    while distance < len(vectors):
        for first in range(0, len(vectors) - distance, 2 * distance):
            vectors[first] = pair(vectors[first], vectors[first + distance])
        distance *= 2
    return vectors[0].to(rows.dtype)
