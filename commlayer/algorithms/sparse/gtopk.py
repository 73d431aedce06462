"""gTop-k (Shi et al., ICDCS 2019, "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification"): recursive doubling where each step merges the partner's k-sparse vector and
keeps only the k largest magnitudes, so every stream stays at most k pairs and the result is
k-sparse (log2 p steps of k pairs, against p k pairs received by allgather).

Definition, which the tests check: at each exchange both partners merge the same two vectors
and keep the same k entries (largest |value|, ties as torch.topk picks), so every rank ends
with the same result R. A rank's contribution at index i is lost from the step at which i is
dropped from the vector carrying it; ``dropped`` returns, per rank, its own input entries lost
that way, for its error-feedback residual, so that sum of inputs = R + sum over ranks of
dropped, exactly. With p not a power of two, an extra rank folds its vector into a partner
(merged, no selection), gets R back, and then its dropped entries, which the partner computes
from the input it received.
"""

from __future__ import annotations

from commlayer.algorithms import registry as dense
from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.sparse.registry import Policy, register
from commlayer.common.topology import Topology


@register("gtopk", Policy(switch=False, select=True, exact=False))
def gtopk(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    return dense.schedule("recursive_doubling", rank, size, numel)
