"""Online tuning of ``auto``: measured times choose among the cost model's best candidates.

1. The cost model ranks the algorithms for a size class from a calibration taken once. On a
   machine whose speed drifts that ranking can be far off: this VM has two states, and in the
   slow one the shared-memory window is no faster than MPICH while the schedules are ~2x faster
   (benchmarks/results/algorithms_np2.md: auto's model pick was 0.48-0.60x of the best at
   16-256 MiB in two runs).
2. So for each (process set, power-of-two size class) the first calls explore: each of the
   model's ``CANDIDATES`` best (``costmodel.ranked``) runs ``samples(nbytes)`` + 1 times in a
   row; the first run of each block is not counted (the switch from another algorithm slowed
   MPICH's next call at 256 KiB by up to 1.5x, more than the gap between candidates). A
   candidate's time is the lower quartile of its counted runs (the 2nd fastest of 5), each from
   the start of the call to the ``test()`` that completes it: about what a call costs when
   nothing else holds it up, without trusting one lucky run. The median misled in training,
   where a size class mixes calls made while backward keeps both cores busy (~14 ms for 3 MB)
   with calls after it (~1 ms): which candidate drew more of the slow ones decided
   (rabenseifner 2.7 ms against the window's 21 ms, the reverse of their uncontended times).
   The fastest run misled at 4 ranks on 2 cores, where the window's best call at 64 KiB was
   good and its typical one 0.82x of MPICH's. Small buffers get more runs: a call of tens of
   microseconds is at the mercy of one descheduled rank, and many runs of it cost little.
3. Then every rank adds its times to one allreduce (Sum) on the same backend, started as the
   last exploration call completes: every rank reaches that point at the same call, as ranks
   run the same allreduces in the same order. All ranks take the argmin of the same numbers
   (ties: the model's order), so they agree without any other message.
4. The pick stands for ``CALLS_PER_RUN`` calls of its class per run of a round (250 calls
   from 1 MiB, 1250 below 64 KiB), then it and the runner-up are measured again (as many runs
   each, agreed the same way); the interval doubles while the pick stays, up to
   ``MAX_INTERVAL_DOUBLINGS`` times and while the pick's calls in it take at most
   ``MAX_INTERVAL_S`` (by the agreed times), and starts over when it changes. So a change of
   the machine's state is noticed within seconds of the class's calls, at the price of at most
   2% of a class's calls going to the runner-up.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Hashable

import torch

from commlayer.backends.base import Backend, Request
from commlayer.common.reduce_ops import ReduceOp

log = logging.getLogger("commlayer")

CANDIDATES = 4  # costmodel.ranked: the model's pick, the natives, the two best schedules
# Runs per candidate and round, buffers of 1 MiB and more (with 3, at 4 ranks on 2 cores, one
# round picked shd at 256 MiB, 0.62x of the window).
SAMPLES = 5


def samples(nbytes: int) -> int:
    """Runs per candidate and round for a buffer of ``nbytes`` (the same on every rank)."""
    if nbytes >= 1 << 20:
        return SAMPLES
    return 9 if nbytes >= 64 << 10 else 25


CALLS_PER_RUN = 50  # first interval between rounds: this many calls per run of a round
MAX_INTERVAL_DOUBLINGS = 4
# The interval doubles only while the pick's calls in it take less than this (by its measured
# time): this VM switches states every tens of seconds; at 2 ranks, 16 MiB, a pick made in one
# (shm, 2.3 ms a call) measured 1.7x slower than the schedules in the other, and its interval
# could reach 16 x 250 calls, ~28 s at 7 ms, before it was measured again.
MAX_INTERVAL_S = 2.0


def round_calls(candidates: int, runs: int) -> int:
    """Calls of a round: a block of ``runs`` + 1 per candidate (the first one not counted)."""
    return candidates * (runs + 1)


def _lower_quartile(runs: list[float]) -> float:
    return sorted(runs)[len(runs) // 4]


@dataclasses.dataclass
class _SizeClass:
    """Tuning state of one (backend, size class)."""

    candidates: list[str]  # being measured now (model's order); empty once decided
    runs: int  # per candidate and round
    label: str = ""  # for the log
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    started: int = 0  # calls started in this round (measured or not)
    chosen: str = ""
    runner_up: str = ""
    interval: int = 0  # calls between rounds, set at each decision
    left: int = 0  # calls of the chosen one before the next round

    def current(self) -> str:
        """The algorithm of the next call."""
        if not self.candidates:
            return self.chosen
        if self.started >= self.round_calls():  # a round awaiting its agreement
            return self.chosen or self.candidates[0]
        return self.candidates[self.started // (self.runs + 1)]

    def round_calls(self) -> int:
        return round_calls(len(self.candidates), self.runs)


class Tuner:
    """Per (backend, size class): which algorithm runs the next call, and what was measured."""

    def __init__(self) -> None:
        self._classes: dict[Hashable, _SizeClass] = {}
        self.rounds = 0  # agreed decisions taken (tests, benchmarks)

    def peek(self, key: Hashable) -> str | None:
        """The algorithm the next call of this class will run; None for a class not seen yet
        (``add`` it). The per-call path: one dict lookup."""
        state = self._classes.get(key)
        return None if state is None else state.current()

    def add(self, key: Hashable, names: list[str], runs: int = SAMPLES, label: str = "") -> str:
        """A new class: ``names`` the candidates in the model's order, ``runs`` per candidate
        and round (``samples(nbytes)``), ``label`` the class in words for the log. Returns the
        algorithm of its first call."""
        measured = names if len(names) > 1 else []
        state = self._classes[key] = _SizeClass(measured, runs, label, chosen=names[0])
        return state.current()

    def decided(self, key: Hashable) -> str:
        """The agreed pick of this class, or "" before its first round was agreed."""
        state = self._classes.get(key)
        return state.chosen if state is not None and state.runner_up else ""

    def start(
        self,
        key: Hashable,
        name: str,
        backend: Backend,
        request: Request,
        extra_s: float = 0.0,
    ) -> Request:
        """Account a call of ``name`` (the current pick, ``peek``): the request itself, or
        wrapped to time it when this call is a measurement. ``extra_s``: time the caller spends
        on this call's behalf outside the request (packing a fusion buffer and unpacking it),
        added to the measurement so that the window, which copies the tensors itself, is
        compared with the others on the same work."""
        state = self._classes[key]
        if not state.candidates:
            state.left -= 1
            if state.left > 0 or not state.runner_up:
                return request
            state.candidates = [state.chosen, state.runner_up]  # a new round, from the next call
            state.samples, state.started = {}, 0
            return request
        if state.started >= state.round_calls():
            return request
        timed = _timed_next(state)
        state.started += 1
        return _Timed(self, key, name, backend, request, extra_s) if timed else request

    def measures(self, key: Hashable) -> bool:
        """Whether the next call of ``key``'s class (its next ``start``) is a measurement, asked
        before it is posted: a measured call runs alone (runners/allreduce.py, 3.)."""
        state = self._classes.get(key)
        return state is not None and _timed_next(state)

    def record(self, key: Hashable, name: str, seconds: float) -> list[float] | None:
        """One measured call completed; this rank's times (lower quartile of each candidate's
        runs) when the round is complete."""
        state = self._classes[key]
        state.samples.setdefault(name, []).append(seconds)
        if any(len(state.samples.get(n, ())) < state.runs for n in state.candidates):
            return None
        return [_lower_quartile(state.samples[n]) for n in state.candidates]

    def decide(self, key: Hashable, totals: list[float], ranks: int = 1) -> None:
        """Every rank's times summed over ``ranks`` ranks (the same numbers on every rank):
        take the fastest. The interval to the next round doubles while the pick stays, up to
        ``MAX_INTERVAL_DOUBLINGS`` times, and is cut to ``MAX_INTERVAL_S`` of the pick's calls
        at its newly measured time (a pick that got slower is measured again sooner), never
        below the first interval; computed from the agreed numbers, so the same on every
        rank."""
        state = self._classes[key]
        order = sorted(range(len(totals)), key=lambda i: (totals[i], i))
        log.debug(
            "auto tuning, %s: %s (lower quartile ms per call, summed over ranks) -> %s",
            state.label or key,
            {n: round(t * 1e3, 3) for n, t in zip(state.candidates, totals, strict=True)},
            state.candidates[order[0]],
        )
        chosen, runner_up = state.candidates[order[0]], state.candidates[order[1]]
        first = CALLS_PER_RUN * state.runs
        if chosen == state.chosen and state.runner_up:  # kept: wait longer before the next round
            per_call = totals[order[0]] / max(ranks, 1)
            in_time = int(MAX_INTERVAL_S / per_call) if per_call > 0 else first
            state.interval = min(
                2 * state.interval, first << MAX_INTERVAL_DOUBLINGS, max(first, in_time)
            )
        else:
            state.interval = first
        state.chosen, state.runner_up = chosen, runner_up
        state.candidates, state.samples, state.started = [], {}, 0
        state.left = state.interval
        self.rounds += 1


def _timed_next(state: _SizeClass) -> bool:
    """Whether ``state``'s next call is timed: a round is on, not all its calls are started,
    and the call is not the first of its block (that one is not counted)."""
    return (
        bool(state.candidates)
        and state.started < state.round_calls()
        and state.started % (state.runs + 1) != 0
    )


class _Timed:
    """A measured call: times the request to completion, then (last of a round) agrees."""

    __slots__ = ("_agree", "_backend", "_done", "_key", "_name", "_request", "_start", "_tuner")

    def __init__(
        self,
        tuner: Tuner,
        key: Hashable,
        name: str,
        backend: Backend,
        request: Request,
        extra_s: float,
    ) -> None:
        self._tuner = tuner
        self._key = key
        self._name = name
        self._backend = backend
        self._request = request
        self._start = time.perf_counter() - extra_s
        self._agree: tuple[Request, torch.Tensor] | None = None
        self._done = False

    def test(self) -> bool:
        if self._done:
            return True
        if self._agree is None:
            if not self._request.test():
                return False
            seconds = time.perf_counter() - self._start
            times = self._tuner.record(self._key, self._name, seconds)
            if times is None:
                self._done = True
                return True
            votes = torch.tensor(times, dtype=torch.float64)
            self._agree = (self._backend.iallreduce(None, votes, ReduceOp.Sum), votes)
        request, votes = self._agree
        if not request.test():
            return False
        self._tuner.decide(self._key, votes.tolist(), self._backend.size)
        self._done = True
        return True
