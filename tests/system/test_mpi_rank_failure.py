"""A rank that raises or dies while the others need it: the job ends quickly. An uncaught
exception aborts the whole job (MPI_Abort at exit, as ``python -m mpi4py``: whatever the others
are doing); a rank that vanishes is noticed by the others within seconds (RankDiedError).

mpiexec (hydra) ends the whole job as soon as one rank exits without MPI_Finalize, so under a
plain ``mpiexec`` a hard death is cut short by the launcher; only the no-hang bound can be
checked there. ``-disable-auto-cleanup`` keeps the survivors alive, which exercises commlayer's
own detection (peer pids checked every second while waiting).

What happened is read from the ranks' records (scripts/rank_failure.py), never from the
launcher's copy of their output, and the script orders the steps by waiting on records and on
the engine, never by sleeping. "At once" is an event, not a duration: the collective raised in
its submission (no ``submitted`` record), because the engine had already stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Job, RunMPI

# Upper bounds that tell commlayer's own detection (a goodbye in the next cycle, or the pid
# check every second) from a hang: without it nothing fails a collective before the 60 s
# collective watchdog, and the harness kills a job after 45 s. From rank 1's failure to a
# survivor's error, and to the end of the whole job: at most 1.0 s and 1.4 s in 4 runs of this
# file on the 2-core machine at load average 7; generous, so a machine that stalls the ranks
# for seconds does not fail a correct run.
NOTICED_WITHIN_S = 10.0
ENDS_WITHIN_S = 15.0
KEEP_SURVIVORS = ("-disable-auto-cleanup",)


def _failing_time(job: Job) -> float:
    return float(job.one("failing", 1)["time"])


def _survivors(job: Job) -> list[int]:
    return [r for r in range(job.size) if r != 1]


def _assert_ends_quickly(job: Job) -> None:
    took = job.ended_at - _failing_time(job)
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end\n{job.output()}"


def _assert_names_rank_1(record: dict[str, Any], job: Job, phrase: str) -> None:
    assert record["error"] in ("ShutdownError", "RankDiedError"), job.output()
    assert {"ShutdownError", "CommlayerError", "RuntimeError"} <= set(record["classes"])
    assert f"rank(s) [1] {phrase}" in record["message"], record["message"]


def _failed_at_once(job: Job, rank: int, event: str) -> bool:
    """The collective ``event`` raised in its submission: its engine had stopped already."""
    return not [r for r in job.find("submitted", rank) if r["name"] == event]


def _assert_rank_2_noticed_while_idle(job: Job, phrase: str) -> None:
    """Rank 2's engine noticed rank 1's failure between collectives, and then both of rank 2's
    collectives failed at once, naming rank 1."""
    took = job.one("noticed", 2)["time"] - _failing_time(job)
    assert took < NOTICED_WITHIN_S, f"rank 2 noticed after {took:.1f} s"
    for event in ("blocked", "later"):
        _assert_names_rank_1(job.one(event, 2), job, phrase)
        assert _failed_at_once(job, 2, event), f"rank 2's {event!r} waited\n{job.output()}"


def test_uncaught_exception_aborts_the_job(run_mpi: RunMPI) -> None:
    """Any uncaught exception, not only a commlayer error (test_faults_end_jobs.py: a
    CommlayerError while peers sleep or wait in a collective)."""
    job = run_mpi("rank_failure.py", 2, "raise", "blocked")
    assert job.returncode != 0, job.output()
    uncaught = job.one("uncaught", 1)  # reported by rank 1's excepthook, before atexit
    assert (uncaught["error"], uncaught["message"]) == ("RuntimeError", "rank 1 fails on purpose")
    assert not [r for r in job.find("uncaught") if r["rank"] != 1], job.output()
    _assert_ends_quickly(job)
    notice = "commlayer: rank 1 raised an uncaught RuntimeError: rank 1 fails on purpose"
    assert notice in job.stderr and "aborting the job" in job.stderr, job.output()
    # rank 0 waited in its allreduce: ended by the abort, not by a goodbye it could catch
    assert not job.find("done"), job.output()


@pytest.mark.parametrize("how", ["exit1", "exit0", "sigkill"])
def test_hard_death_under_mpiexec_ends_the_job(run_mpi: RunMPI, how: str) -> None:
    job = run_mpi("rank_failure.py", 2, how, "blocked")
    _assert_ends_quickly(job)
    if how != "exit0":
        # os._exit(0) is no failure to mpiexec: it ends the job and reports 0, although it
        # killed rank 0 in the middle of an allreduce. That is the launcher's call.
        assert job.returncode != 0, job.output()
    for record in job.find("blocked", 0):  # only if rank 0 outlived mpiexec's cleanup
        _assert_names_rank_1(record, job, "exited")


def test_hard_death_is_detected_by_the_survivors(run_mpi: RunMPI) -> None:
    # os._exit(0): no atexit hook, so no goodbye; _exit(1) takes the same path in commlayer.
    job = run_mpi("rank_failure.py", 3, "exit0", "blocked", mpiexec_args=KEEP_SURVIVORS)
    _assert_ends_quickly(job)
    # The survivors report their errors and exit 0, as did rank 1.
    assert job.returncode == 0, job.output()
    blocked = job.one("blocked", 0)
    assert blocked["error"] == "RankDiedError", job.output()
    _assert_names_rank_1(blocked, job, "exited")
    took = blocked["time"] - _failing_time(job)
    assert took < NOTICED_WITHIN_S, f"rank 0 noticed the death after {took:.1f} s"
    assert not _failed_at_once(job, 0, "blocked"), "rank 0 was not waiting when rank 1 died"
    # Rank 2 was idle when rank 1 died; its engine noticed between collectives.
    _assert_rank_2_noticed_while_idle(job, "exited")
    assert len(job.find("done")) == 2, job.output()


def test_sigkilled_rank_ends_the_job_even_without_auto_cleanup(run_mpi: RunMPI) -> None:
    """mpiexec kills the whole job when a rank dies of a signal, -disable-auto-cleanup or not,
    so whether the survivors get to report first is a race; what they report must be right."""
    job = run_mpi("rank_failure.py", 3, "sigkill", "blocked", mpiexec_args=KEEP_SURVIVORS)
    _assert_ends_quickly(job)
    assert job.returncode != 0, job.output()
    for rank in _survivors(job):
        for record in job.find("blocked", rank) + job.find("later", rank):
            _assert_names_rank_1(record, job, "exited")
