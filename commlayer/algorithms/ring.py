"""Ring allreduce: a reduce-scatter then an allgather around the ring r -> r + 1.

The buffer is cut into p blocks. Reduce-scatter, steps s = 0 .. p-2: send block (r - s) mod p
to r + 1, receive block (r - s - 1) mod p from r - 1 and reduce it; rank r then holds block
(r + 1) mod p reduced over all ranks. Allgather, steps s = 0 .. p-2: send block (r + 1 - s) mod
p, receive block (r - s) mod p and copy it. 2(p-1) steps, each rank sends and receives
2(p-1)/p * n elements: bandwidth-optimal, latency 2(p-1) alpha. Each block is reduced by one
chain of ranks and then copied, so every rank ends with the same bits.

Cost: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma.
"""

from __future__ import annotations

from commlayer.algorithms import register
from commlayer.algorithms.schedule import Schedule, blocks, ring_phases
from commlayer.algorithms.topology import Topology


@register("ring")
def ring(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    scatter, gather = ring_phases(rank, range(size), blocks(numel, size))
    return scatter + gather
