"""DSAR (Renggli et al., SparCML, SC19): dynamic sparse allreduce, split-allgather whose blocks
switch to dense.

The schedule of ``ssar_split_allgather``; the policy differs: once a merged block would be
larger as (index, value) pairs than dense (nnz x (index + value bytes) >= length x value
bytes: fill-in pushes density toward min(1, p k / n)), its owner turns it dense and the
allgather carries it dense. So the bytes of the second step are at most a dense allgather's,
whatever the density; exact, and every rank ends with the same bits.
"""

from __future__ import annotations

from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.sparse.registry import Policy, register
from commlayer.algorithms.sparse.ssar_split_allgather import split_allgather
from commlayer.common.topology import Topology


@register("dsar", Policy(switch=True))
def dsar(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    return split_allgather(rank, size, numel)
