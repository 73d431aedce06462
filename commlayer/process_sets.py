"""Process sets: collectives on a subset of ranks (horovod.torch's ProcessSet API)."""

from __future__ import annotations

from collections.abc import Sequence


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
        from commlayer import runtime

        self._check()
        return runtime.rank() in self.ranks

    def size(self) -> int:
        self._check()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 if not included)."""
        from commlayer import runtime

        self._check()
        me = runtime.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """All ranks; always registered with id 0."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    def _check(self) -> None:
        from commlayer import runtime

        size = runtime.size()  # raises NotInitializedError before init()
        if len(self.ranks) != size:  # rebuilt only after a new init(): this runs on every op
            self.ranks = list(range(size))

    def included(self) -> bool:
        self._check()
        return True


global_process_set: ProcessSet = _GlobalProcessSet()
