"""The registry of allreduce algorithms: names to schedule builders, and the native names.

A plug-in module registers its builder with ``@register("name")`` (the module's own name);
``commlayer.algorithms`` imports every plug-in, so a name is known once that package is
imported. Everything else reads the registry (``available``, ``schedule``): the cost model
ranks every registered schedule and ``auto`` considers it, with no table to edit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from commlayer.algorithms.schedule import Schedule
from commlayer.algorithms.topology import Topology

Builder = Callable[[int, int, int, Topology], Schedule]  # (rank, size, numel, topology)
B = TypeVar("B", bound=Builder)

NATIVE = ("mpi", "shm")  # run by the backend, not as a schedule
ONE_NODE = ("shm",)  # natives that need every rank on one node
AUTO = "auto"
_SCHEDULES: dict[str, Builder] = {}
# Bumped by every change of the registry: caches keyed by an algorithm's name include it, so a
# name registered again (tests) is never answered from its predecessor's entry.
_generation = 0


def register(name: str) -> Callable[[B], B]:
    """Decorator: make a schedule builder available under ``name``."""

    def decorate(builder: B) -> B:
        global _generation
        if name in _SCHEDULES or name in NATIVE or name == AUTO:
            raise ValueError(f"an allreduce algorithm named {name!r} is already registered")
        _SCHEDULES[name] = builder
        _generation += 1
        return builder

    return decorate


def unregister(name: str) -> None:
    """Remove schedule algorithm ``name`` (ValueError if it is not one)."""
    global _generation
    if _SCHEDULES.pop(name, None) is None:
        raise ValueError(f"{name!r} is not a registered schedule algorithm")
    _generation += 1


@contextlib.contextmanager
def registered(name: str, builder: Builder) -> Iterator[None]:
    """``builder`` registered as ``name`` inside the block, removed after it (tests)."""
    register(name)(builder)
    try:
        yield
    finally:
        unregister(name)


def generation() -> int:
    """A number that changes whenever an algorithm is registered or removed."""
    return _generation


def schedules() -> list[str]:
    """The registered schedule algorithms, sorted."""
    return sorted(_SCHEDULES)


def available() -> list[str]:
    """Every name COMMLAYER_ALLREDUCE_ALGORITHM accepts."""
    return [AUTO, *NATIVE, *sorted(_SCHEDULES)]


def schedule(
    name: str, rank: int, size: int, numel: int, topology: Topology | None = None
) -> Schedule:
    """Rank's schedule under algorithm ``name`` for a buffer of ``numel`` elements (one node
    unless ``topology`` says otherwise)."""
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
