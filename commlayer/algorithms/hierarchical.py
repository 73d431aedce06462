"""Two-level allreduces: ``hierarchical`` (groups = nodes) and ``torus2d`` (groups = grid rows).

Ranks form g-rank groups. (1) Reduce-scatter around a ring inside each group: the member at
index i then holds block (i + 1) mod g of the group's sum. (2) The members that hold the same
block (one per group) allreduce it among themselves with another algorithm (``INTER``, ring by
default; any schedule works). (3) Allgather around the group's ring. This is the seed authors'
"ring-ring" form and Horovod/NCCL's hierarchical allreduce: only n/g bytes per rank cross
between groups. ``torus2d`` (Mikami et al. 2018) is the same on a rows x columns grid:
reduce-scatter along rows, allreduce along columns, allgather along rows.

Groups must be the same size (else these fall back to a flat ring, decided identically on
every rank from the topology). Every block is reduced by one chain and then copied, so every
rank ends with the same bits.

Cost (groups of g, G groups, inter = ring): 2(g-1) (alpha_in + n/g beta_in) + (g-1)/g n gamma
+ 2(G-1) (alpha_out + n/(gG) beta_out) + (G-1)/(gG) n gamma.

Shared-memory form (the engine's ``hierarchical`` when it can; executor.Allreducer): with more than
one node, every node the same number of ranks and each node's ranks on one machine, steps (1)
and (3) go through the MPI-3 shared-memory window instead (backends/shm.py), chunk by chunk: the
window reduce-scatters a chunk, each rank allreduces its slice across nodes with ``INTER`` (over
the ranks with its index in their node), the window allgathers. Every rank decides the same,
from the topology and the detected nodes. Cost per chunk of c bytes and rank: copy in
(g-1)/g c, reduce (g-1)/g c gamma, copy out c (memory copies, no message per peer) plus one
``INTER`` allreduce of c/g bytes; the bytes between nodes are as above. Otherwise (one node,
unequal nodes, a backend without a window such as the loopback) the schedule runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from commlayer.algorithms import registry
from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Schedule, blocks, relabel, ring_phases
from commlayer.common.topology import Topology

INTER = "ring"


def two_level(
    rank: int, numel: int, groups: Sequence[Sequence[int]], inter: str = INTER
) -> Schedule:
    """The schedule of ``rank`` when ranks form ``groups`` (equal sizes, each in ring order)."""
    g = len(groups[0])
    if any(len(group) != g for group in groups):
        size = sum(len(group) for group in groups)
        return registry.schedule("ring", rank, size, numel)
    gi = next(i for i, group in enumerate(groups) if rank in group)
    li = list(groups[gi]).index(rank)
    b = blocks(numel, g)
    scatter, gather = ring_phases(li, groups[gi], b)
    start, stop = b[(li + 1) % g]
    peers = [group[li] for group in groups]
    across = registry.schedule(inter, gi, len(groups), stop - start)
    return scatter + relabel(across, peers, start) + gather


@register("hierarchical")
def hierarchical(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    groups = [topology.members(node) for node in sorted(set(topology.node_of))]
    return two_level(rank, numel, groups)


@register("torus2d")
def torus2d(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    rows, cols = topology.grid()
    return two_level(rank, numel, [list(range(r * cols, (r + 1) * cols)) for r in range(rows)])
