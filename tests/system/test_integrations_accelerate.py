"""integrations/accelerate/train.py runs as its docstring shows, under ``accelerate launch`` at
2 ranks, and trains through commlayer's DDP hook: each rank's hook ran every step, commlayer's
engine reduced the buckets (``--algorithm ring``: commlayer started on the process group
Accelerate made), the ranks end with the same weights, the loss falls, and the result is plain
DDP's (the same model prepared by Accelerate without the hook, trained on the same batches in
the same job) up to fp16's rounding of the gradients. One job: a python for ``accelerate
launch`` and torchrun's agent, two ranks importing torch and accelerate (10-20 s on the loaded
2-core machine). Skipped where accelerate is not installed (it is in the test extra)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("accelerate", reason="Hugging Face Accelerate is not installed")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "integrations" / "accelerate" / "train.py"
RANKS = 2
STEPS = 10
TIMEOUT_S = 90.0  # a launcher, its agent and 2 ranks: 25-45 s at load 12-14 (pytest: 120 s)


@pytest.fixture(scope="module")
def job(
    harness: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> subprocess.CompletedProcess[str]:
    out_dir = tmp_path_factory.mktemp("accelerate")
    # HF_HOME: no `accelerate config` file of the developer's changes how the job launches
    env = harness.worker_env(out_dir, TIMEOUT_S + 10, {"HF_HOME": str(out_dir / "hf")})
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", str(RANKS), "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", str(SCRIPT),
        "--algorithm", "ring", "--compression", "fp16", "--steps", str(STEPS), "--compare-ddp",
    ]  # fmt: skip
    code, stdout, stderr = harness.run_limited(command, env, TIMEOUT_S, cwd=REPO)
    done = subprocess.CompletedProcess(command, code, stdout, stderr)
    assert code == 0, _explain(done)
    return done


def _explain(job: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(job.args)}\nexit code {job.returncode}\n--- stdout ---\n{job.stdout}"
        f"\n--- stderr ---\n{job.stderr}"
    )


def _per_rank(job: subprocess.CompletedProcess[str], pattern: str) -> dict[int, re.Match[str]]:
    """rank -> the match of ``rank R of 2: <pattern>`` that rank printed (one each). Not
    anchored to lines: two ranks write into one pipe, so a line of one may land inside the
    other's (each script line is one write, but a rank's other output is not)."""
    found: dict[int, re.Match[str]] = {}
    for m in re.finditer(rf"rank (\d) of {RANKS}: {pattern}", job.stdout):
        assert int(m.group(1)) not in found, _explain(job)
        found[int(m.group(1))] = m
    assert sorted(found) == list(range(RANKS)), _explain(job)
    return found


def test_every_step_went_through_commlayers_hook_and_engine(
    job: subprocess.CompletedProcess[str],
) -> None:
    pattern = r"fp16 hook \(ring\), (\d+) steps through the hook, commlayer operations (\d+), "
    for m in _per_rank(job, pattern).values():
        assert int(m.group(2)) == STEPS, _explain(job)  # DDP called the hook every step
        assert int(m.group(3)) >= STEPS, _explain(job)  # one bucket or more a step


def test_the_ranks_end_alike_and_the_loss_falls(job: subprocess.CompletedProcess[str]) -> None:
    sums = _per_rank(job, r"fp16 hook .*?, parameter checksum (-?\d+\.\d{10})")
    assert len({m.group(2) for m in sums.values()}) == 1, _explain(job)
    pattern = rf"{RANKS} ranks, {STEPS} steps each: loss on all the data (\d+\.\d{{4}}) -> "
    loss = re.search(pattern + r"(\d+\.\d{4})", job.stdout)
    assert loss, _explain(job)
    assert float(loss.group(2)) < 0.7 * float(loss.group(1)), _explain(job)


def test_the_result_is_plain_ddps_up_to_fp16_rounding(
    job: subprocess.CompletedProcess[str],
) -> None:
    gaps = _per_rank(job, r"largest difference from plain DDP (\d\.\d{3}e[-+]\d\d)")
    for m in gaps.values():
        assert 0.0 <= float(m.group(2)) < 1e-3, _explain(job)
