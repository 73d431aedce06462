"""Allreduce algorithms, registered by name (``COMMLAYER_ALLREDUCE_ALGORITHM``).

Most are schedules (schedule.py: per-rank lists of send/receive/reduce steps run by one
executor, executor.py); two are not: ``mpi`` (the MPI library's own MPI_Allreduce, the baseline
every other is measured against) and ``shm`` (ranks of one node reducing through an MPI-3
shared-memory window, backends/shm.py). ``auto`` picks one per buffer size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.topology import Topology

Builder = Callable[[int, int, int, Topology], Schedule]  # (rank, size, numel, topology)
B = TypeVar("B", bound=Builder)

NATIVE = ("mpi", "shm")  # run by the backend, not as a schedule
AUTO = "auto"
_SCHEDULES: dict[str, Builder] = {}


def register(name: str) -> Callable[[B], B]:
    """Decorator: make a schedule builder available under ``name``."""

    def decorate(builder: B) -> B:
        if name in _SCHEDULES or name in NATIVE or name == AUTO:
            raise ValueError(f"an allreduce algorithm named {name!r} is already registered")
        _SCHEDULES[name] = builder
        return builder

    return decorate


def available() -> list[str]:
    """Every name COMMLAYER_ALLREDUCE_ALGORITHM accepts."""
    _load()
    return [AUTO, *NATIVE, *sorted(_SCHEDULES)]


def schedule(
    name: str, rank: int, size: int, numel: int, topology: Topology | None = None
) -> Schedule:
    """Rank's schedule under algorithm ``name`` for a buffer of ``numel`` elements (one node
    unless ``topology`` says otherwise)."""
    _load()
    builder = _SCHEDULES.get(name)
    if builder is None:
        raise ValueError(
            f"{name!r} is not a schedule algorithm; schedules: {', '.join(sorted(_SCHEDULES))}"
        )
    if size == 1 or numel == 0:
        return []
    topology = topology or Topology.flat(size)
    if topology.size != size:
        raise ValueError(f"topology of {topology.size} ranks for a group of {size}")
    return builder(rank, size, numel, topology)


def check_name(name: str) -> str:
    if name not in available():
        raise ValueError(f"unknown allreduce algorithm {name!r}; allowed: {', '.join(available())}")
    return name


def _load() -> None:
    from commlayer.algorithms import (  # noqa: F401
        hierarchical,
        rabenseifner,
        recursive_doubling,
        ring,
        shd,
        swing,
        tree,
    )
