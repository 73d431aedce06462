"""Process sets: collectives on a subset of ranks (horovod.torch's ProcessSet API)."""

from __future__ import annotations

from collections.abc import Sequence

from commlayer.common.errors import NotInitializedError

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
