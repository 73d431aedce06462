"""The tests' deadline-poll helper (tests/waiting.py): it returns as soon as the condition
holds, and fails, naming what never happened, once the limit has passed."""

from __future__ import annotations

import time

import pytest
from waiting import Deadline, poll, wait_until


def test_poll_returns_once_ready() -> None:
    calls = iter([False, False, True])
    assert poll(lambda: next(calls), 10.0) is True


def test_poll_gives_up_after_the_limit_but_asks_once_more() -> None:
    asked: list[float] = []

    def never() -> bool:
        asked.append(time.monotonic())
        return False

    started = time.monotonic()
    assert poll(never, 0.05, poll_s=0.01) is False
    assert asked[-1] - started >= 0.05  # the last answer is from after the deadline


def test_wait_until_names_what_did_not_happen() -> None:
    with pytest.raises(AssertionError, match=r"^rank 1: ring did not complete \(waited 0.01 s\)$"):
        wait_until(lambda: False, 0.01, "rank 1: ring did not complete")


def test_deadline_counts_down_to_zero() -> None:
    deadline = Deadline(0.0)
    assert deadline.passed() and deadline.left_s() == 0.0
    assert 0.0 < Deadline(60.0).left_s() <= 60.0
