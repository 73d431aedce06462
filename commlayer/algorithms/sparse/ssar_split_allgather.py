"""SSAR split-allgather (Renggli et al., SparCML, SC19): split the index space into p blocks.

1. Every rank sends its entries of block j straight to rank j (one step, p - 1 streams each
   way) and rank j merges the p contributions of its block, in rank order.
2. Every rank sends its merged block to all others, who copy it (allgather).

Static: streams stay sparse (``dsar`` is the variant whose blocks turn dense). Each block is
summed by one rank and then copied, so every rank ends with the same bits. Bytes sent by a
rank: (p - 1)/p of its own entries, then p - 1 copies of its merged block.
"""

from __future__ import annotations

from commlayer.algorithms.schedule import Schedule, blocks, compact, step
from commlayer.algorithms.sparse.registry import Policy, register
from commlayer.common.topology import Topology


def split_allgather(rank: int, size: int, numel: int) -> Schedule:
    """The two steps, as a dense schedule (it is one: tests/unit/schedule_check.py runs it)."""
    b = blocks(numel, size)
    others = [q for q in range(size) if q != rank]
    mine = b[rank]
    return compact(
        [
            step(sends=[(q, *b[q]) for q in others], recvs=[(q, *mine) for q in others]),
            step(
                sends=[(q, *mine) for q in others],
                recvs=[(q, *b[q]) for q in others],
                reduce=False,
            ),
        ]
    )


@register("ssar_split_allgather", Policy(switch=False))
def ssar_split_allgather(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    return split_allgather(rank, size, numel)
