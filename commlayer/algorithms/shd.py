"""SHD: topology-aware halving-doubling (Nguyen & Wahib, CCGrid 2021, "An allreduce algorithm
and network co-design for large-scale training of distributed deep learning"; implemented from
the rule below, as the paper's text is not available here).

Rule. Halving-doubling (Rabenseifner) exchanges with partner v XOR 2^k at step k; its largest
blocks (n/2) go in the first reduce-scatter step and the last allgather step. SHD orders the
partners by topological distance so that the largest blocks travel the shortest paths:

1. Positions: ranks are laid out node by node (then by rank), so position bits from the lowest
   up reach farther and farther: low bits stay inside a node, high bits cross nodes (and, with
   several levels, switches). Partners of one step, v and v XOR 2^k, then all cross the same
   level, and the g ranks of a node pair with g distinct ranks of one other node: flows of one
   step do not share a link other than the node's own uplink.
2. Reduce-scatter: bits in increasing order (nearest partner first, blocks n/2, n/4, ...);
   allgather: the mirror, decreasing order (farthest first, with the smallest blocks).
Non-powers of two fold the extra positions in first (adjacent positions: same node).

Cost, p = 2^K ranks, g = 2^L per node (G = p/g nodes), intra-node alpha_in/beta_in, network
alpha_out/beta_out. The first L steps stay inside a node; in the K - L others all g ranks of a
node cross at once, so the node's uplink carries g flows (the contention term):

    T = 2 sum_{k<L} (alpha_in + n/2^(k+1) beta_in)
      + 2 sum_{L<=k<K} (alpha_out + g n/2^(k+1) beta_out) + (p-1)/p n gamma

Per uplink and direction the network steps carry n (1 - 1/G) bytes; in Rabenseifner's order
the network steps come first, with the big halves, and carry g n (1 - 1/G): SHD cuts the
traffic on the scarce links by the ranks per node. On one node it is Rabenseifner with the
bits in the other order (same cost).
"""

from __future__ import annotations

from commlayer.algorithms.registry import register
from commlayer.algorithms.schedule import Fold, Schedule, halving_doubling, relabel
from commlayer.common.topology import Topology


@register("shd")
def shd(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    positions = topology.positions()  # position -> rank
    me = positions.index(rank)
    fold = Fold.of(size)
    masks = [1 << k for k in range(fold.p2.bit_length() - 1)]  # nearest first
    in_positions = fold.wrap(me, numel, lambda v: halving_doubling(v, fold.p2, numel, masks))
    return relabel(in_positions, positions)
