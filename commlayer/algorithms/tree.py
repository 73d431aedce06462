"""Binomial tree: reduce to rank 0, then broadcast from it (for tiny messages).

Reduce, mask = 1, 2, 4, ...: a rank with bit ``mask`` set sends its buffer to rank - mask and
is done; otherwise it receives from rank + mask (if that exists) and reduces. Broadcast mirrors
it: each rank receives from its parent (rank minus its lowest set bit), then sends to
rank + m for each power of two m below that bit, largest first. The result is computed once,
at rank 0, so every rank has the same bits.

Cost: 2 ceil(log2 p) (alpha + n beta) + ceil(log2 p) n gamma.
"""

from __future__ import annotations

from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Schedule, compact, step
from commlayer.common.topology import Topology


@register("tree")
def tree(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    steps = []
    mask = 1
    while mask < size:
        if rank & mask:
            steps.append(step(sends=[(rank - mask, 0, numel)]))
            break
        if rank + mask < size:
            steps.append(step(recvs=[(rank + mask, 0, numel)]))
        mask <<= 1
    top = 1
    while top < size:
        top <<= 1
    low = rank & -rank if rank else top
    if rank:
        steps.append(step(recvs=[(rank - low, 0, numel)], reduce=False))
    m = low >> 1
    while m:
        if rank + m < size:
            steps.append(step(sends=[(rank + m, 0, numel)], reduce=False))
        m >>= 1
    return compact(steps)
