"""Stalls: a tensor one rank submits and another never does is named in a warning after
COMMLAYER_STALL_CHECK_TIME_SECONDS, fails with StallError after
COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS, and commlayer stops on every rank: later collectives
fail at once with the StallError. Under mpiexec; under torchrun, and with a rank that never
submits anything, in test_faults_end_jobs.py (which also checks that the job ends)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Job, RunMPI

STALL_ENV = {
    "COMMLAYER_STALL_CHECK_TIME_SECONDS": "1",
    "COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS": "2",
}
# Lower bounds: not before the settings' 1 s and 2 s (less a clock tick). The upper bound only
# tells the setting from the default (10 minutes: the harness kills the job at 45 s), so it is
# generous: measured 1.00-1.04 s to the warning and 2.00-2.03 s to the StallError in 4 runs at
# load average 8, but a loaded 2-core machine may stall the ranks for seconds. The warning has
# no upper bound of its own: it must come before the StallError, an order, exact.
WARN_AFTER_S = 0.9
FAIL_WITHIN_S = (1.9, 15.0)


def _stalled_ops(size: int, mode: str) -> dict[int, tuple[str, str, list[int], list[int]]]:
    """rank -> (kind, name, ranks that submitted it, ranks that did not)."""
    if mode == "lonely":
        others = lambda r: [q for q in range(size) if q != r]  # noqa: E731
        return {r: ("allreduce", f"lonely.{r}", [r], others(r)) for r in range(size)}
    waiting = list(range(1, size))
    ops = {r: ("barrier", "barrier", waiting, [0]) for r in waiting}
    ops[0] = ("allreduce", "lonely", [0], waiting)
    return ops


def _descriptions(size: int, mode: str) -> set[str]:
    """How a StallError describes each operation that stalls in ``mode``."""
    return {
        f"{kind} {name!r} stalled: submitted by ranks {holders}, never by ranks {missing}"
        for kind, name, holders, missing in _stalled_ops(size, mode).values()
    }


def _names_a_stall(message: str, rank: int, size: int, mode: str) -> bool:
    """``message`` is rank ``rank``'s and names one of the stalled operations (the first one
    failed stops every engine, so a rank's own operation can fail with another's error)."""
    return message.startswith(f"rank {rank}: ") and any(
        d in message for d in _descriptions(size, mode)
    )


MODES = [(2, "lonely"), (3, "barrier")]


@pytest.fixture(scope="module", params=MODES, ids=lambda p: f"np{p[0]}-{p[1]}")
def job(request: pytest.FixtureRequest, run_mpi: RunMPI) -> Job:
    """One job per (size, mode), shared by the tests of this module."""
    size, mode = request.param
    return run_mpi("stall.py", size, mode, env=STALL_ENV)


def _t0(job: Job, rank: int) -> float:
    return float(job.one("start", rank)["time"])


def test_stall_warning_names_tensor_and_missing_ranks(job: Job) -> None:
    ops = _stalled_ops(job.size, job.args[0])  # type: ignore[attr-defined]
    for _, name, holders, missing in ops.values():
        line = f"{name!r} was submitted by ranks {holders} but not by ranks {missing}"
        assert line in job.stderr, f"no stall warning {line!r}\n{job.output()}"
    for rank in range(job.size):
        warned = [w for w in job.find("warning", rank) if "stall" in w["message"]]
        assert warned, job.output()
        first_s = min(w["time"] for w in warned) - _t0(job, rank)
        assert first_s >= WARN_AFTER_S, f"warned after {first_s:.1f} s"
        stalled = job.one("stalled", rank)["time"]
        assert min(w["time"] for w in warned) < stalled, "the warning must come first"


def test_stalled_operation_fails_with_stall_error(job: Job) -> None:
    mode = job.args[0]  # type: ignore[attr-defined]
    ops = _stalled_ops(job.size, mode)
    for rank, (_, name, _, _) in ops.items():
        record: dict[str, Any] = job.one("stalled", rank)
        assert record["error"] == "StallError", job.output()
        assert "CommlayerError" in record["classes"]
        assert _names_a_stall(record["message"], rank, job.size, mode), record["message"]
        assert "COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS" in record["message"]
        assert FAIL_WITHIN_S[0] <= record["elapsed_s"] <= FAIL_WITHIN_S[1], job.output()
        warned = [w["time"] for w in job.find("warning", rank) if name in w["message"]]
        assert warned and min(warned) < record["time"], "the warning must come first"


@pytest.mark.parametrize("event", ["after", "barrier_after"])
def test_later_collectives_fail_at_once_with_the_stall_error(job: Job, event: str) -> None:
    mode = job.args[0]  # type: ignore[attr-defined]
    for rank in range(job.size):
        record = job.one(event, rank)
        assert record["error"] == "StallError", job.output()
        assert "commlayer has been shut down" in record["message"], record["message"]
        assert _names_a_stall(record["message"], rank, job.size, mode), record["message"]
    # at their submission: no 'submitted' record (the engine had stopped)
    assert not job.find("submitted"), job.output()


def test_job_exits_cleanly(job: Job) -> None:
    """Every rank caught its StallError and shut down: nothing waits on anything."""
    assert job.returncode == 0, job.output()
    assert len(job.find("done")) == job.size, job.output()
