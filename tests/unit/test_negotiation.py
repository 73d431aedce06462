"""Negotiation through the engine: one execution order on every rank whatever the submission
order, the response cache, mismatches as errors on every rank, and stall reports."""

from __future__ import annotations

import logging
import random
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_harness import (
    WAIT_S,
    CountingBackend,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    grouped_allreduce,
    reducescatter,
    run_engines,
    wait,
)
from waiting import wait_until

from commlayer.backends.loopback import LoopbackBackend
from commlayer.common.errors import ShutdownError, StallError, TensorMismatchError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import negotiation
from commlayer.core.engine import Engine, Operation

SIZE = 3
ROUNDS = 3


# -- a workload of every kind, with results checked against a locally computed reference -----------
def value(rank: int, index: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Small integers (exact in every dtype and reduction order), distinct per rank and op."""
    t = (torch.arange(numel) * 7 + rank * 13 + index * 3) % 11 - 5
    return t.to(dtype)


Case = tuple[Callable[[int, int], Operation], Callable[[int, int], Any]]


def workload(size: int) -> dict[str, Case]:
    """name -> (build the rank's operation, the expected result on a rank)."""

    def ranks_value(i: int, n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [value(r, i, n, dtype) for r in range(size)]

    cases: dict[str, Case] = {}
    for i, (n, dtype, op) in enumerate(
        [
            (5, torch.float32, ReduceOp.Sum),
            (1, torch.float32, ReduceOp.Sum),
            (1023, torch.float32, ReduceOp.Sum),
            (0, torch.float32, ReduceOp.Sum),
            (4, torch.float64, ReduceOp.Average),
            (3, torch.int32, ReduceOp.Max),
            (6, torch.int64, ReduceOp.Min),
        ]
    ):
        vals = ranks_value(i, n, dtype)
        reduced = {
            ReduceOp.Sum: lambda v: sum(v[1:], v[0].clone()),
            ReduceOp.Average: lambda v: sum(v[1:], v[0].clone()) / size,
            ReduceOp.Max: lambda v: torch.stack(v).amax(0),
            ReduceOp.Min: lambda v: torch.stack(v).amin(0),
        }[op](vals)
        cases[f"allreduce.{i}"] = (
            lambda r, _, name=f"allreduce.{i}", i=i, n=n, dtype=dtype, op=op: allreduce(
                name, value(r, i, n, dtype), op
            ),
            lambda r, _, reduced=reduced: reduced,
        )
    cases["grouped"] = (
        lambda r, _: grouped_allreduce("grouped", [value(r, 20, 2), value(r, 21, 3)]),
        lambda r, _: [sum(ranks_value(20, 2)), sum(ranks_value(21, 3))],
    )
    cases["allgather"] = (  # rank r contributes r + 1 rows
        lambda r, _: allgather("allgather", value(r, 30, 2 * (r + 1)).reshape(r + 1, 2)),
        lambda r, _: torch.cat([value(q, 30, 2 * (q + 1)).reshape(q + 1, 2) for q in range(size)]),
    )
    for root in range(size):
        cases[f"broadcast.{root}"] = (
            lambda r, _, root=root: broadcast(f"broadcast.{root}", value(r, 40 + root, 4), root),
            lambda r, _, root=root: value(root, 40 + root, 4),
        )
    rows = 2 * size + 1  # uneven: the first rank gets one row more
    cases["reducescatter"] = (
        lambda r, _: reducescatter("reducescatter", value(r, 50, rows * 2).reshape(rows, 2)),
        lambda r, _: sum(ranks_value(50, rows * 2)).reshape(rows, 2)[
            [0, 1, 2] if r == 0 else [2 * r + 1, 2 * r + 2]
        ],
    )
    cases["alltoall"] = (  # rank r sends q + 1 rows to rank q
        lambda r, _: alltoall(
            "alltoall",
            value(r, 60, size * (size + 1) // 2),
            tuple(q + 1 for q in range(size)),
        ),
        lambda r, _: torch.cat(
            [value(q, 60, size * (size + 1) // 2)[r * (r + 1) // 2 :][: r + 1] for q in range(size)]
        ),
    )
    cases["barrier"] = (lambda r, _: barrier("barrier"), lambda r, _: None)
    return cases


def check(name: str, result: Any, expected: Any) -> None:
    if name == "alltoall":
        output, received = result
        expected_rows = [output.shape[0] // len(received)] * len(received)
        assert torch.equal(output, expected) and received.tolist() == expected_rows, name
    elif isinstance(expected, list):
        assert len(result) == len(expected), name
        assert all(torch.equal(a, b) for a, b in zip(result, expected)), name
    elif expected is None:
        assert result is None, name
    elif expected.is_floating_point():  # Average may scale by 1/n rather than divide by n
        assert result.dtype == expected.dtype and result.shape == expected.shape, name
        assert torch.allclose(result, expected, rtol=1e-12, atol=0), f"{name}: {result}"
    else:
        assert torch.equal(result, expected), f"{name}: {result} != {expected}"


def recorded(operation: Operation, done: list[str]) -> Operation:
    """``operation`` appending its name to ``done`` when it completes (on the engine thread)."""
    inner = operation.finish

    def finish(raw: Any) -> Any:
        done.append(operation.name)
        return inner(raw) if inner else raw

    operation.finish = finish
    return operation


def submit_round(engine: Engine, cases: dict[str, Case], order: list[str], k: int = 0) -> list[str]:
    """Submit ``cases`` in ``order``, check every result; the order they completed in."""
    done: list[str] = []
    handles = {n: engine.submit(recorded(cases[n][0](engine.rank, k), done)) for n in order}
    for name, handle in handles.items():
        check(name, wait(handle), cases[name][1](engine.rank, k))
    return done


Rounds = list[tuple[list[str], int]]  # per round: (completion order, name exchanges)


def run_rounds(
    orders: Callable[[int, int, list[str]], list[str]], size: int = SIZE, **settings: Any
) -> list[Rounds]:
    """ROUNDS rounds of the whole workload on ``size`` ranks, each rank submitting in
    ``orders(rank, round, names)``; per rank, per round: (completion order, name exchanges)."""
    cases = workload(size)
    backends: dict[int, CountingBackend] = {}

    def wrap(backend: LoopbackBackend) -> CountingBackend:
        return backends.setdefault(backend.rank, CountingBackend(backend))

    def fn(engine: Engine) -> Rounds:
        counter = backends[engine.rank]
        rounds = []
        for k in range(ROUNDS):
            before = counter.name_exchanges
            order = submit_round(engine, cases, orders(engine.rank, k, list(cases)), k)
            rounds.append((order, counter.name_exchanges - before))
        return rounds

    return run_engines(size, fn, wrap=wrap, **settings)


def reversed_on_odd_ranks(rank: int, k: int, names: list[str]) -> list[str]:
    return names[::-1] if rank % 2 else names


def shuffled(rank: int, k: int, names: list[str]) -> list[str]:
    random.Random(1000 * k + rank).shuffle(names)
    return names


def assert_one_order(per_rank: list[Rounds]) -> None:
    for k in range(ROUNDS):
        orders = [rounds[k][0] for rounds in per_rank]
        assert sorted(orders[0]) == sorted(workload(len(per_rank))), f"round {k}: not all done"
        assert all(order == orders[0] for order in orders), f"round {k}: orders {orders}"


# -- one order for all -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("orders", "size"),
    [(reversed_on_odd_ranks, 3), (shuffled, 1), (shuffled, 2), (shuffled, 4)],
    ids=["reversed-3", "shuffled-1", "shuffled-2", "shuffled-4"],
)
def test_all_ranks_execute_in_one_order_with_correct_results(
    orders: Callable[[int, int, list[str]], list[str]], size: int
) -> None:
    assert_one_order(run_rounds(orders, size))


def test_steady_state_uses_the_cache_not_name_exchanges() -> None:
    per_rank = run_rounds(shuffled)
    assert_one_order(per_rank)
    for rank, rounds in enumerate(per_rank):
        first, *later = [exchanges for _, exchanges in rounds]
        assert first >= 1, f"rank {rank}: the first round must announce its names"
        assert later == [0] * (ROUNDS - 1), f"rank {rank}: name exchanges per round {rounds}"


def test_cache_capacity_zero_negotiates_by_name_every_round() -> None:
    per_rank = run_rounds(shuffled, cache_capacity=0)
    assert_one_order(per_rank)
    assert all(exchanges >= 1 for rounds in per_rank for _, exchanges in rounds)


@pytest.mark.parametrize("capacity", [1, 4])
def test_cache_smaller_than_the_workload_evicts_and_stays_correct(capacity: int) -> None:
    per_rank = run_rounds(shuffled, cache_capacity=capacity)
    assert_one_order(per_rank)
    # More names than slots: every round some of them must be announced again.
    assert all(exchanges >= 1 for rounds in per_rank for _, exchanges in rounds)


def test_operations_submitted_at_different_times_agree() -> None:
    """Rank r waits for rank r - 1's submissions: every op first reaches the negotiation from
    one rank, then the others (partial states across many cycles)."""
    turns = [threading.Event() for _ in range(SIZE)]
    cases = workload(SIZE)

    def fn(engine: Engine) -> list[str]:
        if engine.rank:
            assert turns[engine.rank - 1].wait(WAIT_S)
        done: list[str] = []
        order = shuffled(engine.rank, 0, list(cases))
        handles = {n: engine.submit(recorded(cases[n][0](engine.rank, 0), done)) for n in order}
        turns[engine.rank].set()
        for name, handle in handles.items():
            check(name, wait(handle), cases[name][1](engine.rank, 0))
        return done

    orders = run_engines(SIZE, fn)
    assert sorted(orders[0]) == sorted(cases)
    assert orders[1:] == [orders[0]] * (SIZE - 1)


def test_cached_names_with_new_shapes_renegotiate() -> None:
    """A smaller last batch: a cached allreduce changes shape on every rank; an allgather's
    first dimension changes on some ranks only (it is per rank, so only those re-announce)."""
    numels = [4, 4, 3, 3, 0, 4]

    def fn(engine: Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
        r = engine.rank
        return [
            (
                wait(engine.submit(allreduce("grad", torch.full((n,), float(r + 1))))),
                wait(engine.submit(allgather("rows", torch.full(((k + r) % 3, 2), float(r))))),
            )
            for k, n in enumerate(numels)
        ]

    for outs in run_engines(SIZE, fn):
        for k, (n, (reduced, gathered)) in enumerate(zip(numels, outs)):
            assert torch.equal(reduced, torch.full((n,), 6.0)), k
            rows = [torch.full(((k + q) % 3, 2), float(q)) for q in range(SIZE)]
            assert torch.equal(gathered, torch.cat(rows)), k


# -- mismatches ------------------------------------------------------------------------------------
# field -> (rank r's operation named "x" (rank 1 disagrees), what the error says, per rank: a
# regex of the value shown).
MISMATCHES: dict[str, tuple[Callable[[int], Operation], str, tuple[str, ...]]] = {
    "shape": (
        lambda r: allreduce("x", torch.ones(4 + r % 2)),
        "shape",
        (r"\[4\]", r"\[5\]", r"\[4\]"),  # plainly, not ((4,),)
    ),
    "dtype": (
        lambda r: allreduce("x", torch.ones(4, dtype=torch.float64 if r == 1 else torch.float32)),
        "dtype",
        ("'float32'", "'float64'", "'float32'"),
    ),
    "op": (
        lambda r: allreduce("x", torch.ones(4), ReduceOp.Max if r == 1 else ReduceOp.Sum),
        "reduce op",
        ("'Sum'", "'Max'", "'Sum'"),
    ),
    "root": (lambda r: broadcast("x", torch.ones(4), root=r % 2), "root rank", ("0", "1", "0")),
    "kind": (
        lambda r: broadcast("x", torch.ones(4), 0) if r == 1 else allreduce("x", torch.ones(4)),
        "operation",
        ("'allreduce'", "'broadcast'", "'allreduce'"),
    ),
    "allgather": (
        lambda r: allgather("x", torch.ones(2, 3 + r % 2)),
        "shape after the first dimension",
        (r"\[3\]", r"\[4\]", r"\[3\]"),
    ),
}


@pytest.mark.parametrize("cached", [False, True], ids=["new", "cached"])
@pytest.mark.parametrize("field", list(MISMATCHES))
def test_mismatch_fails_on_every_rank_then_the_name_works_again(field: str, cached: bool) -> None:
    """Rank 1 disagrees with rank 0 (rank 2 agrees with rank 0); ``cached``: the name ran
    before with matching arguments, so rank 0 and 2 find it in the cache."""
    build, what, shown = MISMATCHES[field]
    values = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
    message = re.escape(f"'x': {what} differs across ranks (") + values + r"\)"

    def fn(engine: Engine) -> str:
        if cached:
            wait(engine.submit(build(0)))
        with pytest.raises(TensorMismatchError) as info:
            wait(engine.submit(build(1 if engine.rank == 1 else 0)))
        # The name is free again and negotiates anew: the same arguments everywhere work.
        out = wait(engine.submit(allreduce("x", torch.full((3,), float(engine.rank)))))
        assert torch.equal(out, torch.full((3,), 3.0))
        return str(info.value)

    for rank, error in enumerate(run_engines(SIZE, fn)):
        assert error.startswith(f"rank {rank}: ")
        assert re.search(message, error), error


def test_mismatched_grouped_allreduce_names_every_rank_value() -> None:
    def fn(engine: Engine) -> str:
        tensors = [torch.ones(2), torch.ones(3 if engine.rank == 2 else 1)]
        with pytest.raises(TensorMismatchError) as info:
            wait(engine.submit(grouped_allreduce("g", tensors)))
        return str(info.value)

    for error in run_engines(SIZE, fn):
        assert "'g'" in error
        assert "rank 0: ([2], [1]), rank 1: ([2], [1]), rank 2: ([2], [3])" in error


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (((3,),), "[3]"),
        (((),), "[]"),
        (((2, 3), (4,)), "([2, 3], [4])"),
        ((1,), "1"),
        ((1, 2), "(1, 2)"),
        ("float32", "'float32'"),
        (0, "0"),
    ],
)
def test_values_in_mismatch_errors_are_plain(value: object, shown: str) -> None:
    assert negotiation.plain(value) == shown


# -- stalls ----------------------------------------------------------------------------------------
def stall_warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "commlayer" and r.levelno == logging.WARNING and repr(name) in r.getMessage()
    ]


@pytest.mark.parametrize("cached", [False, True], ids=["new", "cached"])
def test_stall_warning_names_op_and_missing_ranks_then_completes(
    caplog: pytest.LogCaptureFixture, cached: bool
) -> None:
    """Rank 1 submits only once rank 0 saw the warning; the operation then completes.
    ``cached``: the name ran before, so ranks 0 and 2 hold a cache hit, not an announcement."""
    caplog.set_level(logging.WARNING, logger="commlayer")
    warned = threading.Event()
    expected = "'late' was submitted by ranks [0, 2] but not by ranks [1]"

    def seen() -> bool:
        return any(expected in m for m in stall_warnings(caplog, "late"))

    def fn(engine: Engine) -> torch.Tensor:
        if cached:
            wait(engine.submit(allreduce("late", torch.ones(2))))
        if engine.rank == 1:
            assert warned.wait(WAIT_S), "no stall warning"
        handle = engine.submit(allreduce("late", torch.ones(2)))
        if engine.rank == 0:
            try:
                wait_until(seen, WAIT_S, f"no stall warning {expected!r}", poll_s=0.005)
            finally:
                warned.set()  # rank 1 goes on either way: no second wait for the same failure
        return wait(handle)

    results = run_engines(3, fn, stall_check_time_s=0.05)
    assert all(torch.equal(out, torch.full((2,), 3.0)) for out in results)
    assert seen(), caplog.text


def _wait_stopped(engine: Engine) -> None:
    wait_until(lambda: not engine.running, WAIT_S, f"rank {engine.rank}: engine still running")


def test_stall_shutdown_fails_every_rank_and_stops_the_engines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The ranks holding the operation get StallError for it; rank 2, which never submitted it,
    gets the same news as its engine stops (logged at once; raised by its next collective);
    every engine stops, so no rank can go on into collectives its peers will never join."""
    caplog.set_level(logging.WARNING, logger="commlayer")

    def fn(engine: Engine) -> list[str]:
        errors = []
        if engine.rank != 2:
            with pytest.raises(StallError) as info:
                wait(engine.submit(allreduce("lonely", torch.ones(2))))
            errors.append(str(info.value))
        else:
            _wait_stopped(engine)
        # at its submission, also right after the StallError woke this thread: the engine
        # takes nothing more once it failed a stall
        with pytest.raises(StallError) as info:
            engine.submit(allreduce("after", torch.ones(2)))
        errors.append(str(info.value))
        _wait_stopped(engine)
        return errors

    errors = run_engines(3, fn, stall_check_time_s=0.05, stall_shutdown_time_s=0.5)
    described = "allreduce 'lonely' stalled: submitted by ranks [0, 1], never by ranks [2]"
    for rank in range(3):
        for message in errors[rank]:
            assert message.startswith(f"rank {rank}: "), message
            assert described in message, message
        assert "cannot run 'after'" in errors[rank][-1], errors[rank]
    expected = "'lonely' was submitted by ranks [0, 1] but not by ranks [2]"
    assert any(expected in m for m in stall_warnings(caplog, "lonely")), caplog.text
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for rank in range(3):
        assert any(m.startswith(f"commlayer rank {rank}: engine stopped: ") for m in logged)


def test_a_stall_in_a_process_set_stops_the_ranks_outside_it_too() -> None:
    """Ranks 0 and 1 stall in their process set; they stop with StallError and say goodbye on
    the global set, so rank 2, outside the set, stops too (naming them) rather than wait in a
    global negotiation they no longer join."""

    def fn(engine: Engine) -> str:
        set_id, _ = engine.register_process_set([0, 1])
        engine.start()
        if engine.rank == 0:
            op = allreduce("pair", torch.ones(2))
            op.process_set_id = set_id
            with pytest.raises(StallError):
                wait(engine.submit(op))
        _wait_stopped(engine)
        with pytest.raises((StallError, ShutdownError)) as info:
            engine.submit(allreduce("after", torch.ones(2)))
        return f"{type(info.value).__name__}: {info.value}"

    errors = run_engines(3, fn, start=False, stall_check_time_s=0.05, stall_shutdown_time_s=0.3)
    described = "allreduce 'pair' stalled: submitted by ranks [0], never by ranks [1]"
    for rank in (0, 1):
        assert errors[rank].startswith(f"StallError: rank {rank}: "), errors[rank]
        assert described in errors[rank], errors[rank]
    assert errors[2].startswith("ShutdownError: rank 2: "), errors[2]
    assert "rank(s) [0, 1] shut down" in errors[2], errors[2]
