"""Topology-aware sparse allreduce (Nguyen et al., IPCCC 2019, on SparCML): hierarchical
"ring-ring" where every step merges (index, value) streams.

The schedule of the dense ``hierarchical`` algorithm (hierarchical.py): (1) ring reduce-scatter
inside each node, (2) ring allreduce across nodes among the ranks with the same local rank, on
the block each holds, (3) ring allgather inside the node. Each transfer carries the sparse
entries of its range, merged with summation on arrival; a stream or block turns dense as soon
as nnz x (index + value bytes) >= length x value bytes. On one node it is a sparse ring. Each
block is summed along one chain and then copied, so every rank ends with the same bits; exact.
"""

from __future__ import annotations

from commlayer.algorithms import registry as dense
from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.sparse.registry import Policy, register
from commlayer.common.topology import Topology


@register("topo_sparse", Policy(switch=True))
def topo_sparse(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    return dense.schedule("hierarchical", rank, size, numel, topology)
