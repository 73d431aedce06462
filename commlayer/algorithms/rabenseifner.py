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

from commlayer.algorithms import register
from commlayer.algorithms.schedule import Fold, Schedule, blocks, compact, step


@register("rabenseifner")
def rabenseifner(rank: int, size: int, numel: int) -> Schedule:
    fold = Fold.of(size)
    b = blocks(numel, fold.p2)

    def span(lo: int, hi: int) -> tuple[int, int]:
        return b[lo][0], b[hi - 1][1]

    def core(v: int) -> Schedule:
        steps = []
        lo, hi = 0, fold.p2
        mask = fold.p2 >> 1
        while mask:
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
            peer = v ^ mask
            steps.append(step(sends=[(peer, *span(*give))], recvs=[(peer, *span(*keep))]))
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < fold.p2:
            width = hi - lo
            other = (lo - width, lo) if v & mask else (hi, hi + width)
            peer = v ^ mask
            steps.append(
                step(sends=[(peer, *span(lo, hi))], recvs=[(peer, *span(*other))], reduce=False)
            )
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
        return compact(steps)

    return fold.wrap(rank, numel, core)
