"""What a newcomer sees on a first run of ``python train.py``, in a fresh interpreter that no
launcher started: rank 0's one start-up line (quiet with ``COMMLAYER_LOG_LEVEL=warning``), a
hint that DistributedOptimizer runs over one rank and how to start several, no torch warning
from commlayer's own calls (a sparse embedding used to print torch's "Sparse invariant checks
are implicitly disabled" on every rank), and a traceback with one ``[rank0]:`` before each line
after commlayer started over torch.distributed twice (each start wrapped the last one's hook).

Each case is a fresh python (torch warns once a process, and the hooks are process-wide): 3-6 s
each on the loaded 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90.0

TRAIN = """\
import torch

import commlayer as hvd

hvd.init()
model = torch.nn.Sequential(torch.nn.EmbeddingBag(50, 4, mode="sum", sparse=True),
                            torch.nn.Linear(4, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
other = torch.nn.Linear(2, 2)
hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1))  # no second hint
for step in range(2):
    optimizer.zero_grad()
    model(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    optimizer.step()
sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (5,),
                                 check_invariants=True)
print("summed", hvd.sparse_allreduce_async(sparse, name="s")().to_dense().tolist())
"""

RESTARTED = """\
import commlayer

commlayer.init(backend="torch")
commlayer.shutdown()
commlayer.init(backend="torch")
raise ValueError("boom")
"""


def _python(
    tmp_path: Path, source: str, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python [flags] train.py`` in ``tmp_path``, as a user runs it: no launcher's variables,
    no COMMLAYER_* but ``env``."""
    script = tmp_path / "train.py"
    script.write_text(source)
    launched = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALNRANKS", "HYDRA_", "TORCHELASTIC_")
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMMLAYER_", *launched))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    }
    clean.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(
        [sys.executable, *flags, "train.py"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _lines(text: str, what: str) -> list[str]:
    return [line for line in text.splitlines() if what in line]


def test_one_start_up_line_a_hint_and_no_torch_warning(tmp_path: Path) -> None:
    # the sparse gradients through the whole path (one rank is otherwise the identity);
    # -W error: a warning from commlayer's calls is an exception, and the run fails
    run = _python(
        tmp_path, TRAIN, "-W", "error::UserWarning", env={"COMMLAYER_FORCE_FULL_PATH": "1"}
    )
    assert run.returncode == 0, run.stderr
    assert "summed [1.0, 0.0, 0.0, 2.0, 0.0]" in run.stdout, run.stdout
    started = _lines(run.stderr, "commlayer started:")
    assert len(started) == 1, run.stderr
    assert "1 rank on 1 node" in started[0] and "backend mpi" in started[0], started
    for setting in ("allreduce algorithm auto", "compression none", "fusion 64 MiB"):
        assert setting in started[0], started
    hints = _lines(run.stderr, "DistributedOptimizer runs over 1 rank")
    assert len(hints) == 1, run.stderr
    assert "no launcher started this process" in hints[0], hints
    assert "commlayerrun -np N python train.py" in hints[0], hints
    assert "Sparse invariant checks" not in run.stderr


def test_log_level_warning_leaves_both_out(tmp_path: Path) -> None:
    run = _python(tmp_path, TRAIN, env={"COMMLAYER_LOG_LEVEL": "warning"})
    assert run.returncode == 0, run.stderr
    assert "commlayer started" not in run.stderr and "runs over 1 rank" not in run.stderr
    assert "summed [1.0, 0.0, 0.0, 2.0, 0.0]" in run.stdout


def test_a_traceback_has_one_rank_prefix_after_a_restart(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    run = _python(tmp_path, RESTARTED)
    assert run.returncode == 1, run.stderr
    traceback = _lines(run.stderr, "Traceback") + _lines(run.stderr, "ValueError: boom")
    assert traceback == ["[rank0]: Traceback (most recent call last):", "[rank0]: ValueError: boom"]
