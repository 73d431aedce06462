"""The registry of sparse allreduce algorithms: names to (schedule builder, policy).

A plug-in module registers its builder with ``@register("name", Policy(...))``;
``commlayer.algorithms.sparse`` imports every plug-in. The sparse cost model
(costmodel/sparse.py) costs any registered schedule from its steps and policy, so ``auto``
considers a new exact algorithm with no table to edit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from commlayer.algorithms.registry import Registry, build
from commlayer.algorithms.schedule import Schedule
from commlayer.common.topology import Topology

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
_SCHEDULES: Registry[tuple[Builder, Policy]] = Registry(
    "sparse allreduce algorithm", (*NATIVE, AUTO)
)


def register(name: str, policy: Policy) -> Callable[[B], B]:
    """Decorator: make a sparse schedule builder available under ``name``."""

    def decorate(builder: B) -> B:
        _SCHEDULES.add(name, (builder, policy))
        return builder

    return decorate


def unregister(name: str) -> None:
    """Remove sparse schedule algorithm ``name`` (ValueError if it is not one)."""
    _SCHEDULES.remove(name)


def registered(
    name: str, policy: Policy, builder: Builder
) -> contextlib.AbstractContextManager[None]:
    """``builder`` registered as ``name`` inside the block, removed after it (tests)."""
    return _SCHEDULES.temporarily(name, (builder, policy))


def generation() -> int:
    """A number that changes whenever an algorithm is registered or removed."""
    return _SCHEDULES.generation


def available() -> list[str]:
    """Every name COMMLAYER_SPARSE_ALGORITHM accepts."""
    return [AUTO, *NATIVE, *sorted(_SCHEDULES.entries)]


def exact() -> list[str]:
    """The algorithms whose result is the exact sum (``auto`` picks among these)."""
    return [*NATIVE, *sorted(n for n, (_, p) in _SCHEDULES.entries.items() if p.exact)]


def check_name(name: str) -> str:
    if name not in available():
        raise ValueError(
            f"unknown sparse allreduce algorithm {name!r}; allowed: {', '.join(available())}"
        )
    return name


def policy(name: str) -> Policy:
    return Policy(switch=True) if name in NATIVE else _SCHEDULES.entries[name][1]


def schedule(
    name: str, rank: int, size: int, numel: int, topology: Topology | None = None
) -> Schedule:
    """Rank's schedule under sparse algorithm ``name`` (one node unless ``topology`` says)."""
    if name not in _SCHEDULES.entries:
        raise ValueError(
            f"{name!r} is not a sparse schedule; schedules: {sorted(_SCHEDULES.entries)}"
        )
    return build(_SCHEDULES.entries[name][0], rank, size, numel, topology)
