"""Planned lanes: a plan's buckets reduced in plan order on a communicator of their own, with
no negotiation (COMMLAYER_PLANNED_SKIP_NEGOTIATION; docs/planned_lanes.md has the design).

DistributedOptimizer's planned buckets are the same on every rank, in the same order, every
step (comm/bucketer.py): negotiating them each cycle only re-proves that. A lane skips it:

1. **Opened collectively.** At the plan, every rank of the process set submits one REGISTER
   operation whose registration carries the plan's :class:`LaneSpec` (each part's gradient
   elements and dtype): negotiation checks that every rank registers the same plan, and the
   engine, executing it in the negotiated order, splits a communicator off the set's
   (``Backend.split``), makes what the algorithms would make with a blocking collective at
   their first call (``Allreducer.prepare``: the shared-memory window, hierarchical's
   communicators) and reduces a zero buffer of every part size once (``Lanes.open``), in a
   negotiated operation every rank runs, so that nothing the lane does later blocks.
2. **Plan order, nonblocking.** A planned part's operation takes the lane position
   ``round * n + index`` (``n`` parts; ``round``: how many times this rank submitted that part
   before). Positions are posted in increasing order as they are submitted (a part ready
   early waits for the ones before it, as DDP's buckets do), with the engine's allreduce
   (the algorithm ``auto`` picks, the window included); a request that must run alone (a
   schedule, the window, a measured call: ``Allreducer.runs_alone``) is posted once nothing
   else of the lane is in flight. Every rank posts the same sequence, so collectives on the
   lane's communicator match by position, whatever the negotiation does meanwhile on the
   set's own communicator.
3. **Never blocked on.** The engine tests the lane's requests in its idle loop and inside
   every wait (``Engine._wait``): one engine thread blocked on the lane while a peer's waits
   for its negotiation (or the reverse) would deadlock; here each progresses inside the
   other's wait.
4. **Checked every reduction, zero extra rounds.** The part's flat buffer has a tail of
   ``TAIL`` elements per rank after the gradients; each rank writes its slot only (present,
   lane epoch, the optimizer's step since the plan, index + 1, or 0 where the part could not
   be sent planned), the others are zeros, so the reduced tail holds every rank's codes
   exactly (a sum of one value and zeros) and every rank decodes the same bits: a rank whose
   codes differ fails the operation on every rank alike with an error naming the ranks
   (``disagreement``).
5. **Joins close the lane.** A joined rank posts nothing of its own. At the first cycle of
   the global set in which a rank has joined (every rank sees it in the same cycle), the
   ranks exchange how far each posted every lane; each lane is then frozen at the furthest
   position: the ranks that have not joined post their parts up to it, a joined rank posts
   zeros (present 0: Average divides as the engine does, by ``size()`` or, with
   join_mode=active, by the ranks present), and from there every planned operation of that
   lane is negotiated as any other. Once every rank has joined, new lanes may open again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from commlayer.backends.base import Backend, Request
from commlayer.common.errors import CommlayerError, TensorMismatchError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import fusion

log = logging.getLogger("commlayer")

TAIL = 4  # check elements per rank: present, epoch, step, index + 1 (0: not planned)
POISON = 0  # the index code of a part this rank could not send as planned
# A poisoned slot's step code: the dtype this rank's gradients had instead of the plan's (its
# index here), 0 where a gradient's shape or device changed (``changed_code``).
CHANGED_DTYPES: tuple[torch.dtype | None, ...] = (
    None, torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip


def changed_code(dtype: torch.dtype | None) -> int:
    """The ``step`` a rank sends a part with when it could not send it as planned: negative,
    naming ``dtype`` (the gradients' dtype now) where it is a floating one, else a shape or
    device change (``codes``; every rank's error then names it)."""
    code = CHANGED_DTYPES.index(dtype) if dtype in CHANGED_DTYPES else 0
    return -1 - code


@dataclasses.dataclass(frozen=True)
class LaneSpec:
    """A plan's lane, the same on every rank (a REGISTER operation's): each part's gradient
    elements (the tail not counted) and dtype name, in plan order, and the reduce op (a
    lane's operations are not negotiated: the op is agreed here, once)."""

    parts: tuple[tuple[int, str], ...]
    op: int = int(ReduceOp.Sum)

    def __repr__(self) -> str:  # as a disagreement names it
        return (
            f"planned lane of {len(self.parts)} parts {list(self.parts)}, {ReduceOp(self.op).name}"
        )


def tail_numel(size: int) -> int:
    """Elements a planned part's flat buffer holds after its gradients, over ``size`` ranks."""
    return TAIL * size


def modulus(dtype: torch.dtype) -> int:
    """Codes are taken modulo this, so that each is an integer ``dtype`` holds exactly (a
    code travels alone in its slot: summed with zeros only)."""
    if dtype == torch.bfloat16:
        return 1 << 8
    if dtype == torch.float16:
        return 1 << 11
    if dtype == torch.float32:
        return 1 << 24
    return 1 << 30


def codes(epoch: int, step: int, index: int, dtype: torch.dtype) -> tuple[int, ...]:
    """This rank's slot for a part: present, epoch, step, index + 1 (``POISON`` where
    ``step`` is negative: the part could not be sent as planned; the step's place then holds
    what changed, ``changed_code``)."""
    m = modulus(dtype)
    if step < 0:
        return (1, epoch % m, (-1 - step) % m, POISON)
    return (1, epoch % m, step % m, (index % (m - 1)) + 1)


def write_tail(tail: torch.Tensor, rank: int, slot: Sequence[int]) -> None:
    """Zeros, and ``slot`` in this rank's place."""
    tail.zero_()
    tail[TAIL * rank : TAIL * rank + TAIL] = torch.tensor(slot, dtype=tail.dtype)


def read_tail(tail: torch.Tensor, size: int) -> list[tuple[int, ...] | None]:
    """Every rank's slot of a reduced tail (raw sums, before any scaling); None where a rank
    was not present (joined: it posted zeros). A slot that is not whole numbers reads as
    present 0.5: what no rank writes (``disagreement`` names it)."""
    values = tail.double().tolist()
    found: list[tuple[int, ...] | None] = []
    for r in range(size):
        raw = values[TAIL * r : TAIL * r + TAIL]
        slot = tuple(int(round(v)) for v in raw)
        if any(abs(v - round(v)) > 1e-3 for v in raw):
            slot = (-1, *slot[1:])
        found.append(None if slot == (0,) * TAIL else slot)
    return found


def disagreement(
    name: str, slots: list[tuple[int, ...] | None], planned: torch.dtype | None = None
) -> str | None:
    """What differs among the present ranks' slots (the same words on every rank, as every
    rank reads the same tail), naming the ranks; None when they agree. ``planned``: the
    part's dtype in the plan (named beside a rank's changed one)."""
    present = {r: s for r, s in enumerate(slots) if s is not None}
    garbled = sorted(r for r, s in present.items() if s[0] != 1)
    if garbled:
        return (
            f"planned bucket {name!r}: the check values of rank(s) {garbled} are not what any "
            "rank writes: the ranks reduced different buffers together (their lanes are out of "
            "step)"
        )
    poisoned = sorted(r for r, s in present.items() if s[3] == POISON)
    if poisoned:
        plan = f"; the plan's are {str(planned).removeprefix('torch.')}" if planned else ""
        changes = []
        for r in poisoned:
            code = present[r][2]
            if 0 < code < len(CHANGED_DTYPES):
                dtype = str(CHANGED_DTYPES[code]).removeprefix("torch.")
                changes.append(f"rank {r}: its gradients are {dtype} now{plan}")
            else:
                changes.append(f"rank {r}: a gradient's shape or device changed")
        return (
            f"planned bucket {name!r}: rank(s) {poisoned} could not send it as planned since "
            f"the plan ({'; '.join(changes)}); every rank must keep its parameters' dtype, "
            "shape and device as they were when the buckets were planned"
        )
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, slot in present.items():
        groups.setdefault(slot[1:], []).append(r)
    if len(groups) <= 1:
        return None
    shown = "; ".join(
        f"rank(s) {ranks} at lane epoch {key[0]}, step {key[1]}, part {key[2] - 1}"
        for key, ranks in sorted(groups.items(), key=lambda item: item[1])
    )
    return (
        f"planned bucket {name!r}: the ranks reduced different steps or parts of the plan "
        f"together ({shown}); a rank skipped or repeated a step's reduction"
    )


class Host(Protocol):
    """What a lane needs from the engine that runs it."""

    rank: int

    def test(self, request: Request) -> bool: ...

    def wait_request(self, request: Request) -> None: ...

    def complete(self, op: Any, result: Any = None, error: BaseException | None = None) -> None: ...

    def account(self, nbytes: int, size: int, seconds: float, factor: float) -> None: ...

    def traced(self, name: str, what: str, t0: float, t1: float) -> None: ...


class Starter(Protocol):
    """The engine's allreduce (core/selection.Allreducer), as a lane uses it."""

    def start(
        self,
        backend: Backend,
        send: torch.Tensor | None,
        buf: torch.Tensor,
        op: ReduceOp,
        packed_s: float = 0.0,
        before_alone: Any = None,
    ) -> tuple[Request, bool]: ...

    def runs_alone(self, backend: Backend, numel: int, element_size: int) -> bool: ...

    def prepare(self, backend: Backend, wait: Callable[[Request], None]) -> None: ...


@dataclasses.dataclass
class _Flight:
    position: int
    op: Any  # the engine's Operation; None for a joined rank's zeros
    buf: torch.Tensor
    request: Request
    alone: bool
    t0: float


class Lane:
    """One plan's lane on one rank (module docstring)."""

    def __init__(
        self, ident: int, set_id: int, backend: Backend, spec: LaneSpec, join_mode: str
    ) -> None:
        self.ident, self.set_id, self.backend, self.spec = ident, set_id, backend, spec
        self.n = len(spec.parts)
        self.join_mode = join_mode
        self.rounds = [0] * self.n  # submissions taken per part (the user thread's side)
        self.waiting: dict[int, Any] = {}  # position: operation, until its turn
        self.posted = 0  # positions posted
        self.flight: collections.deque[_Flight] = collections.deque()
        self.limit: int | None = None  # frozen (a join): nothing at or after it is posted
        self.last_progress = time.monotonic()
        self.warned = False

    def take(self, op: Any) -> bool:
        """Give ``op`` (its ``planned`` index) its position; False where the lane is frozen
        at or before it (the caller negotiates it). Under the engine's lock."""
        index = op.planned[1]
        position = self.rounds[index] * self.n + index
        self.rounds[index] += 1
        if self.limit is not None and not self.posted <= position < self.limit:
            return False  # frozen: after the limit, or filled with zeros while joined
        self.waiting[position] = op
        return True

    def busy(self, joined: bool) -> bool:
        return bool(self.flight) or self.posted in self.waiting or self.fill_due(joined)

    def fill_due(self, joined: bool) -> bool:
        """Whether this rank, ``joined``, posts zeros at the next position (module docstring,
        5.): a frozen lane not posted up to its limit, and nothing of its own there."""
        return (
            joined
            and self.limit is not None
            and self.posted < self.limit
            and self.posted not in self.waiting
        )


class Lanes:
    """The engine's lanes (module docstring), by id; every method runs on the engine thread
    except ``take``, which runs under the engine's lock."""

    def __init__(self, host: Host, allreducer: Starter, lock: Any) -> None:
        """``lock``: the engine's, which ``take`` runs under (the user threads' side)."""
        self._host = host
        self._allreduce = allreducer
        self._lock = lock
        self.lanes: dict[int, Lane] = {}
        self.abandoned = False  # requests left in flight when the engine stopped
        self._opened: dict[int, int] = {}  # lanes opened per process set
        self.frozen = False
        self.joined = False  # this rank joined: it posts zeros up to a frozen lane's limit
        self._busy = False
        self._dirty = False  # taken since ``progress`` last looked
        self._inside = False

    # -- opening (a negotiated REGISTER operation) --------------------------------------------
    def open(self, set_id: int, parent: Backend, spec: LaneSpec, join_mode: str) -> int:
        """Split the lane's communicator off ``parent`` (collective over its ranks) and reduce
        a zero buffer of each part once (blocking: the window and the tuner's first state are
        made here, in negotiated order); the lane's id, the same on every rank."""
        backend = parent.split(list(range(parent.size)))
        assert backend is not None  # every rank of the set is in it
        # the same on every rank: sets' ids are, and a set's lanes open in negotiated order
        count = self._opened[set_id] = self._opened.get(set_id, 0) + 1
        ident = set_id << 20 | count
        lane = Lane(ident, set_id, backend, spec, join_mode)
        self._allreduce.prepare(backend, self._host.wait_request)
        for numel, dtype in dict.fromkeys(spec.parts):
            zeros = torch.zeros(numel + tail_numel(backend.size), dtype=getattr(torch, dtype))
            request, _ = self._allreduce.start(backend, None, zeros, ReduceOp.Sum)
            self._host.wait_request(request)
        if self.frozen:  # a join froze this engine's lanes: the plan is negotiated (5.)
            backend.close()
        else:
            self.lanes[ident] = lane
        return ident

    # -- the user thread's side ----------------------------------------------------------------
    def take(self, op: Any) -> bool:
        """Queue a planned operation on its lane; False: negotiate it (the lane is gone, or
        frozen at or before its position)."""
        lane = self.lanes.get(op.planned[0])
        if lane is None or self.joined or not lane.take(op):
            return False  # a joined rank's operations are negotiated (5.)
        self._busy = self._dirty = True
        return True

    # -- the engine thread's side ------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Anything posted or ready to post (cheap: the engine asks in every wait)."""
        return self._busy

    def progress(self) -> bool:
        """Post what may be posted, finish what ended, in position order; whether anything is
        still in flight or waiting for its turn."""
        if self._inside:  # a completion callback that waits (it should not): no re-entry
            return self._busy
        self._inside = True
        try:
            with self._lock:
                self._dirty = False
                lanes = list(self.lanes.values())
            busy = False
            for lane in lanes:
                self._advance(lane)
                busy = busy or lane.busy(self.joined)
            with self._lock:  # a ``take`` meanwhile keeps it busy: it must be posted
                self._busy = busy or self._dirty
                return self._busy
        finally:
            self._inside = False

    def _advance(self, lane: Lane) -> None:
        moved = True
        while moved:
            moved = False
            while lane.flight and self._host.test(lane.flight[0].request):
                self._finish(lane, lane.flight.popleft())
                lane.last_progress = time.monotonic()
                lane.warned = False
                moved = True
            if self._post(lane):
                moved = True

    def _post(self, lane: Lane) -> bool:
        """Post the next position if it is there and may go now."""
        position = lane.posted
        if lane.limit is not None and position >= lane.limit:
            return False
        op = lane.waiting.get(position)
        if op is None and not lane.fill_due(self.joined):
            return False
        index = position % lane.n
        numel, dtype_name = lane.spec.parts[index]
        dtype = getattr(torch, dtype_name)
        total = numel + tail_numel(lane.backend.size)
        alone = self._allreduce.runs_alone(lane.backend, total, dtype.itemsize)
        if lane.flight and (alone or lane.flight[-1].alone):
            return False
        t0 = time.perf_counter()
        if op is None:  # a joined rank's zeros (present 0)
            buf = torch.zeros(total, dtype=dtype)
        else:
            del lane.waiting[position]
            buf = op.inputs[0].view(-1)
            if buf.numel() != total or buf.dtype != dtype:
                # cannot happen: the optimizer sends the part's own buffer; posting anything
                # else would mismatch the lane on every rank
                raise CommlayerError(
                    f"rank {self._host.rank}: planned operation {op.name!r} of "
                    f"{buf.numel()} {buf.dtype} elements at lane position {position}, "
                    f"planned {total} {dtype}"
                )
            if op.prescale != 1.0:
                fusion.scale_(buf[:numel], op.prescale)
            slot = codes(lane.ident, op.planned[2], index, dtype)
            write_tail(buf[numel:], lane.backend.rank, slot)
        request, _ = self._allreduce.start(lane.backend, None, buf, ReduceOp.Sum)
        if not lane.flight:  # the wait for the peers starts now, not at the last completion
            lane.last_progress = time.monotonic()
        lane.flight.append(_Flight(position, op, buf, request, alone, t0))
        lane.posted += 1
        if op is not None:
            self._host.traced(op.name, "QUEUED", op.t_submit, t0)
        return True

    def _finish(self, lane: Lane, done: _Flight) -> None:
        host = self._host
        t1 = time.perf_counter()
        numel = lane.spec.parts[done.position % lane.n][0]
        size = lane.backend.size
        element = done.buf.element_size()
        host.account(done.buf.numel() * element, size, t1 - done.t0, 2.0)
        op = done.op
        if op is None:
            return
        host.traced(op.name, "COLLECTIVE", done.t0, t1)
        slots = read_tail(done.buf[numel:], size)
        problem = disagreement(op.name, slots, done.buf.dtype)
        if problem is not None:
            host.complete(op, error=TensorMismatchError(f"rank {host.rank}: {problem}"))
            return
        scale = op.postscale
        if op.announce.op == int(ReduceOp.Average):
            present = sum(s is not None for s in slots)
            scale /= present if lane.join_mode == "active" else size
        fusion.scale_(done.buf[:numel], scale)
        host.complete(op, op.outputs)

    # -- watching -------------------------------------------------------------------------------
    def overdue(self, now: float, warn_s: float, fail_s: float) -> str | None:
        """Warn once when a lane made no progress for ``warn_s`` while it has work in flight;
        a message (the caller stops every rank, as for a stall) after ``fail_s``."""
        for lane in self.lanes.values():
            if not lane.flight:
                lane.last_progress = now
                continue
            waited = now - lane.last_progress
            head = lane.flight[0].op
            what = f"planned bucket {head.name!r}" if head is not None else "a joined rank's zeros"
            if fail_s > 0 and waited >= fail_s:
                return (
                    f"{what} (lane {lane.ident}, position {lane.flight[0].position}) stalled: "
                    f"no rank's post of it completed within {fail_s:g} s "
                    "(COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS): a rank did not reach this step"
                )
            if warn_s > 0 and waited >= warn_s and not lane.warned:
                lane.warned = True
                log.warning(
                    "commlayer stall on rank %d: %s (lane %d, position %d) has waited %.0f s for "
                    "the other ranks of process set %d to post it: a rank is behind or stopped "
                    "(COMMLAYER_STALL_CHECK_TIME_SECONDS)",
                    self._host.rank,
                    what,
                    lane.ident,
                    lane.flight[0].position,
                    waited,
                    lane.set_id,
                )
        return None

    # -- joins (module docstring, 5.) ---------------------------------------------------------
    def positions(self) -> dict[int, int]:
        """How far this rank posted, or was given, each lane (for the freeze): one after the
        furthest position it took. Under the engine's lock."""
        return {i: max([lane.posted - 1, *lane.waiting]) + 1 for i, lane in self.lanes.items()}

    def freeze(self, furthest: dict[int, int]) -> list[Any]:
        """Freeze every lane at ``furthest`` (the ranks' furthest position; a joined rank
        posts zeros up to it). Returns the operations taken at or after it, which the engine
        negotiates instead. A frozen lane stays, drained, for the engine's life (nothing is
        posted on it again). Under the engine's lock (``take`` changes the same tables)."""
        self.frozen = True
        moved: list[Any] = []
        for ident, lane in self.lanes.items():
            lane.limit = furthest.get(ident, lane.posted)
            for position in sorted(p for p in lane.waiting if p >= lane.limit):
                op = lane.waiting.pop(position)
                op.planned = None
                moved.append(op)
        self._busy = True
        return moved

    def thaw(self) -> None:
        """Every rank joined (every rank sees it in the same cycle): every position before a
        frozen lane's limit is done on every rank, so new lanes may open again (a later plan,
        a new optimizer); the frozen ones stay closed. Under the engine's lock."""
        self.frozen = False
        self.joined = False

    def fail_all(self) -> list[Any]:
        """Every operation still queued or in flight (the engine stopping)."""
        ops: list[Any] = []
        for lane in self.lanes.values():
            self.abandoned = self.abandoned or bool(lane.flight)
            ops += [f.op for f in lane.flight if f.op is not None]
            ops += list(lane.waiting.values())
            lane.flight.clear()
            lane.waiting.clear()
        self._busy = False
        return ops
