"""Online tuning of ``auto`` (algorithms/autotune.py): the order in which candidates are
measured, the agreed decision (every rank the same pick, from everyone's times), the rounds that
measure the pick against the runner-up again, and results that stay right throughout."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from waiting import wait_until

from commlayer.algorithms import autotune
from commlayer.algorithms.autotune import SAMPLES, Tuner
from commlayer.backends.base import COMPLETED, Backend, Request
from commlayer.backends.loopback import LoopbackBackend, run_ranks
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.core.selection import Allreducer

FIRST = autotune.CALLS_PER_RUN * SAMPLES  # calls before the first new round, 1 MiB and more


def test_the_interval_doubles_up_to_its_cap() -> None:
    tuner = Tuner()
    tuner.add("k", ["a", "b"])
    intervals = []
    for _ in range(7):
        tuner._classes["k"].candidates = ["a", "b"]
        tuner.decide("k", [1e-6, 2e-6])  # 1 us a call: the time bound is far away
        intervals.append(tuner._classes["k"].interval)
    assert intervals == [FIRST * 2**k for k in (0, 1, 2, 3, 4, 4, 4)]


def test_the_interval_stops_doubling_at_max_interval_s_of_the_picks_calls() -> None:
    """Picks of 1 ms a call (summed over 4 ranks: 4 ms) double to 2,000 calls, 2 s of them, and
    no further; picks slower than MAX_INTERVAL_S / FIRST keep the first interval."""
    limit = int(autotune.MAX_INTERVAL_S / 1e-3)
    assert FIRST < limit < FIRST << autotune.MAX_INTERVAL_DOUBLINGS  # the test means something
    for per_call, expected in ((1e-3, limit), (1.0, FIRST)):
        tuner = Tuner()
        tuner.add("k", ["a", "b"])
        intervals = []
        for _ in range(6):
            tuner._classes["k"].candidates = ["a", "b"]
            tuner.decide("k", [4 * per_call, 8 * per_call], ranks=4)
            intervals.append(tuner._classes["k"].interval)
        assert intervals[0] == FIRST
        assert max(intervals) == intervals[-1] == expected


class _OneRank:
    """The one call _Timed makes on a backend: the agreement, here over a single rank."""

    size = 1

    def iallreduce(self, send: Any, recv: torch.Tensor, op: ReduceOp) -> Request:
        return COMPLETED


def _call(tuner: Tuner, key: str = "k", ranked: tuple[str, ...] = ("a", "b", "c")) -> str:
    name = tuner.peek(key) or tuner.add(key, list(ranked))
    request = tuner.start(key, name, _OneRank(), COMPLETED)  # type: ignore[arg-type]
    assert request.test()
    return name


def test_candidates_are_measured_round_robin_then_the_pick_stands() -> None:
    tuner = Tuner()
    names = [_call(tuner) for _ in range(autotune.round_calls(3, SAMPLES))]
    assert names == ["a"] * (SAMPLES + 1) + ["b"] * (SAMPLES + 1) + ["c"] * (SAMPLES + 1)
    assert tuner.rounds == 1
    pick = tuner.decided("k")
    assert pick in ("a", "b", "c")
    assert {_call(tuner) for _ in range(autotune.CALLS_PER_RUN * SAMPLES)} == {pick}


def test_measures_says_beforehand_which_calls_are_timed() -> None:
    # runners/allreduce.py asks before posting, to run a measured call alone: the answer must
    # be what start() then does, through a first round and the next one
    tuner = Tuner()
    calls = autotune.round_calls(3, SAMPLES) + FIRST + autotune.round_calls(2, SAMPLES)
    said, done = [], []
    for _ in range(calls):
        name = tuner.peek("k") or tuner.add("k", ["a", "b", "c"])
        said.append(tuner.measures("k"))
        request = tuner.start("k", name, _OneRank(), COMPLETED)  # type: ignore[arg-type]
        done.append(request is not COMPLETED)
        assert request.test()
    assert said == done
    assert sum(done) == 3 * SAMPLES + 2 * SAMPLES  # both rounds measured (the test means it)


def test_the_fastest_by_everyones_sum_is_taken_ties_in_the_models_order() -> None:
    tuner = Tuner()
    tuner.add("k", ["a", "b", "c"])
    tuner.decide("k", [3.0, 1.0, 2.0])
    assert tuner.decided("k") == "b"
    tuner = Tuner()
    tuner.add("k", ["a", "b", "c"])
    tuner.decide("k", [2.0, 2.0, 2.0])
    assert tuner.decided("k") == "a"


def test_record_gives_the_lower_quartiles_once_every_candidate_has_its_samples() -> None:
    tuner = Tuner()
    tuner.add("k", ["a", "b"])
    times = {"a": [5.0, 1.0, 2.0, 7.0, 0.5], "b": [4.0, 9.0, 3.0, 8.0, 1.0]}
    results = []
    for i in range(SAMPLES):
        for name in ("a", "b"):
            results.append(tuner.record("k", name, times[name][i]))
    assert results[:-1] == [None] * (2 * SAMPLES - 1)
    assert results[-1] == [1.0, 3.0]  # the 2nd fastest of 5


def test_a_new_round_measures_the_pick_against_the_runner_up_and_the_interval_grows() -> None:
    tuner = Tuner()
    tuner.add("k", ["a", "b", "c"])
    tuner.decide("k", [1.0, 2.0, 3.0])  # a, then b
    for _ in range(FIRST):
        assert _call(tuner) == "a"
    calls = [_call(tuner) for _ in range(autotune.round_calls(2, SAMPLES))]
    assert calls == ["a"] * (SAMPLES + 1) + ["b"] * (SAMPLES + 1)
    assert tuner.rounds == 2  # the agreement of that round ran on its last call
    state = tuner._classes["k"]
    assert state.candidates == []
    # COMPLETED requests take ~0 s each, so either may have won; the interval follows the pick
    kept = tuner.decided("k") == "a"
    assert state.interval == FIRST * (2 if kept else 1)


def test_a_changed_pick_starts_the_interval_over() -> None:
    tuner = Tuner()
    tuner.add("k", ["a", "b", "c"])
    tuner.decide("k", [1.0, 2.0, 3.0])
    state = tuner._classes["k"]
    state.candidates = ["a", "b"]  # as a new round sets them
    tuner.decide("k", [1e-6, 2e-6])  # same pick again: the interval doubles
    assert state.interval == 2 * FIRST
    state.candidates = ["a", "b"]
    tuner.decide("k", [2.0, 1.0])  # b now
    assert tuner.decided("k") == "b"
    assert state.interval == FIRST
    assert state.runner_up == "a"


def test_one_candidate_is_not_measured() -> None:
    tuner = Tuner()
    assert [_call(tuner, ranked=("native",)) for _ in range(5)] == ["native"] * 5
    assert tuner.rounds == 0


class _Slow:
    """A request that completes ``delay_s`` after it started (and after the inner one did)."""

    def __init__(self, request: Request, delay_s: float) -> None:
        self._request, self._until = request, time.perf_counter() + delay_s

    def test(self) -> bool:
        return self._request.test() and time.perf_counter() >= self._until


class _Delayed(Allreducer):
    """Allreducer whose algorithms take a chosen extra time per rank."""

    def __init__(self, delays: dict[str, float]) -> None:
        super().__init__("auto", tuning=True)
        self.delays = delays

    def _run(self, name: str, backend: Backend, *args: Any) -> Request:
        return _Slow(super()._run(name, backend, *args), self.delays.get(name, 0.0))


def _drive(backend: Backend, allreducer: Allreducer, buf: torch.Tensor) -> None:
    request = allreducer(backend, None, buf, ReduceOp.Sum)
    wait_until(request.test, 10.0, f"rank {backend.rank}: allreduce did not complete", poll_s=1e-4)


class _Others:
    """The agreement as seen from one rank: the other ranks' times are added to its own."""

    size = 2  # this rank and "the others"; only the interval between rounds reads it

    def __init__(self, others: list[float]) -> None:
        self.others = others

    def iallreduce(self, send: Any, recv: torch.Tensor, op: ReduceOp) -> Request:
        assert send is None and op == ReduceOp.Sum
        recv += torch.tensor(self.others, dtype=recv.dtype)
        return COMPLETED


def test_the_pick_is_the_fastest_by_everyones_times_not_this_ranks() -> None:
    # This rank's calls take ~0 s on both candidates (so its own clock would keep "a", the
    # model's first); the others found "a" 5 s and "b" 1 s per call: "b" it is.
    tuner = Tuner()
    backend = _Others([5.0, 1.0])
    for _ in range(autotune.round_calls(2, SAMPLES)):
        name = tuner.peek("k") or tuner.add("k", ["a", "b"])
        request = tuner.start("k", name, backend, COMPLETED)  # type: ignore[arg-type]
        assert request.test()
    assert tuner.decided("k") == "b"


def test_every_rank_takes_the_same_pick_and_every_result_is_right() -> None:
    # Rank 0 is slow with mpi, ranks 1 and 2 with recursive_doubling, less so: every call waits
    # for its slowest rank, so every rank measures mpi ~10 ms and recursive_doubling ~6 ms.
    delays = [
        {"native": 0.010},
        {"recursive_doubling": 0.006},
        {"recursive_doubling": 0.006},
    ]
    runs = autotune.samples(400)

    def main(backend: LoopbackBackend) -> tuple[list[str], str, bool]:
        allreducer = _Delayed(delays[backend.rank])
        seen = []
        right = True
        for step in range(autotune.round_calls(2, runs)):  # 2 candidates: 400 B, no calibration
            buf = torch.full((100,), float(backend.rank + step))
            seen.append(allreducer._next(backend, 100, 4)[0])
            _drive(backend, allreducer, buf)
            right = right and torch.equal(buf, torch.full((100,), float(3 + 3 * step)))
        return seen, allreducer.choose(backend, 100, 4), right

    results = run_ranks(3, main)
    measured = results[0][0]
    assert set(measured) == {"native", "recursive_doubling"}  # small buffers, no calibration
    for seen, pick, right in results:
        assert seen == measured
        assert pick == "recursive_doubling"
        assert right


def test_tuning_off_and_fixed_algorithms_measure_nothing() -> None:
    def main(backend: LoopbackBackend) -> list[str]:
        picks = []
        for allreducer in (Allreducer("auto"), Allreducer("ring", tuning=True)):
            for _ in range(3 * SAMPLES):
                _drive(backend, allreducer, torch.ones(10))
            assert allreducer._tuner.rounds == 0
            picks.append(allreducer.choose(backend, 10, 4))
        return picks

    for picks in run_ranks(2, main):
        assert picks == ["native", "ring"]


@pytest.mark.parametrize("size", [2, 4])
def test_results_stay_right_while_tuning_several_size_classes(size: int) -> None:
    def main(backend: LoopbackBackend) -> int:
        allreducer = Allreducer("auto", topology=Topology.flat(size), tuning=True)
        for numel in (3, 1000, 70_000):
            runs = autotune.samples(4 * numel)
            for step in range(autotune.round_calls(autotune.CANDIDATES, runs) + 1):
                buf = torch.full((numel,), float(backend.rank * step))
                _drive(backend, allreducer, buf)
                expected = float(step * sum(range(size)))
                assert torch.equal(buf, torch.full((numel,), expected)), (numel, step)
        return allreducer._tuner.rounds

    assert run_ranks(size, main) == [3] * size
