"""Engine over the loopback backend: scaling, duplicate names, shutdown, dead peers, join."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch
from engine_harness import (
    WAIT_S,
    allgather,
    allreduce,
    broadcast,
    run_engines,
    wait,
)
from waiting import wait_until

from commlayer.backends.base import PROGRESS_THREADS
from commlayer.backends.loopback import LoopbackBackend, LoopbackWorld
from commlayer.common.errors import (
    CollectiveTimeoutError,
    CommlayerError,
    DuplicateNameError,
    RankDiedError,
    ShutdownError,
)
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import engine as engine_module
from commlayer.core.engine import Engine
from commlayer.core.future import Handle

FUSED = {"fusion_threshold_bytes": 1 << 20}
UNFUSED = {"fusion_threshold_bytes": 0}


# -- results: scaling, fused and not, in place and not ---------------------------------------------
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("settings", [FUSED, UNFUSED], ids=["fused", "unfused"])
def test_prescale_postscale_and_average(settings: dict[str, int], in_place: bool) -> None:
    """Submitted before the engine starts, so the ops share one cycle (and, fused, one bucket)."""

    def inputs(rank: int) -> dict[str, torch.Tensor]:
        base = torch.tensor([1.0, -2.0, 3.0]) * (rank + 1)  # sum over 2 ranks: 3x
        return {
            "scaled": base.clone(),
            "average": base.clone(),
            "half": base.half(),
            "int-average": torch.tensor([1, -3, 5], dtype=torch.int32) * (rank + 1),
            "scalar": torch.tensor(float(rank + 1)),
        }

    def fn(engine: Engine) -> dict[str, torch.Tensor]:
        tensors = inputs(engine.rank)
        handles = {
            name: engine.submit(allreduce(name, tensors[name], op, **scales, in_place=in_place))
            for name, op, scales in [
                ("scaled", ReduceOp.Sum, {"prescale": 3.0, "postscale": 0.5}),
                ("average", ReduceOp.Average, {"postscale": 4.0}),
                ("half", ReduceOp.Sum, {"prescale": 0.5}),
                ("int-average", ReduceOp.Average, {}),
                ("scalar", ReduceOp.Sum, {"postscale": 2.0}),
            ]
        }
        engine.start()
        results = {name: wait(h) for name, h in handles.items()}
        for name, result in results.items():
            assert (result is tensors[name]) == in_place, name
            if not in_place:  # the input is left as it was
                assert torch.equal(tensors[name], inputs(engine.rank)[name]), name
        # Fused: one bucket per (dtype, op), "scaled" and "scalar" share one; else one per op.
        assert engine.stats.operations == (4 if settings is FUSED else 5)
        return results

    base = torch.tensor([1.0, -2.0, 3.0])
    for results in run_engines(2, fn, start=False, **settings):
        assert torch.equal(results["scaled"], base * 3 * 3.0 * 0.5)
        assert torch.equal(results["average"], base * 1.5 * 4.0)
        assert torch.equal(results["half"], (base * 1.5).half())
        # Integer Average: the sum [3, -9, 15] / 2, truncated toward zero.
        assert results["int-average"].tolist() == [1, -4, 7]
        assert results["int-average"].dtype == torch.int32
        assert results["scalar"].shape == () and results["scalar"].item() == 6.0


def test_single_rank_engine() -> None:
    def fn(engine: Engine) -> list[torch.Tensor]:
        x = torch.arange(5.0)
        return [
            wait(engine.submit(allreduce("ar", x, ReduceOp.Average))),
            wait(engine.submit(allgather("ag", x.reshape(5, 1)))),
            wait(engine.submit(broadcast("bc", x, root=0))),
        ]

    (results,) = run_engines(1, fn)
    assert torch.equal(results[0], torch.arange(5.0))
    assert torch.equal(results[1], torch.arange(5.0).reshape(5, 1))
    assert torch.equal(results[2], torch.arange(5.0))


def test_error_in_finish_reaches_the_handle_and_the_engine_goes_on() -> None:
    def boom(_: object) -> None:
        raise ValueError("finish failed")

    def fn(engine: Engine) -> torch.Tensor:
        with pytest.raises(ValueError, match="finish failed"):
            wait(engine.submit(allreduce("x", torch.ones(2), finish=boom)))
        return wait(engine.submit(allreduce("x", torch.ones(2))))

    assert all(torch.equal(out, torch.full((2,), 2.0)) for out in run_engines(2, fn))


# -- duplicate names -------------------------------------------------------------------------------
def test_duplicate_in_flight_name_is_refused_then_reusable() -> None:
    """Rank 1 holds back until rank 0 tried the duplicate, so "dup" is surely in flight."""
    tried = threading.Event()

    def fn(engine: Engine) -> list[torch.Tensor]:
        value = torch.full((3,), float(engine.rank + 1))
        if engine.rank == 1:
            assert tried.wait(WAIT_S)
        first = engine.submit(allreduce("dup", value))
        if engine.rank == 0:
            with pytest.raises(TimeoutError, match="'dup' did not complete"):
                first.wait(timeout_s=0.01)  # rank 1 has not submitted it yet
            with pytest.raises(DuplicateNameError, match=r"rank 0: .*'dup' is already in flight"):
                engine.submit(allreduce("dup", value))
            assert issubclass(DuplicateNameError, ValueError)  # what a Horovod user catches
            tried.set()
        # Once complete, the name is free again.
        return [wait(first), wait(engine.submit(allreduce("dup", value)))]

    for results in run_engines(2, fn):
        assert all(torch.equal(out, torch.full((3,), 3.0)) for out in results)


# -- shutdown and dead peers -----------------------------------------------------------------------
def test_shutdown_fails_pending_ops_here_and_on_the_other_ranks() -> None:
    """Rank 0 and rank 1 each hold an op no other rank submits; rank 0 shuts down."""
    submitted = threading.Barrier(3)

    def fn(engine: Engine) -> str:
        handle = None
        if engine.rank in (0, 1):
            handle = engine.submit(allreduce(f"only{engine.rank}", torch.ones(2)))
        submitted.wait(WAIT_S)
        if engine.rank == 0:
            engine.shutdown(timeout_s=WAIT_S)
            assert not engine.running
        with pytest.raises(ShutdownError) as info:
            if handle is None:  # rank 2: new work fails, at submit or on its handle
                handle = engine.submit(allreduce("late", torch.ones(2)))
            wait(handle)
        with pytest.raises(ShutdownError, match="shut down"):
            engine.submit(allreduce("later", torch.ones(2)))
        with pytest.raises(ShutdownError):
            engine.join()
        return str(info.value)

    errors = run_engines(3, fn)
    for rank, error in enumerate(errors):
        assert error.startswith(f"rank {rank}: "), error
        assert "rank(s) [0] shut down" in error, error


def test_shutdown_of_every_rank_fails_pending_ops() -> None:
    def fn(engine: Engine) -> None:
        handle = engine.submit(allreduce(f"mine{engine.rank}", torch.ones(2)))
        engine.shutdown(timeout_s=WAIT_S)
        with pytest.raises(ShutdownError):
            wait(handle)

    run_engines(2, fn)


def test_dead_peer_fails_the_others_with_rank_died_error() -> None:
    backends: dict[int, LoopbackBackend] = {}
    submitted = threading.Barrier(3)

    def keep(backend: LoopbackBackend) -> LoopbackBackend:
        backends[backend.rank] = backend
        return backend

    def fn(engine: Engine) -> str | None:
        if engine.rank == 2:
            submitted.wait(WAIT_S)
            backends[2].world.kill(2)  # as if the process crashed: it never answers again
            return None
        handle = engine.submit(allreduce("x", torch.ones(2)))
        submitted.wait(WAIT_S)
        with pytest.raises(RankDiedError) as info:
            wait(handle)  # the engine notices within ~1 s (it checks its peers while waiting)
        assert engine.peer_died
        with pytest.raises(ShutdownError):
            engine.submit(allreduce("y", torch.ones(2)))
        return str(info.value)

    errors = run_engines(3, fn, wrap=keep)
    for rank in (0, 1):
        assert f"rank {rank}: rank(s) [2] exited" in str(errors[rank])


# -- join ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("join_mode", ["horovod", "active"])
def test_joined_rank_contributes_zeros_and_average_by_join_mode(join_mode: str) -> None:
    """Rank 2 joins first; ranks 0 and 1 then run collectives (ready only once rank 2 is known
    to have joined), then join too; afterwards all three work normally again. Average divides
    by size() (horovod) or by the ranks not joined (active); allgather raises under horovod
    (as in Horovod) and gathers the active ranks' rows under active."""

    def fn(engine: Engine) -> tuple[dict[str, Any], int, torch.Tensor]:
        results: dict[str, Any] = {}
        if engine.rank == 2:
            join = engine.join()
        else:
            v = float(engine.rank + 1)  # 1 and 2
            # The gather first: an engine takes submissions in order, so each rank's refusal
            # comes no later than the cycle its "sum" is ready in, and the other rank joins
            # only after that: both refusals name exactly rank 2. (Submitted last, a gather
            # could meet the other rank's join first and name it too: 20 runs in 300.)
            handles = {
                "gather": engine.submit(allgather("gather", torch.full((1, 2), v))),
                "sum": engine.submit(allreduce("sum", torch.full((3,), v))),
                "average": engine.submit(
                    allreduce("average", torch.full((4,), v), ReduceOp.Average)
                ),
                "max": engine.submit(allreduce("max", torch.full((2,), -v), ReduceOp.Max)),
            }
            for name, handle in handles.items():
                try:
                    results[name] = wait(handle)
                except CommlayerError as exc:
                    results[name] = exc
            join = engine.join()
        last = wait(join)
        after = wait(engine.submit(allreduce("after", torch.ones(2), ReduceOp.Average)))
        return results, last, after

    outcomes = run_engines(3, fn, join_mode=join_mode)
    for results, _, _ in outcomes[:2]:
        assert torch.equal(results["sum"], torch.full((3,), 3.0))  # 1 + 2 + 0
        divisor = 3 if join_mode == "horovod" else 2
        assert torch.equal(results["average"], torch.full((4,), 3.0 / divisor))
        assert torch.equal(results["max"], torch.zeros(2))  # max(-1, -2, 0): zeros from rank 2
        if join_mode == "horovod":
            assert isinstance(results["gather"], CommlayerError)
            assert "cannot run while ranks [2] have joined (join_mode=horovod)" in str(
                results["gather"]
            ), results["gather"]
        else:
            assert torch.equal(results["gather"], torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    lasts = {last for _, last, _ in outcomes}
    assert len(lasts) == 1 and lasts <= {0, 1}, lasts  # rank 2 joined first
    assert all(torch.equal(after, torch.ones(2)) for _, _, after in outcomes)


def test_refused_kinds_fail_at_once_while_a_rank_has_joined_even_with_differing_names() -> None:
    """After a join the ranks' unnamed operations are numbered differently (Horovod's
    test_horovod_join_allgather at 3 ranks): allgathers that would never meet must fail on
    every rank that submitted one (join_mode=horovod), not wait for a partner."""

    def fn(engine: Engine) -> str | None:
        if engine.rank == 2:
            join = engine.join()
            error = None
        else:
            name = f"gather.{engine.rank}"  # a different name on each rank
            gather = engine.submit(allgather(name, torch.ones(1, 2)))
            # Neither rank joins before both have "sync": each gather, submitted before it, is
            # refused while rank 2 alone has joined (else the other's join could be named too)
            wait(engine.submit(allreduce("sync", torch.ones(1))))
            with pytest.raises(CommlayerError, match="cannot run while ranks \\[2\\]") as info:
                wait(gather)
            error = str(info.value)
            join = engine.join()
        assert wait(join) in (0, 1)
        return error

    errors = run_engines(3, fn, timeout_s=10.0)
    assert errors[2] is None
    assert all("have joined (join_mode=horovod)" in e for e in errors[:2] if e)


def test_a_refusal_names_every_rank_joined_by_then() -> None:
    """Rank 2 joins; rank 0's gather is refused and rank 0 joins; rank 1 gathers only after
    its "probe", which completes only once rank 0 has joined (rank 0 never submits it): the
    refusal names both joined ranks, and rank 1 joined last."""

    def fn(engine: Engine) -> tuple[str | None, int]:
        error = None
        if engine.rank == 0:
            with pytest.raises(CommlayerError, match="ranks \\[2\\] have joined"):
                wait(engine.submit(allgather("gather", torch.ones(1, 2))))
        if engine.rank == 1:
            wait(engine.submit(allreduce("probe", torch.ones(1))))
            with pytest.raises(CommlayerError) as info:
                wait(engine.submit(allgather("gather", torch.ones(1, 2))))
            error = str(info.value)
        return error, wait(engine.join())

    outcomes = run_engines(3, fn)
    assert outcomes[1][0] is not None and outcomes[1][0].startswith(
        "rank 1: allgather 'gather' cannot run while ranks [0, 2] have joined (join_mode=horovod)"
    ), outcomes[1][0]
    assert [last for _, last in outcomes] == [1, 1, 1], outcomes


def test_broadcast_from_a_joined_root_fails_without_hanging() -> None:
    def fn(engine: Engine) -> str | None:
        if engine.rank == 0:
            join = engine.join()
            error = None
        else:
            cast = engine.submit(broadcast("b", torch.ones(2), root=0))
            # join_mode=horovod refuses each rank's broadcast on its own, at once; "sync" keeps
            # either from joining before both are refused, so both name rank 0 alone
            wait(engine.submit(allreduce("sync", torch.ones(1))))
            with pytest.raises(CommlayerError, match="'b' cannot run while ranks \\[0\\]") as info:
                wait(cast)
            error = str(info.value)
            join = engine.join()
        assert wait(join) in (1, 2)
        return error

    errors = run_engines(3, fn)
    assert errors[0] is None and all(e is not None for e in errors[1:])


def test_handle_repr_and_done() -> None:
    handle = Handle("grad.w")
    assert not handle.done() and repr(handle) == "<commlayer.Handle 'grad.w' pending>"
    with pytest.raises(TimeoutError):
        handle.wait(timeout_s=0.001)
    handle._set(42)
    assert handle.done() and handle.wait(timeout_s=0.001) == 42


def test_a_pytest_check_failing_on_one_rank_fails_the_run() -> None:
    """pytest.raises/pytest.fail raise pytest's Failed, a BaseException: the harness (and
    run_ranks under it) must not let it end the rank's thread silently."""

    def fn(engine: Engine) -> None:
        if engine.rank == 1:
            pytest.fail("checked on rank 1")
        wait(engine.submit(allreduce("x", torch.ones(1))))  # released by the abort, not hung

    with pytest.raises(pytest.fail.Exception, match="checked on rank 1"):
        run_engines(2, fn)


# -- submission: the caller batches, the engine does not wait for company --------------------------
def test_operations_submitted_together_are_negotiated_and_fused_together() -> None:
    """Four small allreduces given to submit_all go in one cycle and one fused collective on
    every rank, with nobody waiting on them yet."""

    def fn(engine: Engine) -> tuple[int, list[torch.Tensor]]:
        ops = [allreduce(f"g{i}", torch.full((10,), float(engine.rank + 1))) for i in range(4)]
        engine.submit_all(ops)
        wait_until(  # no wait() and no poll: _done, raw
            lambda: all(op.handle._done for op in ops),
            WAIT_S,
            "submitted operations never ran",
            poll_s=0.001,
        )
        return engine.stats.operations, [wait(op.handle) for op in ops]

    for ran, results in run_engines(2, fn):
        assert ran == 1
        assert all(torch.equal(out, torch.full((10,), 3.0)) for out in results)


def test_submit_all_queues_all_or_none() -> None:
    def fn(engine: Engine) -> torch.Tensor:
        first = allreduce("a", torch.ones(2))
        with pytest.raises(DuplicateNameError, match="'b' is already in flight"):
            engine.submit_all([first, allreduce("b", torch.ones(2)), allreduce("b", torch.ones(2))])
        return wait(engine.submit(first))  # "a" was not queued by the refused batch

    for out in run_engines(2, fn):
        assert torch.equal(out, torch.full((2,), 2.0))


class _Machines:
    def __init__(self, rank: int, machines: list[int], progress_threads: int = 0) -> None:
        self.rank, self._machines = rank, machines
        self.progress_threads = progress_threads
        self.capabilities = frozenset({PROGRESS_THREADS} if progress_threads else ())

    def machines(self) -> list[int]:
        return self._machines


@pytest.mark.parametrize(
    ("policy", "cores", "machines", "rank", "passive"),
    [
        ("auto", 2, [0, 0, 0, 0], 0, True),  # 4 ranks on 2 cores
        ("auto", 2, [0, 0], 1, False),  # 2 ranks on 2 cores
        ("auto", 2, [0, 0, 0, 1], 3, False),  # the other machine runs 3, this one 1
        ("auto", 2, [0, 0, 0, 1], 2, True),
        ("auto", 64, [0] * 8, 5, False),
        ("active", 1, [0] * 8, 0, False),
        ("passive", 64, [0, 0], 0, True),
        # a backend progressing on a thread of its own (gloo): 2 ranks need 4 cores
        ("auto+thread", 2, [0, 0], 1, True),
        ("auto+thread", 4, [0, 0], 1, False),
        ("auto+thread", 2, [0], 0, False),
    ],
)
def test_wait_policy_auto_is_passive_where_a_machine_runs_more_ranks_than_cores(
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    cores: int,
    machines: list[int],
    rank: int,
    passive: bool,
) -> None:
    monkeypatch.setattr(engine_module.os, "cpu_count", lambda: cores)
    threads = int(policy.endswith("+thread"))
    backend = _Machines(rank, machines, threads)
    assert engine_module._passive(policy.removesuffix("+thread"), backend) is passive  # type: ignore[arg-type]


def test_loopback_ranks_are_one_machine_whatever_nodes_they_pretend() -> None:
    """Threads of one process share its cores: 4 loopback ranks as 2 nodes are one machine."""
    world = LoopbackWorld(4, nodes=[0, 0, 1, 1])
    assert world.backend(3).nodes() == [0, 0, 1, 1]
    assert world.backend(3).machines() == [0, 0, 0, 0]


@pytest.mark.parametrize("policy", ["active", "passive"])
def test_collectives_under_either_wait_policy(policy: str) -> None:
    """A passive wait sleeps between tests once its spin is spent: results are the same."""

    def fn(engine: Engine) -> tuple[bool, list[torch.Tensor]]:
        if engine.rank == 1:
            time.sleep(0.01)  # rank 0 waits far past the 200 us spin, asleep
        handles = [
            engine.submit(allreduce(f"t{i}", torch.full((n,), float(engine.rank + 1))))
            for i, n in enumerate((1, 1000, 300_000))
        ]
        return engine.passive, [wait(h) for h in handles]

    for passive, results in run_engines(3, fn, wait_policy=policy):
        assert passive is (policy == "passive")
        assert all(torch.equal(out, torch.full_like(out, 6.0)) for out in results)


# -- the watchdog (collective_timeout_s) -----------------------------------------------------------
WATCHDOG_S = 0.5
# The watchdog fails an operation after WATCHDOG_S without progress, never before; the upper
# bound only has to tell it from a hang, which wait() would end at WAIT_S (10 s) with a
# TimeoutError. Each of the two tests took at most 0.67 s in 30 runs each, the other core
# busy; 5 s more leaves a loaded 2-core machine room to deschedule the ranks' threads.
WATCHDOG_WITHIN_S = WATCHDOG_S + 5.0


class _NeverRequest:
    def test(self) -> bool:
        return False


class _SilentRank:
    """Rank ``silent`` of a loopback backend posts its allreduces nowhere: they never complete,
    and the peers' never complete either, as when a host vanishes in the middle of one."""

    def __init__(self, inner: LoopbackBackend, silent: int) -> None:
        self._inner, self._silent = inner, silent

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def iallreduce(self, send: Any, recv: torch.Tensor, op: ReduceOp) -> Any:
        if self._inner.rank == self._silent:
            return _NeverRequest()
        return self._inner.iallreduce(send, recv, op)


def test_watchdog_fails_a_collective_without_progress_and_aborts_the_job() -> None:
    """Rank 2's part of 'x' never completes: it fails with CollectiveTimeoutError after the
    configured time, naming 'x' and the ranks it waits on; the others' 'x' fails too, by their
    own watchdog or by the first abort (here: the loopback world's, with that rank's message),
    and later work too."""

    def fn(engine: Engine) -> tuple[str, str, float]:
        started = time.perf_counter()
        handle = engine.submit(allreduce("x", torch.ones(2)))
        with pytest.raises(ShutdownError) as info:
            wait(handle)
        took = time.perf_counter() - started
        with pytest.raises(ShutdownError):
            engine.submit(allreduce("y", torch.ones(2)))
        return type(info.value).__name__, str(info.value), took

    results = run_engines(
        3,
        fn,
        wrap=lambda backend: _SilentRank(backend, 2),
        collective_timeout_s=WATCHDOG_S,
        allreduce_algorithm="mpi",
    )
    kind, message, took = results[2]
    assert kind == "CollectiveTimeoutError", message
    assert message.startswith("rank 2 (host loopback-node0): allreduce of 'x' on process set 0")
    assert "made no progress for 0.5 s (COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS=0.5)" in message
    assert "waits on rank(s) [0, 1] on this host (running)" in message, message
    assert message.endswith("the job aborts"), message
    for kind, message, took in results:
        assert "allreduce of 'x' on process set 0 made no progress" in message, (kind, message)
        assert WATCHDOG_S <= took < WATCHDOG_WITHIN_S, f"failed after {took:.2f} s"


def test_watchdog_fails_a_negotiation_a_peer_never_joins() -> None:
    """Rank 1's engine never starts (a stopped process): rank 0's negotiation of 'x' cannot
    complete; the watchdog names the negotiation and rank 1."""

    def fn(engine: Engine) -> str | None:
        if engine.rank == 1:
            return None
        engine.start()
        started = time.perf_counter()
        with pytest.raises(CollectiveTimeoutError) as info:
            wait(engine.submit(allreduce("x", torch.ones(2))))
        assert WATCHDOG_S <= time.perf_counter() - started < WATCHDOG_WITHIN_S
        return str(info.value)

    message = run_engines(2, fn, start=False, collective_timeout_s=WATCHDOG_S)[0]
    assert message is not None
    assert "rank 0 (host loopback-node0): the negotiation (the control allreduce" in message
    assert "waits on rank(s) [1] on this host (running)" in message, message


def test_shutdown_gives_up_on_a_peer_that_never_takes_its_goodbye(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1's engine never runs (a rank stuck in a call that holds the GIL, or stopped):
    rank 0's shutdown() waits at most its limit for the goodbye, says so, and returns False
    (runtime.shutdown then leaves without MPI_Finalize); its watchdog ends the engine later."""

    def fn(engine: Engine) -> tuple[bool, float] | None:
        if engine.rank == 1:
            return None
        engine.start()
        started = time.perf_counter()
        stopped = engine.shutdown(timeout_s=0.2)
        return stopped, time.perf_counter() - started

    # the watchdog well after the 0.2 s: the goodbye must be given up on, not ended by it
    result = run_engines(2, fn, start=False, collective_timeout_s=1.0)[0]
    assert result is not None
    stopped, took = result
    assert not stopped and took >= 0.2, result
    assert "commlayer rank 0: shutdown() gave up after 0.2 s" in caplog.text, caplog.text


def test_watchdog_off_at_zero() -> None:
    def fn(engine: Engine) -> float:
        return engine._timeout_s

    assert run_engines(1, fn, collective_timeout_s=0) == [math.inf]
