"""Mismatched shape, dtype, op, root or kind across ranks: an error on every rank naming the
tensor and each rank's value, never a hang; the job keeps working afterwards and exits 0. Under
mpiexec at 2 and 3 ranks, and under torchrun (the engine over gloo) at 3."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Job, RunMPI

# case -> (tensor name, what differs, what the message shows for rank r); the values follow the
# rank-dependent choices in scripts/mismatch.py.
CASES = {
    "shape": ("t.shape", "shape", lambda r: f"rank {r}: [{r + 1}]"),  # plainly, not ((1,),)
    "dtype": ("t.dtype", "dtype", lambda r: f"rank {r}: {'float32' if r == 0 else 'float64'!r}"),
    # The op's value: test_op_mismatch_names_the_ops checks it is readable.
    "op": ("t.op", "reduce op", lambda r: f"rank {r}: "),
    "root": ("t.root", "root rank", lambda r: f"rank {r}: {0 if r == 0 else 1}"),
    "kind": (
        "t.kind", "operation", lambda r: f"rank {r}: {'allreduce' if r == 0 else 'allgather'!r}"
    ),
    "allgather_trailing": (
        "t.gather", "shape after the first dimension", lambda r: f"rank {r}: [{r + 1}]"
    ),
    "batch": ("t.batch", "shape", lambda r: f"rank {r}: [{3 + r}]"),
    "cached": ("t.cached", "shape", lambda r: f"rank {r}: [{4 if r == 0 else 5}]"),
}  # fmt: skip


@pytest.fixture(
    scope="module",
    params=[(2, False), (3, False), (3, True)],
    ids=lambda p: f"np{p[0]}" + "-torchrun" * p[1],
)
def job(request: pytest.FixtureRequest, run_mpi: RunMPI) -> Job:
    n, torchrun = request.param
    return run_mpi("mismatch.py", n, torchrun=torchrun)


def _case(job: Job, event: str, case: str, rank: int) -> dict[str, Any]:
    found = [r for r in job.find(event, rank) if r.get("case") == case]
    assert len(found) == 1, f"rank {rank}: no {event!r} record for {case!r}\n{job.output()}"
    return found[0]


def test_job_exits_cleanly(job: Job) -> None:
    assert job.returncode == 0, job.output()
    assert len(job.find("done")) == job.size, job.output()


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_gets_a_named_mismatch_error(job: Job, case: str) -> None:
    name, field, shown_for = CASES[case]
    for rank in range(job.size):
        record = _case(job, "mismatch", case, rank)
        assert record["error"] == "TensorMismatchError", job.output()
        assert {"RuntimeError", "CommlayerError"} <= set(record["classes"])
        message = record["message"]
        assert message.startswith(f"rank {rank}: "), message
        assert repr(name) in message and f"{field} differs" in message, message
        for shown in map(shown_for, range(job.size)):
            assert shown in message, f"{shown!r} missing from {message!r}"
        assert record["elapsed_s"] < 5.0, f"the mismatch took {record['elapsed_s']:.1f} s"


@pytest.mark.parametrize("case", list(CASES))
def test_allreduce_works_after_the_mismatch(job: Job, case: str) -> None:
    for rank in range(job.size):
        assert _case(job, "after", case, rank)["result"] == [float(job.size)] * 2, job.output()


def test_good_tensors_fused_with_a_bad_one_complete(job: Job) -> None:
    expected = [[float(job.size * (i + 1))] * 3 for i in range(4)]
    for rank in range(job.size):
        assert job.one("batch_good", rank)["result"] == expected, job.output()


def test_failed_name_can_be_used_again(job: Job) -> None:
    for rank in range(job.size):
        record = job.one("reuse", rank)
        assert record["error"] is None, job.output()
        assert record["result"] == [float(job.size)] * 3


def test_op_mismatch_names_the_ops(job: Job) -> None:
    message = _case(job, "mismatch", "op", 0)["message"]
    assert "Sum" in message and "Max" in message, message
