"""The registry of allreduce algorithms: names to schedule builders, the native names, and
the combining algorithms.

A plug-in module registers its builder with ``@register("name")`` (the module's own name);
``commlayer.algorithms`` imports every plug-in, so a name is known once that package is
imported. Everything else reads the registry (``available``, ``schedule``): the cost model
ranks every registered schedule and ``auto`` considers it, with no table to edit.

Every algorithm has a kind (``kinds()``, what ``commlayer algorithms --list`` prints):

- ``selection``: ``auto``, which picks one of the others per buffer size;
- ``native``: run by the backend (``native``, ``shm``);
- ``schedule``: a builder of per-rank send/receive/reduce steps (schedule.py), for every
  elementwise reduction (Sum, Average, Min, Max, Product): one of them reduces every allreduce
  of the job (COMMLAYER_ALLREDUCE_ALGORITHM);
- ``combine``: an allreduce whose operator is not elementwise, reached by its ``ReduceOp``
  (``allreduce(op=Adasum)``: adasum.py), registered with ``@register_combine(name, op)``. It
  is not a schedule: a schedule's steps add blocks of the buffer as they travel, which only an
  elementwise, associative operator allows; Adasum's pair weighs whole vectors by their dot
  product and norms, so every rank's whole tensor must be in one place first. A combine
  declares how the tensors travel (``moves``: ``"allgather"``, every rank's tensor to every
  rank) and ``combine(rows)``, run on every rank over the rows in rank order (the same bits on
  every rank). It is not a choice for COMMLAYER_ALLREDUCE_ALGORITHM (not in ``available()``),
  nor ranked by the cost model: its operator, not a setting, selects it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from commlayer.algorithms.schedule import Schedule
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology

Builder = Callable[[int, int, int, Topology], Schedule]  # (rank, size, numel, topology)
B = TypeVar("B", bound=Builder)
V = TypeVar("V")

# The backend's own allreduce (MPI_Allreduce, gloo's, NCCL's): "mpi" before it was named for
# what it is on every backend, still accepted as an alias wherever an algorithm is named.
NATIVE_ALLREDUCE = "native"
ALIASES = {"mpi": NATIVE_ALLREDUCE}
NATIVE = (NATIVE_ALLREDUCE, "shm")  # run by the backend, not as a schedule
ONE_NODE = ("shm",)  # natives that need every rank on one node
AUTO = "auto"


class Registry(Generic[V]):
    """Names to plug-in values (a builder; for sparse algorithms, with its policy), and a
    generation bumped by every change: caches keyed by an algorithm's name include it, so a
    name registered again (tests) is never answered from its predecessor's entry. The dense
    and the sparse registries are two of these."""

    __slots__ = ("entries", "generation", "_reserved", "_kind")

    def __init__(self, kind: str, reserved: tuple[str, ...]) -> None:
        self.entries: dict[str, V] = {}
        self.generation = 0
        self._reserved = reserved  # names taken by natives and auto
        self._kind = kind  # "allreduce algorithm", "sparse allreduce algorithm"

    def add(self, name: str, value: V) -> None:
        if name in self.entries or name in self._reserved:
            article = "an" if self._kind[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self._kind} named {name!r} is already registered")
        self.entries[name] = value
        self.generation += 1

    def remove(self, name: str) -> None:
        if self.entries.pop(name, None) is None:
            what = self._kind.replace("allreduce algorithm", "schedule algorithm")
            raise ValueError(f"{name!r} is not a registered {what}")
        self.generation += 1

    @contextlib.contextmanager
    def temporarily(self, name: str, value: V) -> Iterator[None]:
        """``value`` registered as ``name`` inside the block, removed after it (tests)."""
        self.add(name, value)
        try:
            yield
        finally:
            self.remove(name)


_SCHEDULES: Registry[Builder] = Registry("allreduce algorithm", (*NATIVE, *ALIASES, AUTO))

ALLGATHER = "allgather"  # a combine's ``moves``: every rank's tensor to every rank


@dataclass(frozen=True)
class Combine:
    """A combining allreduce (module docstring): the ``op`` that selects it, how the ranks'
    tensors travel (``moves``), and ``combine``: the rows of every rank's flat tensor, in rank
    order, to the result (one flat tensor of the rows' dtype). ``floating_only``: it refuses
    other dtypes."""

    name: str
    op: ReduceOp
    moves: str
    combine: Callable[[torch.Tensor], torch.Tensor]
    floating_only: bool = True


C = TypeVar("C", bound=Callable[[torch.Tensor], torch.Tensor])
_COMBINES: Registry[Combine] = Registry("combine algorithm", (*NATIVE, *ALIASES, AUTO))


def register(name: str) -> Callable[[B], B]:
    """Decorator: make a schedule builder available under ``name``."""

    def decorate(builder: B) -> B:
        _taken(name, _COMBINES, "combine")
        _SCHEDULES.add(name, builder)
        return builder

    return decorate


def register_combine(
    name: str, op: ReduceOp, moves: str = ALLGATHER, floating_only: bool = True
) -> Callable[[C], C]:
    """Decorator: make ``combine(rows)`` the combining allreduce ``name``, the one that
    ``allreduce(op=op)`` runs (module docstring)."""
    if moves != ALLGATHER:
        raise ValueError(f"combine {name!r}: moves={moves!r}; allowed: {ALLGATHER!r}")
    if op in (entry.op for entry in _COMBINES.entries.values()):
        raise ValueError(f"{op.name} already has a combining allreduce algorithm")

    def decorate(combine: C) -> C:
        _taken(name, _SCHEDULES, "schedule")
        _COMBINES.add(name, Combine(name, op, moves, combine, floating_only))
        return combine

    return decorate


def _taken(name: str, other: Registry[V], kind: str) -> None:
    """ValueError where ``name`` is already an algorithm of the other registry (one name, one
    algorithm, whatever its kind)."""
    if name in other.entries:
        raise ValueError(f"a {kind} algorithm named {name!r} is already registered")


def unregister_combine(name: str) -> None:
    """Remove combining algorithm ``name`` (ValueError if it is not one)."""
    _COMBINES.remove(name)


def combining(op: ReduceOp) -> Combine | None:
    """The combining allreduce algorithm that ``allreduce(op=op)`` runs; None for an
    elementwise operator (a schedule or the backend reduces it)."""
    for entry in _COMBINES.entries.values():
        if entry.op == op:
            return entry
    return None


def combining_ops() -> tuple[ReduceOp, ...]:
    """The operators a combining algorithm is registered for (allreduce only)."""
    return tuple(entry.op for entry in _COMBINES.entries.values())


def kinds() -> dict[str, str]:
    """Every algorithm's name to its kind (module docstring), in ``available()``'s order and
    the combines after them; sparse algorithms are in their own registry (algorithms/sparse)."""
    found = {AUTO: "selection", **dict.fromkeys(NATIVE, "native")}
    found.update(dict.fromkeys(sorted(_SCHEDULES.entries), "schedule"))
    found.update(dict.fromkeys(sorted(_COMBINES.entries), "combine"))
    return found


def unregister(name: str) -> None:
    """Remove schedule algorithm ``name`` (ValueError if it is not one)."""
    _SCHEDULES.remove(name)


def registered(name: str, builder: Builder) -> contextlib.AbstractContextManager[None]:
    """``builder`` registered as ``name`` inside the block, removed after it (tests)."""
    return _SCHEDULES.temporarily(name, builder)


def generation() -> int:
    """A number that changes whenever an algorithm is registered or removed."""
    return _SCHEDULES.generation


def schedules() -> list[str]:
    """The registered schedule algorithms, sorted."""
    return sorted(_SCHEDULES.entries)


def available() -> list[str]:
    """Every algorithm's name (COMMLAYER_ALLREDUCE_ALGORITHM also accepts the ``ALIASES``)."""
    return [AUTO, *NATIVE, *sorted(_SCHEDULES.entries)]


def canonical(name: str) -> str:
    """The algorithm's name for ``name``, an alias (``mpi``: ``native``) or a name."""
    return ALIASES.get(name, name)


def accepted() -> list[str]:
    """Every name an algorithm may be given by: ``available()`` and the aliases."""
    return [*available(), *ALIASES]


def schedule(
    name: str, rank: int, size: int, numel: int, topology: Topology | None = None
) -> Schedule:
    """Rank's schedule under algorithm ``name`` for a buffer of ``numel`` elements (one node
    unless ``topology`` says otherwise)."""
    builder = _SCHEDULES.entries.get(name)
    if builder is None:
        raise ValueError(
            f"{name!r} is not a schedule algorithm; schedules: {', '.join(schedules())}"
        )
    return build(builder, rank, size, numel, topology)


def build(
    builder: Builder, rank: int, size: int, numel: int, topology: Topology | None
) -> Schedule:
    """``builder``'s schedule for ``rank`` (dense or sparse: the checks both registries make):
    nothing to do alone or for an empty buffer; one node unless ``topology`` says otherwise."""
    if size == 1 or numel == 0:
        return []
    topology = topology or Topology.flat(size)
    if topology.size != size:
        raise ValueError(f"topology of {topology.size} ranks for a group of {size}")
    return builder(rank, size, numel, topology)


def check_name(name: str) -> str:
    """The algorithm's name for ``name`` (an alias made its name); ValueError if unknown."""
    found = canonical(name)
    if found not in available():
        raise ValueError(f"unknown allreduce algorithm {name!r}; allowed: {', '.join(available())}")
    return found
