"""The direct path on CUDA tensors (issue 25; device.py, **Direct**): collectives and the
optimizer with the backend taking device tensors as they are, over NCCL (the torch backend,
under torchrun) and over a CUDA-aware MPI (skipped, with the reason, where the MPI is not).
Each case runs tests/gpu/direct_worker.py in a job of its own. NCCL needs a GPU per rank: 1
rank on one GPU, 2 ranks (and the ring schedule's reductions on the device) where there are 2.
The same logic runs on the CPU in tests/parallel/test_device.py (``DIRECT_CPU``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

WORKER = Path(__file__).with_name("direct_worker.py")
ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count()


def _run(launch: list[str], env: dict[str, str], ranks: int) -> None:
    environ = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               "COMMLAYER_FORCE_FULL_PATH": "1", **env}  # fmt: skip
    done = subprocess.run([*launch, sys.executable, str(WORKER)] if launch[0] == "mpiexec"
                          else [*launch, str(WORKER)], env=environ, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count("DIRECT OK") == ranks, out[-4000:]


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}"]  # fmt: skip


@pytest.mark.parametrize(
    ("ranks", "algorithm"), [(1, "auto"), (2, "auto"), (2, "ring"), (2, "recursive_doubling")]
)
def test_nccl(ranks: int, algorithm: str) -> None:
    if ranks > GPUS:
        pytest.skip(f"NCCL needs a GPU per rank: {ranks} ranks, {GPUS} GPU(s)")
    env = {"COMMLAYER_NCCL": "1", "COMMLAYER_ALLREDUCE_ALGORITHM": algorithm}
    _run(_torchrun(ranks), env, ranks)


def _mpi_cuda_aware() -> tuple[bool, str]:
    probe = "from commlayer.backends import mpi; print(mpi.detect_cuda_aware(None))"
    environ = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    return ("(True" in done.stdout), (done.stdout + done.stderr).strip()[-300:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_cuda_aware_mpi(ranks: int) -> None:
    aware, why = _mpi_cuda_aware()
    if not aware:
        pytest.skip(f"this MPI is not CUDA-aware (CUDA tensors are staged): {why}")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    if ranks > GPUS:
        pytest.skip(f"one GPU per rank here: {ranks} ranks, {GPUS} GPU(s)")
    _run(["mpiexec", "-n", str(ranks)], {"COMMLAYER_BACKEND": "mpi"}, ranks)
