"""Swing (De Sensi et al., NSDI 2024): recursive doubling whose partners swing back and forth.

At step s rank v exchanges with v + rho(s) if v is even, v - rho(s) if odd (mod p), where
rho(s) = sum_{i<=s} (-2)^i = 1, -1, 3, -5, 11, ...: partners are at distance |rho(s)| ~ 2^s/3
instead of 2^s, so on a ring or torus the messages take fewer hops ("short-cutting" the ring)
while every rank still combines all p inputs exactly once in log2 p steps. This is the
latency-optimal form (the whole buffer each step); power-of-two counts directly, other sizes
fold the extra ranks in first. Partners compute a (op) b with the same two operands, so every
rank ends with the same bits.

Cost: log2(p2) (alpha + n beta_hops(s) + n gamma), with beta_hops(s) the cost of |rho(s)| hops
on the network (1 hop per step on one node).
"""

from __future__ import annotations

from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Fold, Schedule, compact, step
from commlayer.common.topology import Topology


def rho(s: int) -> int:
    return (1 - (-2) ** (s + 1)) // 3


def peer(v: int, s: int, p: int) -> int:
    return (v + rho(s)) % p if v % 2 == 0 else (v - rho(s)) % p


@register("swing")
def swing(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    fold = Fold.of(size)

    def core(v: int) -> Schedule:
        steps = []
        for s in range(fold.p2.bit_length() - 1):
            q = peer(v, s, fold.p2)
            steps.append(step(sends=[(q, 0, numel)], recvs=[(q, 0, numel)]))
        return compact(steps)

    return fold.wrap(rank, numel, core)
