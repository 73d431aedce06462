"""The harness itself: a job that hangs is killed at its limit, whole process tree included,
and reported as a failure with every rank's stacks."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import RunMPI


def _python_processes_running(script: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if script.encode() in cmdline.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_hang_fails_with_stacks_and_leaves_no_process(run_mpi: RunMPI) -> None:
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as caught:
        run_mpi("hang.py", 2, timeout_s=3.0)
    assert time.monotonic() - started < 10.0
    report = str(caught.value)
    assert report.startswith("HANG: killed after 3 s")
    assert report.count('"event": "hanging"') == 2, report  # what the ranks wrote so far
    assert report.count("Current thread") == 2, report  # each rank dumped its stacks
    # Both ranks write to one pipe, and faulthandler writes a frame in pieces, so the two dumps
    # can interleave mid-line: count the pieces, not whole lines.
    assert report.count("hang.py") >= 3, report  # the command line, then one frame per rank
    assert report.count("line 13 in <module>") == 2, report  # where each main thread sleeps
    assert _python_processes_running("scripts/hang.py") == []
