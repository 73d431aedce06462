"""Negotiation: agree, every cycle, on which named operations all ranks of a set have submitted.

1. Every rank adds one bit vector to a bitwise-AND allreduce (``Backend.icontrol``): a "have"
   bit per cached operation, its complement (so AND also yields "some rank has it", for stall
   reports), OR-flags stored inverted (uncached news, shutdown, stall report), and one joined bit
   and one shutdown bit per rank. Steady state (same names every step) costs only this
   ~300-byte allreduce: no names cross the wire.
2. A rank with operations not in the cache announces them once (name, kind, dtype, shapes, op,
   root, splits; a process set's registration its ``Registration``); when any rank has news,
   all ranks allgather the announcements and update the same table. Every rank therefore holds
   identical state and makes identical decisions.
3. An operation is ready when every rank that has not joined submitted it. Ready operations are
   validated (a mismatch becomes an error response on every rank), given a cache slot (LRU,
   identical on all ranks) and returned in one order all ranks share: cached slots in slot order,
   then new ones in announcement order.
4. An operation some ranks have and others do not for ``stall_check_time_s`` raises the stall
   flag; the next cycle exchanges pending names, every rank logs which ranks are missing, and
   after ``stall_shutdown_time_s`` the operation fails with StallError on the ranks holding it
   and every rank of the set reports it (``CycleResult.stalled``): the engine stops on all.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from commlayer.backends.base import Backend, Request
from commlayer.common.errors import CommlayerError, StallError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core.planned import LaneSpec

log = logging.getLogger("commlayer")

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
REGISTER = "process_set"  # add/remove a process set (its Registration): negotiated like a barrier
# a shared-memory window for DistributedOptimizer's planned buckets (backends/shm.py's
# BucketWindow), its bytes a rank as the shape: negotiated like a barrier, made by every rank
WINDOW = "window"

_F_NEWS, _F_SHUTDOWN, _F_STALL = 1, 2, 4
_WORD_ONES = (1 << 64) - 1


def _bits(mask: int) -> list[int]:
    """Positions of the set bits of ``mask``, ascending."""
    found = []
    while mask:
        low = mask & -mask
        found.append(low.bit_length() - 1)
        mask ^= low
    return found


@dataclasses.dataclass(frozen=True)
class Registration:
    """What a REGISTER operation changes, the same on every rank: the process set of ``ranks``
    (global ranks, ascending) added, the one with id ``removed`` taken out, or a planned
    ``lane`` opened on the operation's process set."""

    ranks: tuple[int, ...] = ()
    removed: int | None = None
    lane: LaneSpec | None = None  # or a plan's lane opened on the set (core/planned.py)

    def __repr__(self) -> str:  # as a disagreement names it
        if self.lane is not None:
            return repr(self.lane)
        if self.removed is not None:
            return f"remove process set {self.removed}"
        return f"add process set of ranks {list(self.ranks)}"


@dataclasses.dataclass(frozen=True)
class Announce:
    """What one rank says of one operation: everything other ranks must agree with or know."""

    name: str
    kind: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    op: int = 0
    root: int = -1
    splits: tuple[int, ...] | None = None
    # what carries the data where every rank must use the same (device.Path.channel: "nccl"
    # for CUDA tensors over the torch backend's NCCL group); "" for the backend's default
    channel: str = ""
    registration: Registration | None = None  # a REGISTER operation's change; None otherwise


@dataclasses.dataclass(frozen=True)
class Response:
    """An operation every rank executes identically (or fails identically, when ``error``)."""

    name: str
    kind: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    op: int
    root: int
    dim0: tuple[int, ...]  # first dimension of every rank's tensor (allgather, alltoall)
    splits: tuple[tuple[int, ...], ...]  # alltoall: splits[q][r] rows from rank q to rank r
    error: str | None = None
    channel: str = ""  # Announce.channel, the same on every rank
    registration: Registration | None = None  # Announce.registration, the same on every rank

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (memoized: it is computed for every submitted operation)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def plain(value: Any) -> str:
    """A value as a user reads it in an error: one tensor's shape ``((3,),)`` as ``[3]``, a
    group's as ``[3], [4, 2]``, a scalar shape as ``[]``, dimension counts ``(1,)`` as ``1``;
    anything else as its repr ('float32')."""
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) for v in value):
        shapes = ["[" + ", ".join(map(str, shape)) + "]" for shape in value]
        return ", ".join(shapes) if len(shapes) == 1 else "(" + ", ".join(shapes) + ")"
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        return str(value[0]) if len(value) == 1 else "(" + ", ".join(map(str, value)) + ")"
    return repr(value)


def _disagreement(field: str, per_rank: dict[int, Any]) -> str | None:
    values = set(per_rank.values())
    if len(values) <= 1:
        return None
    shown = ", ".join(f"rank {r}: {plain(v)}" for r, v in sorted(per_rank.items()))
    return f"{field} differs across ranks ({shown})"


def _op_name(op: int) -> str:
    try:
        return ReduceOp(op).name
    except ValueError:
        return f"unknown op {op}"


def joined_error(
    rank: int, kind: str, name: str, joined: Iterable[int], join_mode: str
) -> CommlayerError:
    """The error of an operation that cannot run while ``joined`` ranks have joined."""
    return CommlayerError(
        f"rank {rank}: {kind} {name!r} cannot run while ranks {sorted(joined)} have joined "
        f"(join_mode={join_mode})"
    )


def build_response(name: str, announced: dict[int, Announce], size: int) -> Response:
    """Validate what every rank announced for ``name`` and describe the operation to run."""
    first = announced[min(announced)]
    kind = first.kind
    checks: list[tuple[str, Callable[[Announce], Any]]] = [
        ("operation", lambda a: a.kind),
        ("dtype", lambda a: a.dtype),
        ("data channel", lambda a: a.channel or "host"),
    ]
    if kind in (ALLREDUCE, REDUCESCATTER):
        checks.append(("reduce op", lambda a: _op_name(a.op)))
    if kind == BROADCAST:
        checks.append(("root rank", lambda a: a.root))
    if kind == REGISTER:
        checks.append(("process set change", lambda a: a.registration))
    if kind in (ALLGATHER, ALLTOALL):
        checks.append(("number of dimensions", lambda a: tuple(len(s) for s in a.shapes)))
        checks.append(("shape after the first dimension", lambda a: tuple(s[1:] for s in a.shapes)))
    else:
        checks.append(("shape", lambda a: a.shapes))
    for field, get in checks:
        problem = _disagreement(field, {r: get(a) for r, a in announced.items()})
        if problem:
            return _error_response(name, first, f"{first.kind} {name!r}: {problem}")
    if kind == BROADCAST and not 0 <= first.root < size:
        return _error_response(
            name, first, f"broadcast {name!r}: root rank {first.root} is not in [0, {size})"
        )
    dim0 = tuple(
        announced[r].shapes[0][0]
        if r in announced and announced[r].shapes and announced[r].shapes[0]
        else 0
        for r in range(size)
    )
    splits: tuple[tuple[int, ...], ...] = ()
    if kind == ALLTOALL:
        splits = tuple(
            announced[r].splits or (0,) * size if r in announced else (0,) * size
            for r in range(size)
        )
    return Response(
        name, kind, first.dtype, first.shapes, first.op, first.root, dim0, splits,
        channel=first.channel, registration=first.registration,
    )  # fmt: skip


def _error_response(name: str, first: Announce, message: str) -> Response:
    return Response(
        name, first.kind, first.dtype, first.shapes, first.op, first.root, (), (), error=message,
        registration=first.registration,
    )  # fmt: skip


class ResponseCache:
    """name -> (slot, response), least recently used evicted first; identical on all ranks."""

    __slots__ = ("capacity", "_slot_of", "by_slot", "_free", "high_water")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # in LRU order
        self.by_slot: list[Response | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self.high_water = 0  # slots ever used; the bit vector covers only these

    def get(self, name: str) -> tuple[int, Response] | None:
        slot = self._slot_of.get(name)
        if slot is None:
            return None
        response = self.by_slot[slot]
        assert response is not None
        return slot, response

    def touch(self, name: str) -> None:
        self._slot_of.move_to_end(name)

    def put(self, response: Response) -> int:
        if not self._free:
            _, slot = self._slot_of.popitem(last=False)
            self.by_slot[slot] = None
            self._free.append(slot)
        slot = self._free.pop()
        self.high_water = max(self.high_water, slot + 1)
        self._slot_of[response.name] = slot
        self.by_slot[slot] = response
        return slot

    def evict(self, name: str) -> None:
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.by_slot[slot] = None
            self._free.append(slot)


@dataclasses.dataclass
class Pending:
    """A locally submitted operation waiting for the others (the engine's object is ``item``)."""

    announce: Announce
    item: Any
    announced: bool = False
    cycles: int = 0


@dataclasses.dataclass
class CycleResult:
    ready: list[tuple[Response, Any]]  # (response, local item or None when this rank joined)
    failed: list[tuple[Any, Exception]]
    joined: frozenset[int]
    all_joined_last: int | None  # set when every rank has joined: the last to join
    shutdown_ranks: tuple[int, ...]
    # what failed for a stall this cycle, the same on every rank of the set ("allreduce 'x'
    # stalled: submitted by ranks [0], never by ranks [1] within 600 s (...)")
    stalled: list[str] = dataclasses.field(default_factory=list)


class Negotiator:
    """Negotiation state of one process set on one rank."""

    def __init__(
        self,
        backend: Backend,
        cache_capacity: int,
        stall_check_s: float,
        stall_shutdown_s: float,
        wait: Callable[[Request], None],
        refused_while_joined: Sequence[str] = (),
        join_mode: str = "horovod",
    ) -> None:
        """``refused_while_joined``: kinds that fail, on every rank alike, as soon as a rank has
        joined, instead of waiting for every active rank to submit them: after a join the
        ranks' unnamed operations are numbered differently (they made different calls), so
        waiting could be for ever. ``join_mode`` is named in their errors."""
        self.backend = backend
        self._refused_while_joined = frozenset(refused_while_joined)
        self._join_mode = join_mode
        self.size = backend.size
        self.rank = backend.rank
        self.cache = ResponseCache(cache_capacity)
        self.pending: OrderedDict[str, Pending] = OrderedDict()
        self.table: OrderedDict[str, dict[int, Announce]] = OrderedDict()
        self.joined = False
        self.shutting_down = False
        self._wait = wait
        self._stall_check_s = stall_check_s
        self._stall_shutdown_s = stall_shutdown_s
        self._partial_since: dict[str, float] = {}
        self._stall_reported: set[str] = set()
        self._join_cycle: dict[int, int] = {}
        self._cycle = 0
        self._rank_words = (self.size + 63) // 64

    def add(self, announce: Announce, item: Any) -> None:
        self.pending[announce.name] = Pending(announce, item)

    def has_work(self) -> bool:
        return bool(self.pending) or self.joined

    # -- one cycle -------------------------------------------------------------------------
    def cycle(self) -> CycleResult:
        self._cycle += 1
        now = time.monotonic()
        hits: list[int] = []
        news: list[Announce] = []
        for p in self.pending.values():
            entry = self.cache.get(p.announce.name)
            if entry is not None and self._matches(entry[1], p.announce):
                hits.append(entry[0])
            elif not p.announced:
                news.append(p.announce)
                p.announced = True
        slots = self.cache.high_water  # identical on every rank: the cache is
        vector = self._encode(hits, slots, bool(news), now)
        self._wait(self.backend.icontrol(vector))
        have, anyone, flags, joined, shut = self._decode(vector, slots)
        result = CycleResult([], [], joined, None, shut)
        self._track_joins(joined)
        active = [r for r in range(self.size) if r not in joined]
        if active:
            for slot in _bits(have & anyone):
                response = self.cache.by_slot[slot]
                assert response is not None, f"rank {self.rank}: ready slot {slot} is empty"
                self._take(response, result)
        if flags & _F_NEWS:
            self._merge_news(news)
        for name in [n for n, ranks in self.table.items() if active and set(active) <= set(ranks)]:
            response = build_response(name, self.table.pop(name), self.size)
            if response.error is None and self.cache.capacity:
                self.cache.put(response)
            self._take(response, result)
        if joined and active and self._refused_while_joined:
            self._refuse_while_joined(joined, result)
        if flags & _F_STALL:
            self._exchange_stalls(now, result)
        self._note_partials(anyone, now)
        if active == [] and self.size and joined:
            result.all_joined_last = max(self._join_cycle, key=lambda r: (self._join_cycle[r], r))
            self._join_cycle.clear()
            self.joined = False
        return result

    def _matches(self, response: Response, mine: Announce) -> bool:
        return (
            response.kind == mine.kind
            and response.dtype == mine.dtype
            and response.channel == mine.channel
            and response.op == mine.op
            and response.root == mine.root
            and response.registration == mine.registration
            and (
                response.shapes == mine.shapes
                if mine.kind not in (ALLGATHER, ALLTOALL)
                else response.dim0[self.rank] == (mine.shapes[0][0] if mine.shapes[0] else 0)
                and response.shapes[0][1:] == mine.shapes[0][1:]
                and (mine.splits is None or response.splits[self.rank] == mine.splits)
            )
        )

    def _encode(self, hits: list[int], slots: int, news: bool, now: float) -> np.ndarray:
        """The vector as one Python integer, word 0 in the low bits, then its bytes: big-int
        bit operations cost ~1 us where the numpy version's dozen calls on tiny arrays cost
        ~40 us per cycle on the 2-core machine (measured with a 1-element allreduce)."""
        cw, rw = (slots + 63) // 64, self._rank_words
        cache_ones, rank_ones = (1 << 64 * cw) - 1, (1 << 64 * rw) - 1
        if self.joined:
            have = not_have = cache_ones  # a joined rank agrees to everything
        else:
            have = 0
            for slot in hits:
                have |= 1 << slot
            not_have = cache_ones ^ have
        flags = (_F_NEWS if news else 0) | (_F_SHUTDOWN if self.shutting_down else 0)
        flags |= _F_STALL if self._stall_due(now) else 0
        me = 1 << self.rank
        joined = rank_ones ^ me if self.joined else rank_ones
        shut = rank_ones ^ me if self.shutting_down else rank_ones
        value = (
            have
            | not_have << 64 * cw
            | (_WORD_ONES ^ flags) << 128 * cw
            | joined << 128 * cw + 64
            | shut << 128 * cw + 64 + 64 * rw
        )
        data = bytearray(value.to_bytes(8 * (2 * cw + 1 + 2 * rw), "little"))
        return np.frombuffer(data, dtype=np.uint64)  # writable: icontrol reduces in place

    def _decode(
        self, vector: np.ndarray, slots: int
    ) -> tuple[int, int, int, frozenset[int], tuple[int, ...]]:
        """(have, anyone) as bit masks over cache slots, flags, joined and shut-down ranks."""
        cw, rw = (slots + 63) // 64, self._rank_words
        value = int.from_bytes(vector.tobytes(), "little")
        slot_ones, rank_ones = (1 << slots) - 1, (1 << self.size) - 1
        have = value & slot_ones
        anyone = ~(value >> 64 * cw) & slot_ones
        flags = ~(value >> 128 * cw) & _WORD_ONES
        joined = ~(value >> 128 * cw + 64) & rank_ones
        shut = ~(value >> 128 * cw + 64 + 64 * rw) & rank_ones
        return have, anyone, flags, frozenset(_bits(joined)), tuple(_bits(shut))

    def _take(self, response: Response, result: CycleResult) -> None:
        """Move a ready response and this rank's pending item (if any) into the result."""
        if response.error is None and self.cache.get(response.name):
            self.cache.touch(response.name)
        pending = self.pending.pop(response.name, None)
        self._partial_since.pop(response.name, None)
        self._stall_reported.discard(response.name)
        result.ready.append((response, pending.item if pending else None))

    def _merge_news(self, mine: list[Announce]) -> None:
        request, payloads = self.backend.iallgather_bytes(pickle.dumps(mine))
        self._wait(request)
        for rank, payload in enumerate(payloads):
            for announce in pickle.loads(payload):
                # A cached name announced again changed signature on `rank`: evict it; ranks
                # holding it as a cache hit announce it next cycle (it is no longer a hit).
                self.cache.evict(announce.name)
                self.table.setdefault(announce.name, {})[rank] = announce

    def _refuse_while_joined(self, joined: frozenset[int], result: CycleResult) -> None:
        """Fail what cannot run while ``joined`` ranks have joined and is not ready this cycle.
        The table and the joined set are the same on every rank in every cycle, so each rank
        fails its own pending operations of those kinds here, now or when it submits them."""
        refused = self._refused_while_joined
        for name in [n for n, by in self.table.items() if next(iter(by.values())).kind in refused]:
            del self.table[name]
        for name, pending in list(self.pending.items()):
            kind = pending.announce.kind
            if kind not in refused:
                continue
            del self.pending[name]
            self._partial_since.pop(name, None)
            self._stall_reported.discard(name)
            error = joined_error(self.rank, kind, name, joined, self._join_mode)
            result.failed.append((pending.item, error))

    def _track_joins(self, joined: frozenset[int]) -> None:
        for rank in joined:
            self._join_cycle.setdefault(rank, self._cycle)

    # -- stalls ----------------------------------------------------------------------------
    def _note_partials(self, anyone: int, now: float) -> None:
        if self._stall_check_s <= 0 and self._stall_shutdown_s <= 0:
            return
        partial = set(self.table)
        for slot in _bits(anyone):
            response = self.cache.by_slot[slot]
            if response is not None:
                partial.add(response.name)
        for name in list(self._partial_since):
            if name not in partial:
                del self._partial_since[name]
                self._stall_reported.discard(name)
        for name in partial:
            self._partial_since.setdefault(name, now)

    def _overdue(self, now: float, limit_s: float) -> list[str]:
        if limit_s <= 0:
            return []
        return [n for n, since in self._partial_since.items() if now - since >= limit_s]

    def _stall_due(self, now: float) -> bool:
        unreported = set(self._overdue(now, self._stall_check_s)) - self._stall_reported
        return bool(unreported or self._overdue(now, self._stall_shutdown_s))

    def _exchange_stalls(self, now: float, result: CycleResult) -> None:
        """Every rank shares its pending names and overdue ones; all log and fail alike."""
        mine = (
            sorted(self.pending),
            self._overdue(now, self._stall_check_s),
            self._overdue(now, self._stall_shutdown_s),
        )
        request, payloads = self.backend.iallgather_bytes(pickle.dumps(mine))
        self._wait(request)
        reports = [pickle.loads(p) for p in payloads]
        holders: dict[str, list[int]] = {}
        for rank, (names, _, _) in enumerate(reports):
            for name in names:
                holders.setdefault(name, []).append(rank)

        def missing(name: str) -> list[int]:
            return [r for r in range(self.size) if r not in holders.get(name, [])]

        for name in sorted({n for _, late, _ in reports for n in late} - self._stall_reported):
            self._stall_reported.add(name)
            log.warning(
                "commlayer stall on rank %d: %r was submitted by ranks %s but not by ranks %s "
                "for %g s (COMMLAYER_STALL_CHECK_TIME_SECONDS)",
                self.rank,
                name,
                holders.get(name, []),
                missing(name),
                self._stall_check_s,
            )
        for name in sorted({n for _, _, late in reports for n in late}):
            what = (
                f"{self._kind_of(name)} {name!r} stalled: submitted by ranks "
                f"{holders.get(name, [])}, never by ranks {missing(name)} within "
                f"{self._stall_shutdown_s:g} s (COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS)"
            )
            result.stalled.append(what)
            self.table.pop(name, None)
            self._partial_since.pop(name, None)
            self._stall_reported.discard(name)
            pending = self.pending.pop(name, None)
            if pending is not None:
                result.failed.append((pending.item, StallError(f"rank {self.rank}: {what}")))

    def _kind_of(self, name: str) -> str:
        """What kind of operation ``name`` is, on any rank of the set (for a rank that never
        submitted it: from the others' announcements, or the cache)."""
        pending = self.pending.get(name)
        if pending is not None:
            return pending.announce.kind
        announced = self.table.get(name)
        if announced:
            return next(iter(announced.values())).kind
        cached = self.cache.get(name)
        return cached[1].kind if cached else "operation"

    def fail_all(self) -> list[Any]:
        """Drop every pending operation (engine stopping); return their items."""
        items = [p.item for p in self.pending.values()]
        self.pending.clear()
        self.table.clear()
        return items


def shapes_of(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors)
