"""commlayer under torchrun (issue 25): one job over torch.distributed, never N jobs of one.

``torchrun --standalone --nproc_per_node N script.py`` with ``commlayer.init()`` forms one
job of N ranks over gloo (COMMLAYER_BACKEND=auto), also again after a restart
(``--max-restarts``); the MPI backend asked for under torchrun,
or the torch backend under mpiexec, fails at init() naming why; a rank that raises, dies or
submits a mismatched tensor gives the others an error within seconds, as under mpiexec.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import RunMPI

ENDS_WITHIN_S = 15.0  # from rank 1's failure to torchrun's exit (its agent stops the others)


@pytest.mark.parametrize("n", [2, 3])
def test_torchrun_job_is_one_job_and_trains_in_step(run_mpi: RunMPI, n: int) -> None:
    job = run_mpi("torchrun_worker.py", n, "train", torchrun=True)
    assert job.returncode == 0, job.output()
    for rank in range(n):
        ready = job.one("ready", rank)
        assert (ready["size"], ready["torchrun_world_size"]) == (n, n), job.output()
        assert ready["local_rank"] == rank and ready["gloo_enabled"], ready
        assert not ready["mpi_enabled"], ready
        train = job.one("train", rank)
        assert train["exact_sum"], train
        assert train["rows"] == [float(r) for r in range(n) for _ in range(r + 1)], train
        assert train["root"] == [float(n - 1)] * 4, train
        assert train["params_equal"], train
        assert train["losses"][-1] < train["losses"][0], train
        assert job.one("restarted", rank)["sums"] == [n * (n + 1) / 2] * 2, job.output()
        assert job.find("done", rank), job.output()


def test_torchrun_restarts_the_job_after_a_rank_exits(run_mpi: RunMPI) -> None:
    """torchrun --max-restarts: the agent starts every rank again once one exits, in the same
    rendezvous store; init() must not meet the first attempt's gloo addresses there."""
    job = run_mpi(
        "torchrun_worker.py", 3, "restart", torchrun=True,
        mpiexec_args=("--max-restarts", "1"),
    )  # fmt: skip
    assert job.returncode == 0, job.output()
    for rank in range(3):
        attempts = [(r["attempt"], r["sum"]) for r in job.find("attempt", rank)]
        assert attempts[-1] == (1, 6.0), job.output()
        assert job.find("done", rank), job.output()


def test_mpi_backend_under_torchrun_is_refused_by_name(run_mpi: RunMPI) -> None:
    job = run_mpi(
        "torchrun_worker.py", 2, "init", torchrun=True,
        env={"COMMLAYER_BACKEND": "mpi"},
    )  # fmt: skip
    for rank in range(2):
        record = job.one("init", rank)
        assert record["error"] == "ConfigError", job.output()
        assert "COMMLAYER_BACKEND=mpi" in record["message"], record["message"]
        assert "WORLD_SIZE=2" in record["message"], record["message"]
        assert record["elapsed_s"] < 5.0, record


def test_torch_backend_under_mpiexec_is_refused_by_name(run_mpi: RunMPI) -> None:
    job = run_mpi("torchrun_worker.py", 2, "init", env={"COMMLAYER_BACKEND": "torch"})
    for rank in range(2):
        record = job.one("init", rank)
        assert record["error"] == "CommlayerError", job.output()
        assert "started by mpiexec" in record["message"], record["message"]


def test_mismatched_shapes_fail_on_every_rank(run_mpi: RunMPI) -> None:
    job = run_mpi("torchrun_worker.py", 3, "mismatch", torchrun=True)
    assert job.returncode == 0, job.output()
    for rank in range(3):
        record = job.one("mismatch", rank)
        assert record["error"] == "TensorMismatchError", job.output()
        assert "mismatched" in record["message"] and "rank" in record["message"], record
        assert record["elapsed_s"] < 5.0, record


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_failing_rank_fails_the_others_and_ends_the_job(run_mpi: RunMPI, how: str) -> None:
    job = run_mpi("rank_failure.py", 3, how, "blocked", torchrun=True)
    assert job.returncode != 0, job.output()
    failing = job.one("failing", 1)["time"]
    took = job.ended_at - failing
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end\n{job.output()}"
    for record in job.find("blocked", 0):  # if rank 0 reported before the agent stopped it
        assert record["error"] in ("ShutdownError", "RankDiedError"), job.output()
        # rank 1 is named; rank 2 too when the agent had already stopped it (its connection
        # closed as well by then: on a loaded machine rank 0 can notice both at once)
        named = re.search(r"rank\(s\) \[([0-9, ]+)\]", record["message"])
        assert named is not None, record["message"]
        assert named.group(1) in ("1", "1, 2"), record["message"]
