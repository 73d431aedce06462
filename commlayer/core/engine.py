"""The background engine: negotiate -> fuse -> reduce -> complete, on one thread per process.

The constraints it answers, and how:

1. MPI wants every rank to call collectives in the same order, but backward produces gradients
   in an order that can differ between ranks. -> Ranks negotiate (negotiation.py): an operation
   runs only once every rank of its process set submitted it, in an order all ranks share.
2. User threads must never block on communication until they call ``synchronize``. -> ``submit``
   only enqueues and returns a Future; one engine thread makes every backend call (MPI thread
   level SERIALIZED would suffice).
3. Many small tensors waste latency, one huge buffer delays the start. -> The caller batches:
   DistributedOptimizer's bucketer (comm/bucketer.py, the one batching policy) hands whole buckets
   as grouped operations, and ``submit_all`` queues operations given together with one wake-up,
   so they are negotiated in one cycle. The engine executes what it is given at once, with no
   wait for company: ready allreduces of one dtype and op are fused into buffers of at most
   ``fusion_threshold_bytes`` (fusion.py), and tensors that arrive while a collective runs go
   in the next cycle.
4. On a small or oversubscribed machine a busy-polling progress loop halves training throughput
   (benchmarks/README.md, Yardsticks: Horovod 0.55x DDP busy-polling, 1.35x yielding). -> The
   engine waits on collectives with Test + sched_yield (a yield keeps MPI progressing at full
   speed: 1 MiB allreduce 572 us vs 554 us blocking, where sleeping between tests took 4,577 us),
   sleeps with backoff when waiting on a negotiation a peer has not joined yet, and when idle
   sleeps on a condition variable with a heartbeat of ``idle_cycle_time_ms``. Where a node runs
   more ranks than it has cores, a yielding thread still takes its share of them from the peers'
   forward and backward (it is rescheduled at once), so there the wait on a collective is passive
   (``wait_policy``): yield for ``_PASSIVE_SPIN_S``, then sleep with backoff. Measured with
   benchmarks/train.py, 4 ranks on 2 cores: the MLP at 0.80-1.02 of DDP's throughput active,
   1.02-1.28 passive; ResNet 0.87-0.90 active, 0.94-0.95 passive. Alone on the cores (the
   allreduce benchmark) passive costs latency: 64 MiB 9.4 -> 18.4 ms at 2 ranks.
5. Errors must reach every rank, named, within seconds, never a hang: mismatches become error
   responses on every rank; stalls are reported, and failed after ``stall_shutdown_time_s``
   (10 minutes by default): StallError on every rank, and the engine stops on all of them (a
   rank that never submitted the operation cannot take part in anything after it: the
   Horovod and NCCL answer too), through a goodbye, so that ranks outside a stalled process
   set stop as well; a shutting-down rank tells the others in its last cycle; a peer that
   died is noticed within a second while waiting (its pid is checked) and every pending
   operation fails with RankDiedError.
6. A peer on another host cannot be checked, and MPI over TCP retransmits to a dead host or
   through a cut link for minutes. -> A watchdog (``collective_timeout_s``): a wait on one
   request, collective or negotiation, that sees nothing complete for that long raises
   CollectiveTimeoutError naming the operation and the ranks and hosts it waits on, every
   pending operation fails with it, and the job aborts (``Backend.abort``: MPI_Abort), as
   NCCL's watchdog aborts its communicator: a request that cannot complete cannot be
   cancelled, so neither another collective nor MPI_Finalize could follow it. The check is
   one comparison per test of a request, in the loop that already reads the clock.
7. A plan's buckets are the same on every rank every step: negotiating them re-proves that
   each cycle. -> With COMMLAYER_PLANNED_SKIP_NEGOTIATION (opt-in) they travel on a lane
   (planned.py): a communicator of the plan's own, posted in plan order, driven in the idle
   loop and inside every wait (never blocked on: two blocking waits on two communicators can
   deadlock), each reduction checked through a tail every rank writes its step into.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from commlayer.backends import shm
from commlayer.backends.base import (
    PROGRESS_THREADS,
    Backend,
    ProgressThreads,
    Request,
)
from commlayer.backends.shm import WINDOW_CHANNEL
from commlayer.common.config import Config
from commlayer.common.errors import (
    CollectiveTimeoutError,
    CommlayerError,
    DuplicateNameError,
    RankDiedError,
    ShutdownError,
    StallError,
    TensorMismatchError,
)
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import device, fusion, planned, startup
from commlayer.core.future import Future, mark_engine_thread
from commlayer.core.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    REGISTER,
    WINDOW,
    Announce,
    CycleResult,
    Negotiator,
    Response,
    joined_error,
)
from commlayer.core.process_sets import SetState, SetTable
from commlayer.core.runners import allgather, allreduce, alltoall, broadcast, reducescatter
from commlayer.core.timeline import NullTimeline, Timeline

log = logging.getLogger("commlayer")

_RUNNERS = {
    ALLGATHER: allgather.run,
    BROADCAST: broadcast.run,
    ALLTOALL: alltoall.run,
    REDUCESCATTER: reducescatter.run,
}
# Refused while a rank has joined, by join mode: Horovod refuses these (join_mode=horovod);
# alltoall cannot run without every rank's blocks in either mode (broadcast from a joined root
# neither: checked at run time, as the root is known there).
_REFUSED_WHILE_JOINED = {
    "horovod": (ALLGATHER, BROADCAST, REDUCESCATTER, ALLTOALL),
    "active": (ALLTOALL,),
}

_MIN_BACKOFF_S = 50e-6
_CONTROL_SPIN_S = 50e-6  # yield-spin this long on a negotiation before sleeping
_CONTROL_MAX_SLEEP_S = 250e-6  # bounds the extra latency when a peer posts late
_PASSIVE_SPIN_S = 200e-6  # a passive wait on a collective yield-spins this long, then sleeps
_PEER_CHECK_S = 1.0


@dataclasses.dataclass
class Operation:
    """One submitted collective, as the engine keeps it until completion."""

    announce: Announce
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    process_set_id: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    finish: Callable[[Any], Any] | None = None  # maps the raw result to what the user gets
    # Completes once the inputs can be read (device.py: CUDA tensors copied to host buffers).
    ready: Request | None = None
    handle: Future = dataclasses.field(default_factory=Future)
    remaining: int = 0
    t_submit: float = 0.0
    t_negotiate: float = 0.0
    # a planned part (core/planned.py): (its lane, its index in the plan, the sender's step
    # since the plan, -1 where it could not be sent as planned), reduced on the lane without
    # negotiation; None: negotiated
    planned: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        self.handle.name = self.announce.name

    @property
    def name(self) -> str:
        return self.announce.name


@dataclasses.dataclass
class Stats:
    """Counters for reports (the demo's communication summary, benchmarks)."""

    operations: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0  # estimate: what a bandwidth-optimal algorithm sends per rank
    collective_s: float = 0.0
    cycles: int = 0


class Engine:
    """Owns a backend and the thread that makes every call on it."""

    def __init__(
        self, backend: Backend, config: Config, timeline: Timeline | NullTimeline | None = None
    ) -> None:
        self.config = config
        self.rank = backend.rank
        self.size = backend.size
        self.stats = Stats()
        self.copied_at_start = shm.copied_bytes()  # communication_stats' window_copied_bytes
        # perf_counter() when the collective in progress started (None between collectives):
        # collective_now_s() counts the elapsed part of the running one too.
        self._collective_since: float | None = None
        # start-up agreement (startup.py): collectives, in this order, on every rank
        self._timeline = timeline or startup.opened_timeline(backend, config.timeline_path)
        self._tracing = not isinstance(self._timeline, NullTimeline)
        self._mark_cycles = False
        self._table = SetTable(self._negotiator)
        self._sets = self._table.sets  # by id: every set registered, this rank's or not
        self._cv = threading.Condition()
        self._incoming: list[Operation] = []
        self._tasks: list[Callable[[], None]] = []  # call_soon's, run at the next cycle
        self._inflight: set[tuple[int, str]] = set()
        self._allreduce = startup.allreducer(config, backend)
        self._fused = allreduce.FusedAllreduce(self._allreduce, config.fusion_threshold_bytes, self)
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._progress = False
        self._backoff_s = _MIN_BACKOFF_S
        self.passive = _passive(config.wait_policy, backend)
        self._data_spin_s = _PASSIVE_SPIN_S if self.passive else math.inf
        self._next_peer_check = 0.0  # wall-clock instant of the next pid check (_check_peers)
        self._next_lane_check = 0.0  # monotonic instant of the next planned-lane stall check
        # The watchdog (constraint 6): its limit, and what the engine thread waits on, for its
        # message: the process set, and fused entries, a Response or None (the negotiation).
        self._timeout_s = config.collective_timeout_s or math.inf
        self._waiting_set = 0
        self._waiting_on: list[fusion.Entry] | Response | None = None
        # The operations of the cycle being executed: no longer pending in a negotiator, so an
        # error that stops the engine midway (a dead peer, the watchdog) fails them in _stop.
        self._executing: list[Operation] = []
        self._join_handle: Future | None = None
        self._global = self._table.add(tuple(range(backend.size)), backend)[1]
        self._lanes = planned.Lanes(self, self._allreduce, self._cv)
        self._thread = threading.Thread(target=self._run, name="commlayer-engine", daemon=True)

    # -- user-thread side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def backend(self, set_id: int) -> Backend | None:
        """The backend of a process set (None where this rank is not in it)."""
        state = self._sets.get(set_id)
        return state.backend if state else None

    def topology(self, set_id: int) -> Topology:
        """The topology the algorithms use for a process set this rank belongs to."""
        return self._allreduce.topology(self._sets[set_id].backend)

    def submit(self, op: Operation) -> Future:
        """Enqueue an operation; returns its future at once (``submit_all`` for several)."""
        self.submit_all([op])
        return op.handle

    def submit_all(self, ops: Sequence[Operation]) -> None:
        """Enqueue operations together: one wake-up of the engine thread, so operations given
        together are negotiated together; returns at once. All or none: raises, queuing
        nothing, if the engine stopped or a name is already in flight (or given twice)."""
        now = time.perf_counter()
        with self._cv:
            for op in ops:
                self._raise_if_stopped(op.name)
            keys = [(op.process_set_id, op.name) for op in ops]
            for key, op in zip(keys, ops):
                if key in self._inflight or keys.count(key) > 1:
                    raise DuplicateNameError(
                        f"rank {self.rank}: an operation named {op.name!r} is already in "
                        "flight; names must be unique among outstanding operations"
                    )
            for key, op in zip(keys, ops):
                op.t_submit = now
                self._inflight.add(key)
                if op.planned is None or not self._lanes.take(op):
                    op.planned = None
                    self._incoming.append(op)
            self._cv.notify()

    def call_soon(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the engine thread at the start of its next cycle, before the
        operations queued so far are negotiated (what it submits joins them): work that must
        not delay the caller, such as compressing a gradient during backward
        (comm/communicator.py). ``task`` must not raise: it reports its own errors
        (its future's). Raises as ``submit`` does once the engine stopped; a task queued
        before that runs all the same (its submissions then fail with the engine's error)."""
        with self._cv:
            self._raise_if_stopped("a compression task")
            self._tasks.append(task)
            self._cv.notify()

    def _run_tasks(self) -> None:
        with self._cv:
            tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                task()
            except Exception:  # a task reports its own errors; one that did not is a bug
                log.exception("commlayer rank %d: a task on the engine thread failed", self.rank)

    def join(self) -> Future:
        with self._cv:
            self._raise_if_stopped("join")
            if self._join_handle is None:
                self._join_handle = Future("join")
                self._global.negotiator.joined = True
                self._lanes.joined = True  # for good: its lanes close at this join
                self._cv.notify()
            return self._join_handle

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """Tell the other ranks, stop the thread, fail what is still pending. Waits at most
        ``timeout_s`` for the others to take the goodbye; False, logged, when they did not (the
        thread is then still inside the negotiation: the caller must not finalize under it)."""
        with self._cv:
            self._global.negotiator.shutting_down = True
            self._cv.notify()
        stopped = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            stopped = not self._thread.is_alive()
        if not stopped:
            log.error(
                "commlayer rank %d: shutdown() gave up after %g s: the other ranks did not take "
                "its goodbye (one is stuck, in a long call that holds Python's GIL or stopped, "
                "or cannot be reached); leaving without waiting for them",
                self.rank,
                timeout_s,
            )
        self._timeline.close()
        return stopped

    def set_timeline(
        self, timeline: Timeline | NullTimeline, mark_cycles: bool = False
    ) -> Timeline | NullTimeline:
        """Trace to ``timeline`` from now on (start_timeline/stop_timeline); returns the previous
        one for the caller to close. No lock on the engine thread's side: it reads ``_tracing``
        and ``_timeline`` once per event, each assignment is atomic, and an event that still
        reaches the previous timeline is written or, once it is closed, dropped."""
        previous, self._timeline = self._timeline, timeline
        self._tracing = not isinstance(timeline, NullTimeline)
        self._mark_cycles = mark_cycles and self._tracing
        return previous

    @property
    def peer_died(self) -> bool:
        return isinstance(self._error, RankDiedError)

    @property
    def abandoned_requests(self) -> bool:
        """Whether a planned lane's reductions were still in flight when the engine stopped
        (core/planned.py): MPI_Finalize could wait for them for ever."""
        return self._lanes.abandoned

    def _raise_if_stopped(self, what: str) -> None:
        """ShutdownError once the engine stopped or is stopping; of the class of the error that
        stopped it where that is a commlayer error (a StallError stays one on every rank)."""
        if self._stopped.is_set() or self._global.negotiator.shutting_down:
            error = self._error
            reason = f": {error}" if error else ""
            cls = type(error) if isinstance(error, CommlayerError) else ShutdownError
            raise cls(
                f"rank {self.rank}: cannot run {what!r}, commlayer has been shut down{reason}"
            )

    # -- process sets (their table: process_sets.SetTable) ---------------------------------------
    def _negotiator(self, backend: Backend) -> Negotiator:
        cfg = self.config
        return Negotiator(
            backend,
            cfg.cache_capacity,
            cfg.stall_check_time_s,
            cfg.stall_shutdown_time_s,
            self._wait_control,
            _REFUSED_WHILE_JOINED[cfg.join_mode],
            cfg.join_mode,
        )

    def register_process_set(self, ranks: Sequence[int]) -> tuple[int, Backend | None]:
        """Collective over all ranks, before the thread starts: split off a process set."""
        return self._table.split(self._global.backend, ranks)

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        # Outputs may be tensors that require grad (in-place forms of grouped ops skip the
        # per-tensor detach): the engine's writes are never part of a graph.
        torch.set_grad_enabled(False)
        mark_engine_thread(threading.get_ident(), True)
        try:
            while True:
                self._wait_for_work()
                if self._cycle_all():
                    break
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the users' handles
            self._error = exc
            if not isinstance(exc, ShutdownError):
                log.error("commlayer rank %d: engine stopped: %s", self.rank, exc)
        finally:
            self._stop()
            mark_engine_thread(threading.get_ident(), False)
            if isinstance(self._error, CollectiveTimeoutError):
                self._global.backend.abort(str(self._error))

    def _wait_for_work(self) -> None:
        """Return when a cycle is due: new work or tasks, pending work (with backoff while the
        last cycle made no progress), a shutdown, or the idle heartbeat. Meanwhile the planned
        lanes are driven (core/planned.py): posting and completing their reductions needs no
        cycle."""
        since = time.perf_counter()
        sleep_s = 20e-6
        while True:
            self._check_peers()
            if self._lanes.busy and self._lanes.progress():
                self._check_lanes()
            with self._cv:
                # read under the lock that a planned submission takes: one queued since the
                # progress above is seen here, not slept through
                lanes = self._lanes.busy
                pending = any(s.negotiator.has_work() for s in self._table.members())
                stopping = self._global.negotiator.shutting_down
                urgent = self._incoming or self._tasks or stopping
                if self._progress:
                    self._backoff_s = _MIN_BACKOFF_S
                if urgent or (pending and self._progress):
                    return
                waited_s = time.perf_counter() - since
                if pending:
                    # Pending but the last cycle made no progress: peers are behind. Back off
                    # so ranks that all wait on each other do not spin cycles; new local work
                    # wakes us at once.
                    limit_s = self._backoff_s
                else:
                    check_s = self._next_peer_check - time.time()
                    limit_s = min(self.config.idle_cycle_time_ms / 1e3, waited_s + check_s)
                if waited_s >= limit_s:
                    if pending:
                        self._back_off()
                    return
                if not lanes:
                    self._cv.wait(limit_s - waited_s)
                    if not self._lanes.busy or self._incoming or self._tasks:
                        if pending:
                            self._back_off()
                        return
                    continue  # woken by a planned submission only: drive the lane, no cycle
                if waited_s >= self._data_spin_s:  # passive: sleep with backoff, woken by any
                    self._cv.wait(min(sleep_s, limit_s - waited_s))  # submission
                    sleep_s = min(sleep_s * 2, _CONTROL_MAX_SLEEP_S)
                    continue
            # A planned reduction in flight: tested as the engine waits on a collective
            # (constraint 4: yield, which keeps MPI and the window progressing at full speed).
            os.sched_yield()

    def _back_off(self) -> None:
        """A cycle with work pending made no progress (peers are behind): the next wait for
        one is twice as long, up to COMMLAYER_CYCLE_TIME."""
        self._backoff_s = min(self._backoff_s * 2, self.config.cycle_time_ms / 1e3)

    def _check_lanes(self) -> None:
        """A planned lane that waits too long (core/planned.py, Lanes.overdue): a warning, then
        a stall that stops every rank (through the goodbye, as a negotiated stall does)."""
        now = time.monotonic()
        if now < self._next_lane_check:
            return
        self._next_lane_check = now + _PEER_CHECK_S
        cfg = self.config
        stalled = self._lanes.overdue(now, cfg.stall_check_time_s, cfg.stall_shutdown_time_s)
        if stalled is not None:
            self._stop_after_stall([stalled])

    def _cycle_all(self) -> bool:
        """One negotiation cycle on every process set this rank belongs to; True to stop."""
        self._run_tasks()
        with self._cv:
            incoming, self._incoming = self._incoming, []
        now = time.perf_counter()
        for op in incoming:
            op.t_negotiate = now
            self._sets[op.process_set_id].negotiator.add(op.announce, op)
        self._progress = False
        self.stats.cycles += 1
        if self._mark_cycles:
            self._timeline.instant("cycles", "CYCLE_START", now)
        for set_id, state in sorted(self._sets.items()):
            # Skip a set that remove_process_set (run on set 0, earlier in this loop) dropped:
            # its communicator is freed, and every member drops it in this same cycle.
            if state.negotiator is None or self._sets.get(set_id) is not state:
                continue
            self._waiting_set, self._waiting_on = set_id, None
            result = state.negotiator.cycle()
            if result.stalled:  # first: no user thread woken below may submit anything more
                self._stop_after_stall(result.stalled)
            for op, error in result.failed:
                self.complete(op, error=error)
            self._execute(state, result)
            if set_id == 0 and self._global_news(result):
                return True
        return False

    def _global_news(self, result: CycleResult) -> bool:
        """What the global set's cycle said besides its operations: every rank joined (the
        join completes), a stall or a shutdown (True: this rank stops, as every rank does)."""
        if result.joined and not self._lanes.frozen:
            self._freeze_lanes()
        if result.all_joined_last is not None:
            self._finish_join(result.all_joined_last)
        if result.stalled:
            return True  # every rank got it in this cycle: all stop here
        if result.shutdown_ranks:
            if self._error is None:  # else this rank stops for a stall, said above
                self._error = ShutdownError(
                    f"rank {self.rank}: rank(s) {list(result.shutdown_ranks)} shut "
                    "down; collectives that need them cannot complete"
                )
            return True
        return False

    def _freeze_lanes(self) -> None:
        """A rank joined (every rank sees it in this cycle): freeze the planned lanes at the
        furthest position any rank took (core/planned.py, 5.), an allgather of the global
        set. What was taken after it is negotiated from the next cycle on."""
        with self._cv:
            mine = pickle.dumps(self._lanes.positions())
        request, payloads = self._global.backend.iallgather_bytes(mine)
        self._wait(request)
        furthest: dict[int, int] = {}
        for payload in payloads:
            for ident, position in pickle.loads(payload).items():
                furthest[ident] = max(furthest.get(ident, 0), position)
        with self._cv:
            self._incoming += self._lanes.freeze(furthest)

    def _stop_after_stall(self, stalled: list[str]) -> None:
        """A stall failed (constraint 5): every rank of the set got ``stalled`` in this cycle,
        and stops with it: at once in the global set; in another, through a goodbye in the next
        cycle of the global set, which stops the ranks outside it too (ShutdownError naming the
        set's ranks). Nothing can be submitted from now on."""
        if self._error is not None:
            return
        self._error = StallError(
            f"rank {self.rank}: {'; '.join(stalled)}; commlayer stopped on every rank"
        )
        log.error("commlayer rank %d: engine stopped: %s", self.rank, self._error)
        with self._cv:
            self._global.negotiator.shutting_down = True

    def _finish_join(self, last_rank: int) -> None:
        with self._cv:
            self._lanes.thaw()  # new lanes may open again (core/planned.py, 5.)
            handle, self._join_handle = self._join_handle, None
        if handle is not None:
            handle._set(last_rank)

    def _stop(self) -> None:
        with self._cv:
            self._stopped.set()
            leftovers = list(self._incoming)
            self._incoming.clear()
            for state in self._sets.values():
                if state.negotiator is not None:
                    leftovers += state.negotiator.fail_all()
            leftovers += [op for op in self._executing if not op.handle.done()]
            leftovers += self._lanes.fail_all()
            join, self._join_handle = self._join_handle, None
        self._run_tasks()  # their submissions fail now, completing their futures with the error
        with self._cv:
            leftovers += self._incoming
            self._incoming.clear()
        error = (
            self._error
            if isinstance(self._error, CommlayerError)
            else ShutdownError(
                f"rank {self.rank}: commlayer engine stopped: {self._error or 'shutdown'}"
            )
        )
        for op in leftovers:
            self.complete(op, error=error)
        if join is not None:
            join._set(error=error)

    # -- waiting ---------------------------------------------------------------------------------
    def _wait_control(self, request: Request) -> None:
        self._wait(request, spin_s=_CONTROL_SPIN_S)

    def _wait(self, request: Request, spin_s: float | None = None) -> None:
        """Wait without busy-polling: yield the CPU between tests for ``spin_s`` (a collective:
        the wait policy's), then sleep with backoff."""
        if self._test(request):
            return
        if spin_s is None:
            spin_s = self._data_spin_s
        start = time.perf_counter()
        sleep_s = 20e-6
        while not self._test(request):
            if self._lanes.busy:  # never block on one communicator while a lane waits
                self._lanes.progress()
            waited_s = time.perf_counter() - start
            if waited_s < spin_s:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, _CONTROL_MAX_SLEEP_S)
            if waited_s > self._timeout_s:
                raise self._timeout_error(waited_s)
            self._check_peers()

    def _test(self, request: Request) -> bool:
        """``request.test()``; a transport error raised while a peer on this host has died is
        that death (RankDiedError naming the rank): gloo reports a killed peer as "Connection
        closed by peer" as soon as its socket closes, often before the next pid check. One that
        names a peer's address elsewhere (``lost_peers``: the torch backend's gloo errors) names
        its host and ranks: their pids cannot be checked from here."""
        try:
            return request.test()
        except CommlayerError:
            raise
        except Exception as exc:
            backend = self._global.backend
            dead = backend.dead_peers()
            if dead:
                raise self._died(dead) from exc
            found = backend.lost_peers(exc)
            if found is not None:
                host, ranks = found
                raise RankDiedError(
                    f"rank {self.rank}: the connection to rank(s) {ranks} on {host} closed while "
                    f"this rank waited on them: a process there exited, or its host did ({exc})"
                ) from exc
            raise

    def _died(self, dead: list[int]) -> RankDiedError:
        return RankDiedError(
            f"rank {self.rank}: rank(s) {dead} exited while this rank waited on them"
        )

    def _timeout_error(self, waited_s: float) -> CollectiveTimeoutError:
        """The watchdog's error: what made no progress, and which ranks it waits on, by host
        (those on this host checked alive; those elsewhere cannot be checked from here)."""
        ranks = self._sets[self._waiting_set].ranks
        hosts = self._global.backend.hosts()
        here = hosts[self.rank]
        dead = set(self._global.backend.dead_peers())
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            if r != self.rank:
                by_host.setdefault(hosts[r], []).append(r)
        where = []
        for host, on_host in by_host.items():
            if host == here:
                gone = sorted(dead & set(on_host))
                state = f"{gone} exited" if gone else "running"
                where.append(f"rank(s) {on_host} on this host ({state})")
            else:
                where.append(f"rank(s) {on_host} on {host}")
        return CollectiveTimeoutError(
            f"rank {self.rank} (host {here}): {_describe(self._waiting_on)} on process set "
            f"{self._waiting_set} made no progress for {waited_s:.1f} s "
            f"(COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS={self.config.collective_timeout_s:g}); it "
            f"waits on {'; '.join(where)}: a host down, a link cut, or a rank there dead or "
            "stopped; the job aborts"
        )

    def _check_peers(self) -> None:
        """Raise RankDiedError if a peer's process is gone. Checked at whole multiples of
        ``_PEER_CHECK_S`` of the wall clock, the same instants on every rank, while waiting and
        while idle: when one rank dies, every survivor sees it gone at the same check, before
        any survivor has failed, shut down and exited (a survivor checking later would count
        those as dead too)."""
        wall = time.time()
        if wall < self._next_peer_check:
            return
        self._next_peer_check = (math.floor(wall / _PEER_CHECK_S) + 1) * _PEER_CHECK_S
        dead = self._global.backend.dead_peers()
        if dead:
            raise self._died(dead)

    # -- execution -------------------------------------------------------------------------------
    def complete(
        self, op: Operation, result: Any = None, error: BaseException | None = None
    ) -> None:
        with self._cv:
            self._inflight.discard((op.process_set_id, op.name))
        if error is None and op.finish is not None:
            try:
                result = op.finish(result)
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller through the handle
                error = exc
        op.handle._set(result, error)

    def _execute(self, state: SetState, result: CycleResult) -> None:
        """Run a negotiated cycle's ready operations, in stages: inputs staged in, responses
        sorted (errors completed, allreduces grouped for fusion), fused allreduces run, then
        the other collectives, in the negotiated order."""
        self._executing = [op for _, op in result.ready if op is not None]
        self._stage_in(self._executing)
        active = [r for r in range(state.backend.size) if r not in result.joined]
        groups, others = self._sort(state, result, active)
        self._run_fused(state, groups, len(active) < state.backend.size)
        self._run_others(state, others, active)

    def _stage_in(self, executing: list[Operation]) -> None:
        """Wait until each operation's inputs can be read (device tensors: copied to the host,
        or produced)."""
        for staged in executing:
            if staged.ready is not None:
                t0 = time.perf_counter()
                self._wait(staged.ready)
                staged.ready = None
                if self._tracing:
                    self._timeline.span(staged.name, "STAGE_IN", t0, time.perf_counter())

    def _sort(
        self, state: SetState, result: CycleResult, active: list[int]
    ) -> tuple[
        dict[tuple[str, int, str], list[fusion.Entry]], list[tuple[Response, Operation | None]]
    ]:
        """The ready responses, traced (queued, negotiating): an error completes its operation;
        allreduces go in fusion groups by dtype, op and channel (a direct operation's buffers
        are on its device, device.py, and the channel, negotiated, is the same on every rank,
        so every rank plans the same buckets); the others are kept in order."""
        groups: dict[tuple[str, int, str], list[fusion.Entry]] = {}
        others: list[tuple[Response, Operation | None]] = []
        now = time.perf_counter()
        for response, op in result.ready:
            self._progress = True
            if op is not None and self._tracing:
                self._timeline.span(op.name, "QUEUED", op.t_submit, op.t_negotiate)
                self._timeline.span(op.name, "NEGOTIATING", op.t_negotiate, now)
            if response.error is not None:
                if op is not None:
                    self.complete(
                        op, error=TensorMismatchError(f"rank {self.rank}: {response.error}")
                    )
            elif response.kind == ALLREDUCE:
                entries = allreduce.entries(
                    response, op, self._divisor(state, active), self.config.fusion_threshold_bytes
                )
                key = (response.dtype, response.op, response.channel)
                groups.setdefault(key, []).extend(entries)
            else:
                others.append((response, op))
        return groups, others

    def _run_fused(
        self,
        state: SetState,
        groups: dict[tuple[str, int, str], list[fusion.Entry]],
        joined: bool = False,
    ) -> None:
        """Each fusion group's allreduces (runners/allreduce.FusedAllreduce); a planned
        bucket's in its shared-memory window (``in_window``) unless a rank has joined
        (``joined``, the same on every rank: then the regular way, as a joined rank can)."""
        for (dtype, op_value, channel), entries in groups.items():
            self._waiting_on = entries
            if channel.startswith(WINDOW_CHANNEL):  # a planned bucket in its window
                self._fused.in_window(
                    state.backend,
                    getattr(torch, dtype),
                    ReduceOp(op_value),
                    entries,
                    channel,
                    joined,
                )
                continue
            self._fused.run(
                state.backend,
                getattr(torch, dtype),
                ReduceOp(op_value),
                entries,
                device.channel_device(channel),
            )

    def _run_others(
        self, state: SetState, others: list[tuple[Response, Operation | None]], active: list[int]
    ) -> None:
        """The other collectives, one at a time; an error fails its operation only, except
        the watchdog's, which stops the engine (constraint 6)."""
        for response, op in others:
            self._waiting_on = response
            try:
                raw = self._run_other(state, response, op, active)
            except CollectiveTimeoutError:
                raise  # stops the engine (constraint 6), not one operation
            except CommlayerError as exc:
                if op is not None:
                    self.complete(op, error=exc)
                continue
            if op is not None:
                self.complete(op, raw)

    # -- what a planned lane needs (core/planned.Host) ------------------------------------------
    def test(self, request: Request) -> bool:
        return self._test(request)

    def wait_request(self, request: Request) -> None:
        self._wait(request)

    def traced(self, name: str, what: str, t0: float, t1: float) -> None:
        if self._tracing:
            self._timeline.span(name, what, t0, t1)

    # -- what the fused allreduce runner reports back (runners/allreduce.Host) ------------------
    def wait(self, request: Request) -> None:
        """Wait on a collective's request (counted by ``account`` once done)."""
        self._collective_since = time.perf_counter()
        self._wait(request)

    def spans(self, name: str, times: tuple[float, float, float, float], **args: Any) -> None:
        """Pack, collective and unpack of ``name``'s part of a fused bucket, when tracing."""
        if self._tracing:
            t0, t1, t2, t3 = times
            self._timeline.span(name, "FUSION_PACK", t0, t1, bucket=args["bucket"])
            self._timeline.span(name, "COLLECTIVE", t1, t2, bytes=args["bytes"])
            self._timeline.span(name, "FUSION_UNPACK", t2, t3)

    def collective_now_s(self) -> float:
        """Seconds in collectives so far, the running one's elapsed part included (any thread):
        ``stats.collective_s`` grows only when a collective ends, so a reader comparing it
        before and after a wait would count a collective that started before as all waited."""
        since = self._collective_since
        return self.stats.collective_s + (time.perf_counter() - since if since else 0.0)

    def cpu_s(self) -> float:
        """CPU seconds the engine thread used so far (0.0 before it starts, or where the
        platform has no per-thread CPU clock)."""
        ident = self._thread.ident
        if ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:  # the thread ended: its clock is gone
            return 0.0

    def account(self, nbytes: int, size: int, seconds: float, factor: float) -> None:
        self.stats.operations += 1
        self.stats.payload_bytes += nbytes
        self.stats.wire_bytes += nbytes * factor * (size - 1) / max(size, 1)
        self.stats.collective_s += seconds
        self._collective_since = None

    def _divisor(self, state: SetState, active: list[int]) -> int:
        """What Average divides by while ranks have joined: every rank (join_mode=horovod, a
        joined rank adding zeros) or the ranks not joined (join_mode=active)."""
        return len(active) if self.config.join_mode == "active" else state.backend.size

    def _run_other(
        self, state: SetState, response: Response, op: Operation | None, active: list[int]
    ) -> Any:
        backend = state.backend
        t0 = time.perf_counter()
        kind = response.kind
        if kind == BARRIER:
            return None
        if kind == REGISTER:
            # every REGISTER operation has its change (ops.register_process_set)
            change = response.registration
            assert change is not None
            if change.lane is not None:  # a plan's lane (core/planned.py)
                set_id = self._waiting_set
                return self._lanes.open(set_id, backend, change.lane, self.config.join_mode)
            return self._table.apply(state.backend, change)
        if kind == WINDOW:
            return self._bucket_window(backend, response, active)
        if len(active) < backend.size and (
            (kind == BROADCAST and response.root not in active)
            or kind in _REFUSED_WHILE_JOINED[self.config.join_mode]
        ):
            joined = set(range(backend.size)) - set(active)
            raise joined_error(self.rank, kind, response.name, joined, self.config.join_mode)
        runner = _RUNNERS[kind]
        # reducescatter's Average divides by len(active): size() unless join_mode=active
        raw, request, nbytes, factor = runner(backend, response, op, active)
        t1 = time.perf_counter()
        self.wait(request)
        t2 = time.perf_counter()
        self.account(nbytes, backend.size, t2 - t1, factor)
        if op is not None and self._tracing:
            self._timeline.span(op.name, "COLLECTIVE", t1, t2, bytes=nbytes, kind=kind)
            self._timeline.span(op.name, "FUSION_PACK", t0, t1)
        return raw() if callable(raw) else raw

    def _bucket_window(self, backend: Backend, response: Response, active: list[int]) -> Any:
        """A WINDOW operation: the shared-memory window of DistributedOptimizer's planned
        buckets (backends/shm.py's BucketWindow), made by every rank here, at this same point
        of their collectives (a window per node where the ranks are on several:
        Allreducer.bucket_window); None on every rank where it does not apply (one rank, a rank
        joined, a backend without a window, one that cannot be made)."""
        nbytes = response.shapes[0][0] if response.shapes and response.shapes[0] else 0
        if nbytes <= 0 or backend.size < 2 or len(active) < backend.size:
            return None
        return self._allreduce.bucket_window(backend, nbytes)


def _describe(waiting_on: list[fusion.Entry] | Response | None) -> str:
    """What the engine waits on, for the watchdog's message."""
    if waiting_on is None:
        return "the negotiation (the control allreduce every rank's engine joins each cycle)"
    if isinstance(waiting_on, Response):
        return f"{waiting_on.kind} {waiting_on.name!r}"
    names = list(dict.fromkeys(e.owner.name for e in waiting_on if e.owner is not None))
    shown = ", ".join(map(repr, names[:3])) + (f" (+{len(names) - 3} more)" if names[3:] else "")
    return f"allreduce of {shown or 'zeros (this rank joined)'}"


def _passive(policy: str, backend: Backend) -> bool:
    """Whether waits on collectives are passive (module docstring, constraint 4): the policy,
    and for ``auto`` whether this machine runs more ranks than it has cores. The machine, not
    the node: the hosts of scripts/cluster.sh (namespaces of one machine) run 1-2 ranks each
    on the same 2 cores, where a yield-spinning wait takes a core from the other hosts' ranks
    and from the kernel moving their TCP traffic. A backend whose transfers progress on threads
    of its own (``progress_threads``: gloo's worker, the torch backend's waiters) needs cores
    for them too: a yield-spinning engine takes them (torch backend, 2 ranks on 2 cores, 1 KiB
    allreduce: 7.4 -> 4.4 ms, 1 MiB 12.4 -> 5.2 ms passive, medians of 5 pairs under load 9);
    MPI progresses only when tested, so it counts none."""
    if policy != "auto":
        return policy == "passive"
    machines = backend.machines()
    here = machines.count(machines[backend.rank])
    threads = (
        cast(ProgressThreads, backend).progress_threads
        if PROGRESS_THREADS in backend.capabilities
        else 0
    )
    return here * (1 + threads) > (os.cpu_count() or 1)
