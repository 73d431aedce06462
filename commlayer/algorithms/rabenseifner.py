"""Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling allgather.

Among p2 = 2^floor(log2 p) ranks the buffer is cut into p2 blocks. Halving, mask = p2/2 .. 1:
rank v keeps the half of its current range on its side of bit ``mask`` (lower half if the bit
is 0), sends the other half to v XOR mask and reduces the half it keeps with what the partner
sends; after log2 p2 steps rank v holds block v reduced. Doubling, mask = 1 .. p2/2: exchange
the current range with v XOR mask, copying the partner's. Each block is reduced along one tree
and then copied, so every rank ends with the same bits. Other sizes fold the extra ranks in
first (schedule.Fold).

Cost: 2 log2(p2) alpha + 2 (p2-1)/p2 n beta + (p2-1)/p2 n gamma (+ the fold when p != p2).
"""

from __future__ import annotations

from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Fold, Schedule, halving_doubling
from commlayer.common.topology import Topology


@register("rabenseifner")
def rabenseifner(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    fold = Fold.of(size)
    masks = [fold.p2 >> (k + 1) for k in range(fold.p2.bit_length() - 1)]  # p2/2 .. 1
    return fold.wrap(rank, numel, lambda v: halving_doubling(v, fold.p2, numel, masks))
