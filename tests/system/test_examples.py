"""Every script in examples/ runs as a user runs it, at 2 ranks under mpiexec, and does what
its docstring says: the ranks end with the same weights, rank 0 alone writes the checkpoint and
a second run resumes from it, metrics are averaged over the ranks after a learning-rate warm-up,
compression sends fewer bytes, the DDP hook trains, the Lightning Trainer trains on its shard.
The minimal example and the DDP hook also run under torchrun, as their docstrings show. Each
example is kept to a few steps: the jobs are mostly two ranks importing torch (6-10 s each on the
loaded 2-core machine; torchrun's agent adds a few; Lightning's import 5-10)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from conftest import Job, RunMPI

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RANKS = 2
# Two ranks importing torch and sklearn-free examples took 6-10 s at load average 5.
TIMEOUT_S = 60.0


def _run(run_mpi: RunMPI, name: str, *args: str, torchrun: bool = False) -> Job:
    timeout_s = 1.5 * TIMEOUT_S if torchrun else TIMEOUT_S  # torchrun's agent: one more python
    job = run_mpi(str(EXAMPLES / name), RANKS, *args, timeout_s=timeout_s, torchrun=torchrun)
    assert job.returncode == 0, job.output()
    return job


# Not anchored to lines: mpiexec forwards each rank's output as it comes, and one rank's line
# can land in the middle of another's ("...5840rank 0 of 2: ...5840" then both newlines).
CHECKSUM = r"parameter checksum (-?\d+\.\d{10})"


def _checksums(job: Job, pattern: str) -> dict[int, str]:
    """rank -> the checksum it printed after ``pattern`` (group: rank)."""
    found = {int(m.group(1)): m.group(2) for m in re.finditer(pattern + CHECKSUM, job.stdout)}
    assert sorted(found) == list(range(RANKS)), job.output()
    return found


def test_every_example_has_a_test() -> None:
    tested = {"minimal.py", "mnist_like.py", "checkpoint.py", "compression.py", "ddp_hook.py",
              "lightning_trainer.py"}  # fmt: skip
    elsewhere = {"train_digits.py": "test_launcher_demo.py", "model_parallel_cnn.py": "oracle"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested | set(elsewhere)


@pytest.mark.parametrize("torchrun", [False, True], ids=["mpiexec", "torchrun"])
def test_minimal_ends_with_the_same_weights_on_every_rank(run_mpi: RunMPI, torchrun: bool) -> None:
    job = _run(run_mpi, "minimal.py", torchrun=torchrun)
    sums = _checksums(job, rf"rank (\d) of {RANKS}: ")
    assert len(set(sums.values())) == 1, job.output()


def test_mnist_like_warms_up_the_scaled_rate_and_averages_metrics(run_mpi: RunMPI) -> None:
    # 1024 samples: 16 steps a rank and epoch, so the rate is warm by the end of epoch 0
    job = _run(run_mpi, "mnist_like.py", "--epochs", "2", "--train-size", "1024",
               "--warmup-steps", "10")  # fmt: skip
    assert f"{RANKS} ranks, learning rate 0.02 x {RANKS} = 0.04 after 10 warm-up steps" in (
        job.stdout
    ), job.output()
    epochs = re.findall(
        rf"^epoch (\d): lr (\d\.\d+), train loss \d+\.\d+, test loss \d+\.\d+, test accuracy "
        rf"(\d+\.\d+)% \(averaged over {RANKS} ranks\)$",
        job.stdout,
        re.M,
    )
    assert [e[0] for e in epochs] == ["0", "1"], job.output()  # printed once: by rank 0
    assert all(float(e[1]) == pytest.approx(0.04) for e in epochs), job.output()  # warmed up
    assert float(epochs[-1][2]) > 30.0, job.output()  # 10 classes: chance is 10%


def test_checkpoint_is_written_by_rank_0_and_resumed_by_every_rank(
    run_mpi: RunMPI, tmp_path: Path
) -> None:
    first = _run(run_mpi, "checkpoint.py", "--dir", str(tmp_path), "--epochs", "2")
    for rank in range(RANKS):
        assert f"rank {rank}: starting at epoch 0" in first.stdout, first.output()
    saved = re.findall(r"rank (\d): saved epoch (\d)", first.stdout)
    assert saved == [("0", "1"), ("0", "2")], first.output()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    state = torch.load(tmp_path / "checkpoint.pt")
    assert state["epoch"] == 2 and set(state) == {"model", "optimizer", "epoch"}
    sums = _checksums(first, r"rank (\d): ")
    assert len(set(sums.values())) == 1, first.output()

    again = _run(run_mpi, "checkpoint.py", "--dir", str(tmp_path), "--epochs", "3")
    for rank in range(RANKS):
        assert f"rank {rank}: starting at epoch 2" in again.stdout, again.output()
    assert re.findall(r"rank (\d): saved epoch (\d)", again.stdout) == [("0", "3")]
    assert torch.load(tmp_path / "checkpoint.pt")["epoch"] == 3


def test_compression_sends_fewer_bytes_and_keeps_the_ranks_alike(run_mpi: RunMPI) -> None:
    job = _run(run_mpi, "compression.py", "--compression", "fp16", "--steps", "5")
    for compression in ("none", "fp16"):
        pattern = rf"rank (\d): {compression}: "
        assert len(set(_checksums(job, pattern).values())) == 1, job.output()
    # not anchored: another rank's line can end only after this one (see CHECKSUM)
    found = re.search(r"fp16: ([\d,]+) bytes reduced a step against ([\d,]+) uncompressed",
                      job.stdout)  # fmt: skip
    assert found, job.output()
    compressed, dense = (int(g.replace(",", "")) for g in found.groups())
    assert 0 < compressed <= 0.55 * dense, job.output()  # fp16: half the bytes


@pytest.mark.parametrize("torchrun", [False, True], ids=["mpiexec", "torchrun"])
def test_ddp_hook_trains_ddp_with_a_compressor(run_mpi: RunMPI, torchrun: bool) -> None:
    job = _run(run_mpi, "ddp_hook.py", "--compression", "fp16", "--steps", "5", torchrun=torchrun)
    sums = _checksums(job, rf"rank (\d) of {RANKS}: fp16 hook, ")
    assert len(set(sums.values())) == 1, job.output()


def test_lightning_trainer_trains_each_rank_on_its_shard(run_mpi: RunMPI) -> None:
    pytest.importorskip("lightning.pytorch")
    job = _run(run_mpi, "lightning_trainer.py", "--epochs", "2")
    # 512 samples, batches of 32: 8 a rank and epoch from its half (DistributedSampler), 16 alone
    sums = _checksums(job, rf"rank (\d) of {RANKS}: 8 batches an epoch, ")
    # different first weights on each rank: the same end only if rank 0's were broadcast and
    # every step's gradients averaged
    assert len(set(sums.values())) == 1, job.output()
