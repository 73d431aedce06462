"""Process sets: collectives on a subset of ranks (horovod.torch's ProcessSet API), and the
engine's table of the registered ones (``SetTable``: id, ranks, backend, negotiator)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from commlayer.common.errors import NotInitializedError

if TYPE_CHECKING:  # the engine's types; this module imports nothing of the runtime
    from commlayer.backends.base import Backend
    from commlayer.core.negotiation import Negotiator, Registration

# (rank, size) of this process in the running job, told by runtime.init() and cleared by
# shutdown(): the sets answer rank() and included() without importing the runtime above them.
_world: tuple[int, int] | None = None


def bind(world: tuple[int, int] | None) -> None:
    """Set (``init``) or clear (``shutdown``) this process's (rank, size)."""
    global _world
    _world = world


def _this_process() -> tuple[int, int]:
    if _world is None:
        raise NotInitializedError(
            "commlayer has not been initialized; call commlayer.init() first (or it was shut down)"
        )
    return _world


class ProcessSet:
    """A subset of ranks. Register it with ``init(process_sets=[...])`` or ``add_process_set``
    (both collective over all ranks) before passing it as ``process_set=``."""

    def __init__(self, ranks: Sequence[int]) -> None:
        values = [int(r) for r in ranks]
        if len(set(values)) != len(values) or any(r < 0 for r in values):
            raise ValueError(f"process set ranks must be distinct non-negative ints, got {ranks!r}")
        self.ranks: list[int] = sorted(values)
        self.process_set_id: int | None = None

    def _check(self) -> None:
        if self.process_set_id is None:
            raise ValueError(
                f"{self!r} is not registered: pass it to commlayer.init(process_sets="
                "[...]) or commlayer.add_process_set() on every rank first"
            )

    def included(self) -> bool:
        """Whether this process belongs to the set."""
        self._check()
        return _this_process()[0] in self.ranks

    def size(self) -> int:
        self._check()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 if not included)."""
        self._check()
        me = _this_process()[0]
        return self.ranks.index(me) if me in self.ranks else -1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def check_ranks(ps: ProcessSet, size: int) -> None:
    """ValueError unless ``ps`` is a non-empty subset of the job's ``size`` ranks."""
    bad = [r for r in ps.ranks if r >= size]
    if bad or not ps.ranks:
        raise ValueError(
            f"process set ranks {ps.ranks!r} must be a non-empty subset of [0, {size})"
        )


class _GlobalProcessSet(ProcessSet):
    """All ranks; always registered with id 0."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    def _check(self) -> None:
        size = _this_process()[1]  # raises NotInitializedError before init()
        if len(self.ranks) != size:  # rebuilt only after a new init(): this runs on every op
            self.ranks = list(range(size))

    def included(self) -> bool:
        self._check()
        return True


global_process_set: ProcessSet = _GlobalProcessSet()


@dataclasses.dataclass
class SetState:
    """A registered process set as the engine keeps it: its ranks and, where this rank belongs
    to it, its backend (split off the job's) and negotiator; both None elsewhere."""

    ranks: tuple[int, ...]
    backend: Backend
    negotiator: Negotiator


class SetTable:
    """The engine's registered process sets by id, given in registration order (the same on
    every rank: registration is collective): 0 is the job's. Registered at start-up
    (``split``, before the engine thread runs) or later by a REGISTER operation the engine
    negotiated (``apply``). ``negotiator`` makes a set's negotiator from its backend."""

    def __init__(self, negotiator: Callable[[Backend], Negotiator]) -> None:
        self.sets: dict[int, SetState] = {}
        self._next_id = 0
        self._negotiator = negotiator

    def add(self, ranks: tuple[int, ...], backend: Backend | None) -> tuple[int, SetState]:
        """Register a set with this backend (None where this rank is not in it)."""
        set_id = self._next_id
        self._next_id += 1
        negotiator = self._negotiator(backend) if backend else None
        state = SetState(ranks, backend, negotiator)  # type: ignore[arg-type]
        self.sets[set_id] = state
        return set_id, state

    def split(self, parent: Backend, ranks: Sequence[int]) -> tuple[int, Backend | None]:
        """Collective over ``parent``'s ranks: split off a process set and register it."""
        backend = parent.split(list(ranks))
        set_id, _ = self.add(tuple(ranks), backend)
        return set_id, backend

    def apply(self, parent: Backend, change: Registration) -> int:
        """A negotiated registration (collective over ``parent``'s ranks): add the set (its
        id) or remove one (-1; its backend closed)."""
        if change.removed is not None:
            removed = self.sets.pop(change.removed, None)
            if removed is not None and removed.backend is not None:
                removed.backend.close()
            return -1
        return self.split(parent, change.ranks)[0]

    def members(self) -> list[SetState]:
        """The sets this rank belongs to, by id."""
        return [s for _, s in sorted(self.sets.items()) if s.negotiator is not None]
