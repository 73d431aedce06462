"""Ring allreduce: a reduce-scatter then an allgather around the ring r -> r + 1.

The buffer is cut into p blocks. Reduce-scatter, steps s = 0 .. p-2: send block (r - s) mod p
to r + 1, receive block (r - s - 1) mod p from r - 1 and reduce it; rank r then holds block
(r + 1) mod p reduced over all ranks. Allgather, steps s = 0 .. p-2: send block (r + 1 - s) mod
p, receive block (r - s) mod p and copy it. 2(p-1) steps, each rank sends and receives
2(p-1)/p * n elements: bandwidth-optimal, latency 2(p-1) alpha. Each block is reduced by one
chain of ranks and then copied, so every rank ends with the same bits.

Chunked: a block of more than ``schedule.RING_CHUNK_ELEMENTS`` elements (1 Mi, 4 MiB of
float32) travels as several messages of at most that size within its step, and the executor
reduces (or copies) each piece as soon as it and the ones before it arrived, while the rest are
still on the wire: a pipeline of depth m = ceil(block / chunk) inside each step. It hides up to
(m-1)/m of the reduction behind the transfers where the transport progresses on its own (a
NIC); MPICH between ranks of one node moves data only inside MPI calls, so here it hides
nothing (calibrate measures this as ``overlap``; benchmarks/results/algorithms_np2.md).

Cost: 2(p-1) (alpha + (m-1) alpha) + 2(p-1)/p n beta + (p-1)/p n gamma
      - overlap * 2(p-1) min(transfer, (m-1)/m local), m pieces per step.
"""

from __future__ import annotations

from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Schedule, blocks, ring_phases
from commlayer.common.topology import Topology


@register("ring")
def ring(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    scatter, gather = ring_phases(rank, range(size), blocks(numel, size))
    return scatter + gather
