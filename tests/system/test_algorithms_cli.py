"""Allreduce algorithms end to end (issue #5): a job run under each
COMMLAYER_ALLREDUCE_ALGORITHM gets right results through the engine, and ``commlayer
calibrate`` measures this machine and writes the file ``commlayer algorithms`` and ``auto``
read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from commlayer import costmodel

if TYPE_CHECKING:
    from conftest import RunMPI


@pytest.mark.parametrize(
    ("algorithm", "ranks", "picked"),
    [
        ("ring", 3, "ring"),
        ("rabenseifner", 3, "rabenseifner"),
        ("shm", 3, "shm"),
        ("tree", 2, "tree"),
        ("swing", 3, "swing"),
        ("auto", 2, "shm"),  # no calibration in the job's cache: 40 MiB on one node is shm
    ],
)
def test_engine_runs_the_configured_algorithm(
    run_mpi: RunMPI, tmp_path: Path, algorithm: str, ranks: int, picked: str
) -> None:
    env = {"COMMLAYER_ALLREDUCE_ALGORITHM": algorithm, "XDG_CACHE_HOME": str(tmp_path)}
    job = run_mpi("algorithm.py", ranks, env=env, timeout_s=90.0)
    assert job.returncode == 0, job.output()
    for rank in range(ranks):
        done = job.one("done", rank)
        assert done["configured"] == algorithm and done["picked_big"] == picked, job.output()
        assert done["all_right"], job.output()


def test_hierarchical_and_shd_on_a_pretend_two_node_topology(
    run_mpi: RunMPI, tmp_path: Path
) -> None:
    for algorithm in ("hierarchical", "shd"):
        env = {"COMMLAYER_ALLREDUCE_ALGORITHM": algorithm, "COMMLAYER_TOPOLOGY": "nodes=2,local=2"}
        job = run_mpi("algorithm.py", 4, env=env, timeout_s=90.0)
        assert job.returncode == 0, job.output()
        assert all(job.one("done", r)["all_right"] for r in range(4)), job.output()


def test_a_topology_that_does_not_fit_fails_init_with_its_name(run_mpi: RunMPI) -> None:
    job = run_mpi("algorithm.py", 2, env={"COMMLAYER_TOPOLOGY": "nodes=3,local=1"}, timeout_s=60.0)
    assert job.returncode != 0
    assert "COMMLAYER_TOPOLOGY='nodes=3,local=1' does not fit this job" in job.stderr, job.output()


def test_calibrate_writes_what_auto_and_the_table_read(run_mpi: RunMPI, tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    job = run_mpi("calibrate.py", 2, "--quick", "--out", str(out), timeout_s=120.0)
    assert job.returncode == 0, job.output()
    assert f"saved to {out}" in job.stdout and "67,108,864 B:" in job.stdout, job.output()
    stored = json.loads(out.read_text())
    assert list(stored) == ["size=2,nodes=1"]
    cal = costmodel.load(2, 1, out)
    assert cal is not None and cal.alpha_s > 0 and cal.beta_s_per_byte > 0
    # the engine's own cost per collective call, measured through commlayer.init (the handoff
    # to the engine's thread and back is more than MPI's own 1 KiB allreduce)
    assert cal.op_latency_s > 0 and "a collective call" in job.stdout, job.output()
    assert sorted(cal.native) == ["native", "shm"] and all(t > 0 for _, t in cal.native["native"])
    best = costmodel.table(64 << 20, cal)[0][0]
    assert costmodel.choose(16 << 20, 4, 2, 1, cal) in costmodel.candidates(True)
    assert best in costmodel.candidates(True)
    # the sparse kernels' rates go beside --out, not into this machine's cache
    sparse = json.loads(out.with_suffix(".sparse.json").read_text())
    assert sparse["merge_s_per_pair"] > 0 and sparse["scatter_s_per_entry"] > 0
    assert f"saved to {out.with_suffix('.sparse.json')}" in job.stdout, job.output()


def test_calibrate_on_a_pretend_two_node_topology_measures_across_nodes(
    run_mpi: RunMPI, tmp_path: Path
) -> None:
    out = tmp_path / "calibration.json"
    env = {"COMMLAYER_TOPOLOGY": "nodes=2,local=2"}  # ranks 0, 1 | 2, 3: 0-2 and 1-3 cross
    job = run_mpi("calibrate.py", 4, "--quick", "--out", str(out), env=env, timeout_s=240.0)
    assert job.returncode == 0, job.output()
    assert list(json.loads(out.read_text())) == ["size=4,nodes=2"]
    cal = costmodel.load(4, 2, out)
    assert cal is not None and cal.has_inter, job.output()
    assert [n for n, _ in cal.exchange_inter] == [n for n, _ in cal.exchange]
    assert all(t > 0 for _, t in cal.exchange_inter + cal.exchange)
    assert sorted(cal.native) == ["native"]  # shm is no candidate on several nodes
    assert costmodel.choose(16 << 20, 4, 4, 2, cal) in costmodel.candidates(single_node=False)
