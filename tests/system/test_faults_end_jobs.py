"""Faults end the whole job (issue 38), under mpiexec and under torchrun, whatever the other
ranks are doing: a stall fails with StallError on every rank (the default limit, 10 minutes,
shortened here through its variable) and stops commlayer; an uncaught error on one rank ends
the job (MPI_Abort under mpiexec; under torchrun the rank exits at once and torchrun's agent
stops the others) while a peer is blocked in user code, sleeping or holding Python's GIL.

scripts/job_end.py blocks its ranks for an hour: a job that commlayer does not end is killed by
the harness and fails as a hang. The upper bounds below only tell an ended job from that: from
the fault to mpiexec's or torchrun's exit took at most ~1.5 s here (2-core machine, loaded).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Job, RunMPI

ENDS_WITHIN_S = 15.0
STALL_ENV = {"COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS": "2"}


def _assert_ended_soon_after(job: Job, fault_time: float) -> None:
    took = job.ended_at - fault_time
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end\n{job.output()}"


@pytest.mark.parametrize(("torchrun", "size"), [(False, 3), (True, 2)], ids=["mpiexec", "torchrun"])
def test_a_stall_fails_every_rank_and_ends_the_job(
    run_mpi: RunMPI, torchrun: bool, size: int
) -> None:
    job = run_mpi("job_end.py", size, "stall", env=STALL_ENV, torchrun=torchrun)
    assert job.returncode != 0, job.output()
    holders = [r for r in range(size) if r != 1]
    described = f"allreduce 'step.grad' stalled: submitted by ranks {holders}, never by ranks [1]"
    for rank in holders:
        stalled = job.one("stalled", rank)
        assert stalled["error"] == "StallError", job.output()
        assert stalled["message"].startswith(f"rank {rank}: {described}"), stalled["message"]
        assert "COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS" in stalled["message"]
    # rank 1, in user code when the stall ended, gets the same error at its next collective,
    # at once (its engine had stopped: no 'submitted' record)
    later = job.one("later", 1)
    assert later["error"] == "StallError", job.output()
    assert f"rank 1: {described}" in later["message"], later["message"]
    assert not job.find("submitted", 1), job.output()
    # every rank's log says so as soon as its engine stops, whatever its user code does
    for rank in range(size):
        assert f"commlayer rank {rank}: engine stopped: rank {rank}: {described}" in job.stderr
    uncaught = [r for r in job.find("uncaught") if r["error"] == "StallError"]
    assert uncaught, job.output()
    _assert_ended_soon_after(job, min(r["time"] for r in job.find("stalled")))
    assert not job.find("done"), job.output()


# Under torchrun a peer that sleeps is stopped by the agent; one that holds the GIL cannot
# take the failing rank's goodbye, which must not hold the failing rank (it did for 30 s).
# A peer blocked in a collective under torchrun: test_torchrun.py.
@pytest.mark.parametrize(
    ("torchrun", "size", "peer"),
    [(False, 3, "sleep"), (True, 2, "gil")],
    ids=["mpiexec-sleep", "torchrun-gil"],
)
def test_an_uncaught_error_on_one_rank_ends_the_whole_job(
    run_mpi: RunMPI, torchrun: bool, size: int, peer: str
) -> None:
    job = run_mpi("job_end.py", size, "raise", peer, torchrun=torchrun)
    assert job.returncode != 0, job.output()
    uncaught = job.one("uncaught", 1)
    assert (uncaught["error"], uncaught["message"]) == ("CommlayerError", "rank 1 fails on purpose")
    _assert_ended_soon_after(job, job.one("failing", 1)["time"])
    # commlayer's own line names the rank and the error, on top of Python's traceback
    notice = "commlayer: rank 1 raised an uncaught CommlayerError: rank 1 fails on purpose"
    assert notice in job.stderr, job.output()
    if not torchrun:
        assert "aborting the job" in job.stderr, job.output()
    # rank 2 waited in a collective that needed rank 1: if it reported before the job ended,
    # its error names rank 1 (a goodbye, or the pid check)
    for record in job.find("blocked", 2):
        assert record["error"] in ("ShutdownError", "RankDiedError"), job.output()
        named = re.search(r"rank\(s\) \[([0-9, ]+)\]", record["message"])
        assert named is not None and "1" in named.group(1).split(", "), record["message"]
    assert not job.find("done"), job.output()
