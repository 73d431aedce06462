"""Loopback backend: N ranks as threads of one process, for fast deterministic engine tests.

How a collective runs:
1. Every call of a rank on a group takes that rank's next sequence number on the group; the k-th
   calls of all ranks form one collective, whatever the timing of the threads.
2. Each call deposits references to its buffers (as in MPI, inputs must stay untouched until the
   request completes) and a signature. A call whose kind or signature differs from the first one
   deposited for k fails on every rank: that is an ordering bug in the engine, never a hang.
3. The last rank to post k computes every rank's output, reducing in rank order 0..n-1 so that
   results are bitwise identical on every rank, writes the outputs, then marks every request done.
A killed rank (:meth:`LoopbackWorld.kill`) makes every collective it belongs to wait forever, like
a crashed process; :meth:`LoopbackWorld.abort` fails all of them, so tests never leave threads
blocked. One lock (a Condition) guards the world and all groups split from it; nothing polls.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from commlayer.backends.peers import indices
from commlayer.common.config import Config, Launch
from commlayer.common.errors import CommlayerError, ShutdownError
from commlayer.common.reduce_ops import SUPPORTED_OPS, ReduceOp, reduce_into

if TYPE_CHECKING:
    from commlayer.backends.base import Backend

T = TypeVar("T")
_Failure = tuple[type[CommlayerError], str]


class LoopbackRequest:
    """A loopback operation in flight; ``wait`` blocks on the world's condition (tests only)."""

    __slots__ = ("_cond", "done", "failure", "result")

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.done = False
        self.failure: _Failure | None = None
        self.result: Any = None

    def _check(self) -> bool:
        if self.failure is not None:
            raise self.failure[0](self.failure[1])
        return self.done

    def test(self) -> bool:
        """True once complete; raises the collective's error if it failed on any rank."""
        with self._cond:
            return self._check()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until complete or failed (raises) or ``timeout_s`` passed (returns False)."""
        with self._cond:
            self._cond.wait_for(lambda: self.done or self.failure is not None, timeout_s)
            return self._check()


@dataclass(slots=True)
class _Call:
    """One rank's contribution to a collective: what it asked for and its buffers."""

    kind: str
    signature: dict[str, Any]  # must be equal on every rank
    data: tuple[Any, ...]
    finish: Callable[[list[_Call]], list[Any] | None]  # writes all outputs, returns results


class _Slot:
    """The calls of all ranks that share one sequence number on one group."""

    __slots__ = ("calls", "requests", "posted", "failure")

    def __init__(self, size: int) -> None:
        self.calls: list[Any] = [None] * size
        self.requests: list[LoopbackRequest | None] = [None] * size
        self.posted = 0
        self.failure: _Failure | None = None


@dataclass(slots=True)
class _Receive:
    """A posted receive waiting for its message."""

    request: LoopbackRequest
    buf: torch.Tensor
    rank: int
    peer: int


def _deliver(receive: _Receive, data: torch.Tensor) -> None:
    """Copy a message into a waiting receive (caller holds the world's lock)."""
    if data.numel() != receive.buf.numel() or data.dtype != receive.buf.dtype:
        receive.request.failure = (
            CommlayerError,
            f"rank {receive.rank}: receive of {receive.buf.numel()} {receive.buf.dtype} from "
            f"rank {receive.peer} got {data.numel()} {data.dtype}",
        )
        return
    receive.buf.reshape(-1).copy_(data)
    receive.request.done = True


class _Group:
    """A communicator: its members as ranks of the root world, and each member's next seq."""

    __slots__ = ("world", "gid", "members", "next_seq")

    def __init__(self, world: LoopbackWorld, gid: int, members: list[int]) -> None:
        self.world, self.gid, self.members = world, gid, members
        self.next_seq = [0] * len(members)


class LoopbackWorld:
    """Shared state of ``size`` thread ranks; ``nodes[r]`` is the node index of rank r."""

    def __init__(self, size: int, nodes: Sequence[int] | None = None) -> None:
        if size < 1:
            raise ValueError(f"loopback world size {size!r} must be >= 1")
        node_of = list(nodes) if nodes is not None else [0] * size
        if len(node_of) != size or any(n < 0 for n in node_of):
            raise ValueError(f"nodes {nodes!r} must be {size} non-negative node indices")
        self.size = size
        self.cond = threading.Condition(threading.Lock())
        self.node_of = node_of
        self.dead: set[int] = set()
        self.aborted: str | None = None
        self.pending: dict[tuple[int, int], _Slot] = {}
        # point to point, per (group, src, dst): messages not yet received, receives waiting
        self.mail: dict[tuple[int, int, int], tuple[deque[torch.Tensor], deque[_Receive]]] = {}
        self._groups = [_Group(self, 0, list(range(size)))]

    def backend(self, rank: int) -> LoopbackBackend:
        """Rank ``rank``'s backend on the whole world."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank!r} is outside the loopback world [0, {self.size})")
        return LoopbackBackend(self._groups[0], rank)

    def _new_group(self, members: list[int]) -> _Group:
        with self.cond:
            self._groups.append(_Group(self, len(self._groups), members))
            return self._groups[-1]

    def kill(self, rank: int) -> None:
        """Simulate rank ``rank`` dying: its collectives never complete, dead_peers lists it."""
        with self.cond:
            self.dead.add(rank)

    def abort(self, reason: str) -> None:
        """Fail every pending and future call with ShutdownError(reason)."""
        with self.cond:
            self.aborted = reason
            for slot in self.pending.values():
                _fail(slot, (ShutdownError, reason))
            self.pending.clear()
            for _, waiting in self.mail.values():
                for receive in waiting:
                    receive.request.failure = (ShutdownError, reason)
            self.mail.clear()
            self.cond.notify_all()


def _fail(slot: _Slot, failure: _Failure) -> None:
    """Mark a slot and every request posted to it failed (caller holds the lock)."""
    slot.failure = failure
    for req in slot.requests:
        if req is not None:
            req.failure = failure


def _mismatch(slot: _Slot, rank: int, seq: int, call: _Call) -> _Failure | None:
    """Failure if ``call`` disagrees with the first call deposited in ``slot``."""
    first_rank = next(r for r, c in enumerate(slot.calls) if c is not None)
    first = slot.calls[first_rank]
    if first.kind != call.kind:
        msg = f"rank {first_rank} called {first.kind} but rank {rank} called {call.kind}"
    elif first.signature != call.signature:
        msg = (
            f"{call.kind}: rank {first_rank} passed {first.signature!r} but rank {rank} "
            f"passed {call.signature!r}"
        )
    else:
        return None
    why = "every rank must make the same collective calls in the same order"
    return CommlayerError, f"loopback collective #{seq} mismatch: {msg} ({why})"


def _reduce(srcs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduction of ``srcs`` in rank order, in a new tensor (outputs may alias inputs)."""
    acc = srcs[0].clone()
    for src in srcs[1:]:
        reduce_into(acc, src, op)
    return acc


def _offsets(counts: Sequence[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts) + 1)]


def _finish_allreduce(calls: list[_Call]) -> None:
    total = _reduce([c.data[0] for c in calls], calls[0].signature["op"])
    for c in calls:
        c.data[1].copy_(total)


def _finish_allgatherv(calls: list[_Call]) -> None:
    whole = torch.cat([c.data[0] for c in calls])
    for c in calls:
        c.data[1].copy_(whole)


def _finish_bcast(calls: list[_Call]) -> None:
    root = calls[0].signature["root"]
    src = calls[root].data[0].clone()
    for c in calls:
        c.data[0].copy_(src)


def _finish_alltoallv(calls: list[_Call]) -> None:
    n = len(calls)
    for r, q in ((r, q) for r in range(n) for q in range(n)):
        sent, expected = calls[r].data[1][q], calls[q].data[3][r]
        if sent != expected:
            raise CommlayerError(
                f"ialltoallv count mismatch: rank {r} sends {sent} elements to rank {q}, "
                f"which expects {expected} from rank {r}"
            )
    offs = [_offsets(c.data[1]) for c in calls]
    outs = [torch.cat([c.data[0][o[q] : o[q + 1]] for c, o in zip(calls, offs)]) for q in range(n)]
    for c, out in zip(calls, outs):
        c.data[2].copy_(out)


def _finish_reduce_scatter(calls: list[_Call]) -> None:
    total = _reduce([c.data[0] for c in calls], calls[0].signature["op"])
    offs = _offsets(calls[0].signature["counts"])
    for r, c in enumerate(calls):
        c.data[1].copy_(total[offs[r] : offs[r + 1]])


def _finish_control(calls: list[_Call]) -> None:
    total = calls[0].data[0].copy()
    for c in calls[1:]:
        np.bitwise_and(total, c.data[0], out=total)
    for c in calls:
        c.data[0][...] = total


def _finish_gather_bytes(calls: list[_Call]) -> None:
    for c in calls:
        c.data[1][:] = [other.data[0] for other in calls]


def _finish_split(calls: list[_Call]) -> list[Any]:
    group, ranks = calls[0].data[0], calls[0].signature["ranks"]
    sub = group.world._new_group([group.members[r] for r in ranks])
    return [LoopbackBackend(sub, ranks.index(r)) if r in ranks else None for r in range(len(calls))]


def _flat(rank: int, what: str, tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """``tensor`` as a flat view, after checking it is contiguous with ``numel`` elements."""
    if not tensor.is_contiguous():
        raise ValueError(f"rank {rank}: {what} must be a contiguous tensor")
    if tensor.numel() != numel:
        raise ValueError(f"rank {rank}: {what} has {tensor.numel()} elements, expected {numel}")
    return tensor.view(-1)


def _check_op(rank: int, op: ReduceOp) -> None:
    if op not in SUPPORTED_OPS:
        allowed = [o.name for o in SUPPORTED_OPS]
        raise ValueError(f"rank {rank}: reduce op {op!r} is not supported; allowed: {allowed}")


def _same_dtype(rank: int, send: torch.Tensor, recv: torch.Tensor) -> torch.dtype:
    if send.dtype != recv.dtype:
        raise ValueError(f"rank {rank}: send dtype {send.dtype} differs from recv {recv.dtype}")
    return recv.dtype


class LoopbackBackend:
    """One rank's view of a loopback group; implements :class:`commlayer.backends.base.Backend`."""

    __slots__ = ("_group", "_rank", "_closed")

    capabilities: frozenset[str] = frozenset()  # nothing optional (backends/base.py)

    def __init__(self, group: _Group, rank: int) -> None:
        self._group, self._rank, self._closed = group, rank, False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._group.members)

    @property
    def world(self) -> LoopbackWorld:
        """The world this group was split from (tests kill or abort ranks through it)."""
        return self._group.world

    def _counts(self, what: str, counts: Sequence[int]) -> tuple[int, ...]:
        out = tuple(int(c) for c in counts)
        if len(out) != self.size or any(c < 0 for c in out):
            raise ValueError(
                f"rank {self._rank}: {what} {out!r} must be {self.size} non-negative counts"
            )
        return out

    def _post(self, call: _Call) -> LoopbackRequest:
        """Deposit this rank's call; the last rank to arrive completes the collective."""
        group, world, rank, n = self._group, self._group.world, self._rank, self.size
        with world.cond:
            if world.aborted is not None or group.members[rank] in world.dead or self._closed:
                why = world.aborted or f"rank {rank} was killed or closed its backend"
                raise ShutdownError(f"loopback {call.kind} on rank {rank}: {why}")
            seq = group.next_seq[rank]
            group.next_seq[rank] += 1
            key = (group.gid, seq)
            slot = world.pending.setdefault(key, _Slot(n))
            if slot.failure is None and slot.posted:
                if failure := _mismatch(slot, rank, seq, call):
                    _fail(slot, failure)
            req = LoopbackRequest(world.cond)
            slot.calls[rank], req.failure = call, slot.failure
            slot.requests[rank] = req
            slot.posted += 1
            if slot.failure is not None:
                world.cond.notify_all()
                if slot.posted == n:
                    del world.pending[key]
                raise slot.failure[0](slot.failure[1])
            if slot.posted < n or any(m in world.dead for m in group.members):
                return req
            del world.pending[key]
        # This thread alone holds the completed slot now: compute outside the lock.
        try:
            results = call.finish(slot.calls) or [None] * n
        except Exception as exc:
            with world.cond:
                _fail(slot, (CommlayerError, f"loopback {call.kind} #{seq} failed: {exc}"))
                world.cond.notify_all()
            raise
        with world.cond:
            for other, result in zip(slot.requests, results):
                assert other is not None  # every rank has posted
                other.result, other.done = result, True
            world.cond.notify_all()
        return req

    def iallreduce(
        self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp
    ) -> LoopbackRequest:
        _check_op(self._rank, op)
        src = recv if send is None else send
        sig = {"op": op, "dtype": _same_dtype(self._rank, src, recv), "numel": recv.numel()}
        data = (
            _flat(self._rank, "send", src, recv.numel()),
            _flat(self._rank, "recv", recv, recv.numel()),
        )
        return self._post(_Call("iallreduce", sig, data, _finish_allreduce))

    def iallgatherv(
        self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]
    ) -> LoopbackRequest:
        cnt = self._counts("counts", counts)
        sig = {"dtype": _same_dtype(self._rank, send, recv), "counts": cnt}
        data = (
            _flat(self._rank, "send", send, cnt[self._rank]),
            _flat(self._rank, "recv", recv, sum(cnt)),
        )
        return self._post(_Call("iallgatherv", sig, data, _finish_allgatherv))

    def ibcast(self, buf: torch.Tensor, root: int) -> LoopbackRequest:
        if not 0 <= root < self.size:
            raise ValueError(f"rank {self._rank}: bcast root {root!r} not in [0, {self.size})")
        sig = {"dtype": buf.dtype, "numel": buf.numel(), "root": root}
        data = (_flat(self._rank, "buf", buf, buf.numel()),)
        return self._post(_Call("ibcast", sig, data, _finish_bcast))

    def ialltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> LoopbackRequest:
        scnt, rcnt = (
            self._counts("send_counts", send_counts),
            self._counts("recv_counts", recv_counts),
        )
        sig = {"dtype": _same_dtype(self._rank, send, recv)}
        data = (
            _flat(self._rank, "send", send, sum(scnt)),
            scnt,
            _flat(self._rank, "recv", recv, sum(rcnt)),
            rcnt,
        )
        return self._post(_Call("ialltoallv", sig, data, _finish_alltoallv))

    def ireduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp
    ) -> LoopbackRequest:
        _check_op(self._rank, op)
        cnt = self._counts("counts", counts)
        sig = {"op": op, "dtype": _same_dtype(self._rank, send, recv), "counts": cnt}
        data = (
            _flat(self._rank, "send", send, sum(cnt)),
            _flat(self._rank, "recv", recv, cnt[self._rank]),
        )
        return self._post(_Call("ireduce_scatter", sig, data, _finish_reduce_scatter))

    def ibarrier(self) -> LoopbackRequest:
        return self._post(_Call("ibarrier", {}, (), lambda calls: None))

    def icontrol(self, words: np.ndarray) -> LoopbackRequest:
        if words.dtype != np.uint64 or words.ndim != 1:
            raise ValueError(
                f"rank {self._rank}: control words must be a 1-D uint64 array, "
                f"got {words.dtype} with shape {words.shape}"
            )
        sig = {"words": words.size}
        return self._post(_Call("icontrol", sig, (words,), _finish_control))

    def _mailbox(self, src: int, dst: int) -> tuple[deque[torch.Tensor], deque[_Receive]]:
        world, group = self._group.world, self._group
        if world.aborted is not None or self._closed:
            why = world.aborted or f"rank {self._rank} closed its backend"
            raise ShutdownError(f"loopback point-to-point on rank {self._rank}: {why}")
        for peer in (src, dst):
            if not 0 <= peer < self.size:
                raise ValueError(f"rank {self._rank}: peer {peer} is outside [0, {self.size})")
        return world.mail.setdefault((group.gid, src, dst), (deque(), deque()))

    def isend(self, buf: torch.Tensor, peer: int) -> LoopbackRequest:
        """Buffered: the data is copied at once, so the send completes at once."""
        world = self._group.world
        with world.cond:
            messages, waiting = self._mailbox(self._rank, peer)
            data = buf.detach().reshape(-1).clone()
            if waiting:
                _deliver(waiting.popleft(), data)
                world.cond.notify_all()
            else:
                messages.append(data)
            req = LoopbackRequest(world.cond)
            req.done = True
            return req

    def irecv(self, buf: torch.Tensor, peer: int) -> LoopbackRequest:
        world = self._group.world
        with world.cond:
            messages, waiting = self._mailbox(peer, self._rank)
            req = LoopbackRequest(world.cond)
            receive = _Receive(req, buf, self._rank, peer)
            if messages and not waiting:
                _deliver(receive, messages.popleft())
            else:
                waiting.append(receive)
            return req

    def iallgather_bytes(self, payload: bytes) -> tuple[LoopbackRequest, list[bytes]]:
        out: list[bytes] = []
        req = self._post(_Call("iallgather_bytes", {}, (bytes(payload), out), _finish_gather_bytes))
        return req, out

    def split(self, ranks: Sequence[int]) -> LoopbackBackend | None:
        members = tuple(int(r) for r in ranks)
        if (
            not members
            or list(members) != sorted(set(members))
            or not (0 <= members[0] and members[-1] < self.size)
        ):
            raise ValueError(
                f"rank {self._rank}: split ranks {members!r} must be distinct, ascending, "
                f"non-empty and in [0, {self.size})"
            )
        req = self._post(_Call("split", {"ranks": members}, (self._group,), _finish_split))
        req.wait()
        return req.result  # type: ignore[no-any-return]

    def nodes(self) -> list[int]:
        return indices(self._group.world.node_of[m] for m in self._group.members)

    def hosts(self) -> list[str]:
        return [f"loopback-node{node}" for node in self.nodes()]

    def machines(self) -> list[int]:
        """Threads of one process: one machine, whatever nodes they pretend to be on."""
        return [0] * self.size

    def abort(self, reason: str) -> None:
        """Threads cannot be killed: every pending and later call of the world fails instead."""
        self._group.world.abort(reason)

    def dead_peers(self) -> list[int]:
        world = self._group.world
        with world.cond:
            return [r for r, m in enumerate(self._group.members) if m in world.dead]

    def lost_peers(self, error: BaseException) -> tuple[str, list[int]] | None:
        return None  # one process: dead_peers knows every death

    def close(self) -> None:
        self._closed = True


if TYPE_CHECKING:  # mypy proves LoopbackBackend conforms to the Backend protocol
    _conforms: type[Backend] = LoopbackBackend


def start(comm: Any, settings: Config, launch: Launch, join: Any = None) -> LoopbackBackend:
    """init()'s backend (registry.Lifecycle): a world of one rank, this process (tests run
    more as threads: ``run_ranks``)."""
    if comm is not None:
        raise ValueError(f"init(comm={comm!r}): the loopback backend runs one rank, no comm")
    return LoopbackWorld(1).backend(0)


def end_job(what: str, exc: BaseException) -> bool:
    """Nothing to end beyond this process (registry.Lifecycle)."""
    return False


def finish(stopped: bool, peer_died: bool) -> None:
    """Nothing to release (registry.Lifecycle)."""


def run_ranks(
    size: int,
    fn: Callable[[LoopbackBackend], T],
    *,
    timeout_s: float = 30.0,
    nodes: Sequence[int] | None = None,
) -> list[T]:
    """Run ``fn(backend)`` on ``size`` thread ranks; return the results in rank order.

    1. Start one daemon thread per rank on a fresh :class:`LoopbackWorld`.
    2. On the first exception, abort the world so ranks blocked on it fail fast.
    3. Wait up to ``timeout_s`` for all ranks; re-raise the first exception (same type, its
       message prefixed with the rank), else raise TimeoutError naming the ranks still running.
    """
    world = LoopbackWorld(size, nodes)
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []
    finished: set[int] = set()
    cond = threading.Condition()

    def main(rank: int) -> None:
        try:
            results[rank] = fn(world.backend(rank))
        # BaseException: pytest.fail and a pytest.raises that saw nothing raise pytest's Failed,
        # which is no Exception; caught as Exception it ended the thread and the run passed.
        except BaseException as exc:
            with cond:
                errors.append((rank, exc))
            world.abort(f"loopback rank {rank} failed: {exc!r}")
        finally:
            with cond:
                finished.add(rank)
                cond.notify_all()

    for r in range(size):
        threading.Thread(target=main, args=(r,), name=f"loopback-rank-{r}", daemon=True).start()
    with cond:
        cond.wait_for(lambda: len(finished) == size, timeout_s)
        running = sorted(set(range(size)) - finished)
        first = errors[0] if errors else None
    if first is not None:
        rank, exc = first
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"rank {rank}: {exc.args[0]}", *exc.args[1:])
        raise exc
    if running:
        world.abort(f"run_ranks timed out after {timeout_s} s")
        raise TimeoutError(
            f"loopback ranks {running} of {size} still running after {timeout_s} s "
            "(a collective that some rank never posted, or a killed peer?)"
        )
    return results
