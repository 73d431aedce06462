"""integrations/ray/train.py runs as its docstring shows: a Ray Train TorchTrainer on a local
Ray cluster runs commlayer's training function on 2 workers. Ray initialized torch.distributed
before the function ran and ``commlayer.init()`` then ran the engine over it (backend torch), the
variables Ray gave the workers are torchrun's, commlayer reduced the gradients (its operation
count), the workers end with the same weights, exactly plain DDP's on Ray's process group, the
loss falls, and rank 0's checkpoint holds those weights.

Ray is not in the test extra (about 500 MB with ray[train]'s dependencies, a local cluster that
takes 30 s to several minutes to start on the loaded 2-core machine): without it this test is
skipped. ``pip install "ray[train]"`` into the test environment runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip(
    "ray.train.torch", reason='Ray Train is not installed: pip install "ray[train]"'
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "integrations" / "ray" / "train.py"
WORKERS = 2
STEPS = 10
# A local Ray cluster, its controller and 2 workers: 2-3 min at load 14 on 2 cores (Ray's own
# limit for its node to start is 30 s; it failed once there at that load).
TIMEOUT_S = 400.0
# pytest's own limit (120 s, pyproject.toml) would cut the job short: the harness's is the one
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def job(harness: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The script's result record, its lines about the checkpoint and ranks under "lines"."""
    out_dir = tmp_path_factory.mktemp("ray")
    env = harness.worker_env(out_dir, TIMEOUT_S + 10, {})
    env.pop("RAY_ADDRESS", None)  # a local cluster of the script's own, not a developer's
    command = [
        sys.executable, str(SCRIPT), "--workers", str(WORKERS), "--steps", str(STEPS),
        "--compare-ddp", "--storage", str(out_dir / "storage"),
    ]  # fmt: skip
    code, stdout, stderr = harness.run_limited(command, env, TIMEOUT_S, cwd=REPO)
    done = subprocess.CompletedProcess(command, code, stdout, stderr)
    assert code == 0, _explain(done)
    # not anchored at the start: a line of Ray's log thread may stop short of its newline
    found = re.findall(r"result: (\{.*\})$", stdout, re.M)
    assert len(found) == 1, _explain(done)
    result: dict[str, Any] = json.loads(found[0])
    result["lines"] = stdout
    return result


def _explain(job: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(job.args)}\nexit code {job.returncode}\n--- stdout ---\n{job.stdout}"
        f"\n--- stderr ---\n{job.stderr}"
    )


def test_commlayer_ran_over_the_process_group_ray_started(job: dict[str, Any]) -> None:
    assert job["size"] == WORKERS and len(job["ranks"]) == WORKERS, job
    assert job["commlayer"].startswith(f"commlayer started: {WORKERS} ranks on 1 node"), job
    assert ", backend torch," in job["commlayer"], job
    for rank, record in enumerate(job["ranks"]):
        assert record["torch_distributed_before_init"] is True, job  # Ray's, not commlayer's
        env = record["env"]  # torchrun's names
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (
            str(rank), str(rank), str(WORKERS)
        ), job  # fmt: skip
        assert record["operations"] > 0, job  # commlayer reduced the gradients


def test_the_workers_train_alike_and_as_plain_ddp(job: dict[str, Any]) -> None:
    assert job["steps"] == STEPS, job
    sums = {record["checksum"] for record in job["ranks"]}
    assert len(sums) == 1, job
    for record in job["ranks"]:
        assert 0.0 <= record["ddp_gap"] < 1e-6, job  # the same average, in float32
    assert job["loss_after"] < 0.7 * job["loss_before"], job
    saved = re.search(r"checkpoint: parameter checksum (-?\d+\.\d{10})", job["lines"])
    assert saved and float(saved.group(1)) == pytest.approx(sums.pop(), abs=1e-9), job
