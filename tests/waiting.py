"""Waiting in tests: poll a condition until it holds, for at most a given time.

The one deadline-poll loop of the test suites (unit, parallel, system) and of the system tests'
worker scripts. It is imported as ``waiting``: pytest finds it through ``pythonpath`` in
pyproject.toml, the worker scripts through the PYTHONPATH their harness sets
(tests/system/conftest.py ``worker_env``).

A test waits on something the code under test does (a request completes, a process writes a
record, a log line appears), never sleeps a guessed time; the limit only turns a hang into a
failure that says what never happened, so it is generous: far above a healthy run on a loaded
2-core machine, below the suite's timeouts.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """An instant ``limit_s`` from now on the monotonic clock, for waits made of several calls
    (each given what is left)."""

    __slots__ = ("limit_s", "_at")

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._at = time.monotonic() + limit_s

    def left_s(self) -> float:
        """Seconds left, 0 once passed."""
        return max(0.0, self._at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self._at


def poll(ready: Callable[[], object], limit_s: float, poll_s: float = 0.0) -> bool:
    """Call ``ready`` until it returns something true (then True) or ``limit_s`` has passed
    (then False), sleeping ``poll_s`` between calls (0: just yield the CPU and the GIL, for a
    request whose ``test()`` is what makes it progress). ``ready`` is called once more after
    the deadline, so a condition that became true while the caller slept is not missed."""
    deadline = Deadline(limit_s)
    while True:
        late = deadline.passed()
        if ready():
            return True
        if late:
            return False
        time.sleep(poll_s)


def wait_until(ready: Callable[[], object], limit_s: float, what: str, poll_s: float = 0.0) -> None:
    """``poll``, raising AssertionError with ``what`` (what did not happen) past ``limit_s``."""
    if not poll(ready, limit_s, poll_s):
        raise AssertionError(f"{what} (waited {limit_s:g} s)")
