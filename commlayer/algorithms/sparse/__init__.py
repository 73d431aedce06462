"""Sparse allreduce algorithms, registered by name (``COMMLAYER_SPARSE_ALGORITHM``).

Each rank holds a sparse vector of ``numel`` elements, (indices, values); the result is the sum
over ranks, as a sparse list or, when that is smaller, dense. Like the dense algorithms these are
schedules (schedule.py: the dense ``Step`` lists, reused, run by a sparse executor whose
transfers carry (index, value) streams of data-dependent length) plus one policy per algorithm:
whether a stream turns dense once that is smaller, and whether each step re-selects the top k.

| name | schedule | dense switch | result |
| --- | --- | --- | --- |
| ``allgather`` | every rank's pairs to every rank (MPI allgatherv), summed locally | yes | exact |
| ``ssar_recursive_doubling`` | recursive doubling, merging index sets (SparCML) | no | exact |
| ``ssar_split_allgather`` | p blocks; owners merge theirs, then allgather (SparCML) | no | exact |
| ``dsar`` | as split_allgather, blocks turn dense once larger sparse (SparCML DSAR) | yes | exact |
| ``gtopk`` | recursive doubling, top k re-selected each step (Shi et al. 2019) | no | k-sparse |
| ``topo_sparse`` | hierarchical ring-ring on the topology (Nguyen et al. 2019) | yes | exact |

``auto`` picks the exact algorithm the cost model (cost.py) predicts fastest for the largest
nnz of any rank (one small allreduce first, so every rank picks the same).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.topology import Topology

AUTO = "auto"
NATIVE = ("allgather",)  # run by the backend's allgatherv, not as a schedule


@dataclass(frozen=True, slots=True)
class Policy:
    """How the executor treats a schedule's streams.

    ``switch``: a stream or block turns dense as soon as nnz * (index + value bytes) >=
    length * value bytes. ``select``: after each step that reduces in both directions, keep the
    k largest magnitudes and record what was dropped (gtopk). ``exact``: the result is the sum.
    """

    switch: bool
    select: bool = False
    exact: bool = True


Builder = Callable[[int, int, int, Topology], Schedule]  # (rank, size, numel, topology)
B = TypeVar("B", bound=Builder)
_SCHEDULES: dict[str, tuple[Builder, Policy]] = {}


def register(name: str, policy: Policy) -> Callable[[B], B]:
    """Decorator: make a sparse schedule builder available under ``name``."""

    def decorate(builder: B) -> B:
        if name in _SCHEDULES or name in NATIVE or name == AUTO:
            raise ValueError(f"a sparse allreduce algorithm named {name!r} is already registered")
        _SCHEDULES[name] = (builder, policy)
        return builder

    return decorate


def available() -> list[str]:
    """Every name COMMLAYER_SPARSE_ALGORITHM accepts."""
    _load()
    return [AUTO, *NATIVE, *sorted(_SCHEDULES)]


def exact() -> list[str]:
    """The algorithms whose result is the exact sum (``auto`` picks among these)."""
    _load()
    return [*NATIVE, *sorted(n for n, (_, p) in _SCHEDULES.items() if p.exact)]


def check_name(name: str) -> str:
    if name not in available():
        raise ValueError(
            f"unknown sparse allreduce algorithm {name!r}; allowed: {', '.join(available())}"
        )
    return name


def policy(name: str) -> Policy:
    _load()
    return Policy(switch=True) if name in NATIVE else _SCHEDULES[name][1]


def schedule(
    name: str, rank: int, size: int, numel: int, topology: Topology | None = None
) -> Schedule:
    """Rank's schedule under sparse algorithm ``name`` (one node unless ``topology`` says)."""
    _load()
    if name not in _SCHEDULES:
        raise ValueError(f"{name!r} is not a sparse schedule; schedules: {sorted(_SCHEDULES)}")
    if size == 1 or numel == 0:
        return []
    topology = topology or Topology.flat(size)
    if topology.size != size:
        raise ValueError(f"topology of {topology.size} ranks for a group of {size}")
    return _SCHEDULES[name][0](rank, size, numel, topology)


def _load() -> None:
    from commlayer.algorithms.sparse import (  # noqa: F401
        dsar,
        gtopk,
        ssar_recursive_doubling,
        ssar_split_allgather,
        topo_sparse,
    )
