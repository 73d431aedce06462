"""Recursive doubling: log2 p steps, the whole buffer each step (latency-optimal).

Among p2 = 2^floor(log2 p) ranks, step k exchanges the whole buffer with rank v XOR 2^k and
reduces. Both partners compute a (op) b with the same two operands, and the ops are
commutative, so every rank ends with the same bits. Other sizes fold the extra ranks in first
and send them the result last (schedule.Fold).

Cost: log2(p2) (alpha + n beta + n gamma), plus 2 (alpha + n beta) + n gamma when p is not a
power of two.
"""

from __future__ import annotations

from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Fold, Schedule, compact, step
from commlayer.common.topology import Topology


@register("recursive_doubling")
def recursive_doubling(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    fold = Fold.of(size)

    def core(v: int) -> Schedule:
        steps = []
        mask = 1
        while mask < fold.p2:
            peer = v ^ mask
            steps.append(step(sends=[(peer, 0, numel)], recvs=[(peer, 0, numel)]))
            mask <<= 1
        return compact(steps)

    return fold.wrap(rank, numel, core)
