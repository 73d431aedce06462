"""Sparse allreduce algorithms, registered by name (``COMMLAYER_SPARSE_ALGORITHM``).

Each rank holds a sparse vector of ``numel`` elements, (indices, values); the result is the sum
over ranks, as a sparse list or, when that is smaller, dense. Like the dense algorithms these are
schedules (schedule.py: the dense ``Step`` lists, reused, whose steps executor.py applies to
(index, value) streams of data-dependent length, moved through the engine by
comm/sparse_reduction.py) plus one policy per algorithm:
whether a stream turns dense once that is smaller, and whether each step re-selects the top k.

| name | schedule | dense switch | result |
| --- | --- | --- | --- |
| ``allgather`` | every rank's pairs to every rank (MPI allgatherv), summed locally | yes | exact |
| ``ssar_recursive_doubling`` | recursive doubling, merging index sets (SparCML) | no | exact |
| ``ssar_split_allgather`` | p blocks; owners merge theirs, then allgather (SparCML) | no | exact |
| ``dsar`` | as split_allgather, blocks turn dense once larger sparse (SparCML DSAR) | yes | exact |
| ``gtopk`` | recursive doubling, top k re-selected each step (Shi et al. 2019) | no | k-sparse |
| ``topo_sparse`` | hierarchical ring-ring on the topology (Nguyen et al. 2019) | yes | exact |

``auto`` picks the exact algorithm the sparse cost model (costmodel/sparse.py, above this
package) predicts fastest for the largest nnz of any rank (one small allreduce first, so every
rank picks the same); it costs every registered schedule from its steps, so a new one needs no
table. The registry is registry.py;
this package re-exports it and imports every plug-in.
"""

from __future__ import annotations

from commlayer.algorithms.sparse import (  # noqa: F401  (plug-ins: importing one registers it)
    dsar,
    gtopk,
    ssar_recursive_doubling,
    ssar_split_allgather,
    topo_sparse,
)
from commlayer.algorithms.sparse.registry import (
    AUTO,
    NATIVE,
    Builder,
    Policy,
    available,
    check_name,
    exact,
    generation,
    policy,
    register,
    registered,
    schedule,
    unregister,
)

__all__ = [
    "AUTO",
    "NATIVE",
    "Builder",
    "Policy",
    "available",
    "check_name",
    "exact",
    "generation",
    "policy",
    "register",
    "registered",
    "schedule",
    "unregister",
]
