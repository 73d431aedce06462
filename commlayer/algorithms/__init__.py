"""Allreduce algorithms, registered by name (``COMMLAYER_ALLREDUCE_ALGORITHM``).

Most are schedules (schedule.py: per-rank lists of send/receive/reduce steps run by one
executor, executor.py); two are not: ``native`` (the backend's own allreduce: MPI_Allreduce,
gloo's or NCCL's; the baseline every other is measured against; ``mpi`` is its former name, an
alias) and ``shm`` (ranks of one node reducing through an MPI-3 shared-memory window,
backends/shm.py). ``auto`` picks one per buffer size (core/selection.py). ``adasum`` is a
combine, registered for ``ReduceOp.Adasum`` (an operator that is not elementwise: registry.py).

The registry is registry.py; this package re-exports it and imports every plug-in, one module
per algorithm, each registering itself under its module's name.
"""

from __future__ import annotations

from commlayer.algorithms import (  # noqa: F401  (plug-ins: importing one registers it)
    adasum,
    hierarchical,
    rabenseifner,
    recursive_doubling,
    ring,
    shd,
    swing,
    tree,
)
from commlayer.algorithms.registry import (
    ALIASES,
    AUTO,
    NATIVE,
    NATIVE_ALLREDUCE,
    ONE_NODE,
    Builder,
    Combine,
    accepted,
    available,
    canonical,
    check_name,
    combining,
    combining_ops,
    generation,
    kinds,
    register,
    register_combine,
    registered,
    schedule,
    schedules,
    unregister,
    unregister_combine,
)

__all__ = [
    "ALIASES",
    "AUTO",
    "NATIVE",
    "NATIVE_ALLREDUCE",
    "ONE_NODE",
    "Builder",
    "Combine",
    "accepted",
    "available",
    "canonical",
    "check_name",
    "combining",
    "combining_ops",
    "generation",
    "kinds",
    "register",
    "register_combine",
    "registered",
    "schedule",
    "schedules",
    "unregister",
    "unregister_combine",
]
