"""integrations/: the Slurm job scripts run against a faked allocation, the Kubeflow manifests
parse and agree with themselves and with the repository (what cannot be tested here, a real
Slurm cluster or Kubernetes, is said in integrations/README.md)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")

REPO = Path(__file__).resolve().parents[2]
INTEGRATIONS = REPO / "integrations"


def _manifest(name: str) -> dict[str, Any]:
    documents = list(yaml.safe_load_all((INTEGRATIONS / "kubernetes" / name).read_text()))
    assert len(documents) == 1
    found: dict[str, Any] = documents[0]
    return found


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = spec["template"]["spec"]["containers"]
    return containers


def _script_in_repo(path: str) -> None:
    """A /workspace/... path in a manifest names a file of this repository."""
    assert path.startswith("/workspace/"), path
    assert (REPO / path.removeprefix("/workspace/")).is_file(), path


def test_mpijob_launches_commlayerrun_on_every_slot() -> None:
    job = _manifest("mpijob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    spec = job["spec"]
    assert spec["mpiImplementation"] == "MPICH"  # the mpich wheel's launcher
    replicas = spec["mpiReplicaSpecs"]
    assert replicas["Launcher"]["replicas"] == 1
    [launcher] = _containers(replicas["Launcher"])
    command = launcher["command"]
    assert command[0] == "commlayerrun"
    ranks = int(command[command.index("-np") + 1])
    assert ranks == replicas["Worker"]["replicas"] * spec["slotsPerWorker"]
    assert command[command.index("--hostfile") + 1] == "/etc/mpi/hostfile"
    assert command[-2] == "python"
    _script_in_repo(command[-1])
    env = {e["name"]: e["value"] for e in launcher.get("env", [])}
    assert all(name.startswith("COMMLAYER_") for name in env)


def test_pytorchjob_runs_torchrun_in_every_pod() -> None:
    job = _manifest("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert int(job["spec"]["nprocPerNode"]) >= 1
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for role in replicas.values():
        [container] = _containers(role)
        assert container["name"] == "pytorch"  # the training operator's container name
        assert container["command"][0] == "torchrun"
        _script_in_repo(container["command"][-1])


def _sbatch_options(name: str) -> dict[str, str]:
    options = {}
    for line in (INTEGRATIONS / "slurm" / name).read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key] = value
    return options


@pytest.mark.parametrize("name", ["commlayer.sbatch", "torchrun.sbatch"])
def test_sbatch_scripts_are_valid_bash_with_an_allocation(name: str) -> None:
    path = INTEGRATIONS / "slurm" / name
    subprocess.run(["bash", "-n", str(path)], check=True)
    options = _sbatch_options(name)
    assert {"--nodes", "--ntasks-per-node", "--cpus-per-task"} <= set(options), options


def test_commlayer_sbatch_starts_commlayerrun_in_a_faked_allocation(tmp_path: Path) -> None:
    """The job script as Slurm would run it on the first node: the allocation's variables set,
    the virtual environment's commlayerrun replaced by one that records how it was called."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    record = tmp_path / "called"
    fake = venv / "bin" / "commlayerrun"
    fake.write_text(
        f'#!/bin/bash\n{{ printf "%s\\n" "$@"; echo "LOG=$COMMLAYER_LOG_LEVEL"; }} > {record}\n'
    )
    fake.chmod(0o755)
    options = _sbatch_options("commlayer.sbatch")
    nodes, per_node = int(options["--nodes"]), int(options["--ntasks-per-node"])
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "VENV": str(venv),
        "SLURM_JOB_ID": "42",
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_CPUS_PER_TASK": options["--cpus-per-task"],
        "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
    }
    subprocess.run(
        ["bash", str(INTEGRATIONS / "slurm" / "commlayer.sbatch"), "--epochs", "1"],
        env=env, cwd=REPO, check=True, timeout=30,
    )  # fmt: skip
    called = record.read_text().splitlines()
    assert called == [
        "--prefix-output", "python", "examples/mnist_like.py", "--epochs", "1", "LOG=info"
    ], called  # fmt: skip
    assert (REPO / "examples" / "mnist_like.py").is_file()


def test_torchrun_sbatch_names_one_agent_per_node() -> None:
    text = (INTEGRATIONS / "slurm" / "torchrun.sbatch").read_text()
    assert _sbatch_options("torchrun.sbatch")["--ntasks-per-node"] == "1"
    command = shlex.split(text[text.index("exec srun torchrun") :].replace("\\\n", " "))
    assert command[:3] == ["exec", "srun", "torchrun"]
    assert command[command.index("--nnodes") + 1] == "$SLURM_NNODES"
    assert command[command.index("--rdzv-backend") + 1] == "c10d"
