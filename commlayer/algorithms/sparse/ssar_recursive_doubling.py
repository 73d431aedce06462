"""SSAR recursive doubling (Renggli et al., SparCML, SC19): log2 p steps, each exchanging the
whole sparse vector with rank v XOR 2^k and merging the index sets with summation.

Static: streams stay sparse however dense the merged vector gets (density grows toward
min(1, p k / n)), so it wins when p k << n; ``dsar`` is the variant that switches. Both
partners merge the same two operands, so every rank ends with the same bits. Other sizes fold
the extra ranks in first (schedule.Fold).

Bytes sent by a rank: sum over steps of the merged nnz so far x (index + value bytes).
"""

from __future__ import annotations

from commlayer.algorithms import registry as dense
from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.sparse.registry import Policy, register
from commlayer.common.topology import Topology


@register("ssar_recursive_doubling", Policy(switch=False))
def ssar_recursive_doubling(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    return dense.schedule("recursive_doubling", rank, size, numel)
