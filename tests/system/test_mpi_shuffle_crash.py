"""Partial-local shuffling survives a rank dying mid-exchange (issue 24): the exchange is two-
phase, so a new job opening the same stores finds every sample exactly once, rolled back when
the dying rank had not committed (the stores as at the start of the epoch) or forward when it
had, and runs an epoch visiting every sample once; under mpiexec, and (mid) under torchrun."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import RunMPI

N = 41  # scripts/shuffle_crash.py


@pytest.mark.parametrize(
    ("when", "torchrun"),
    [("mid", False), ("committing", False), ("mid", True)],
    ids=["mid", "committing", "mid-torchrun"],
)
def test_a_rank_dying_mid_exchange_loses_no_sample(
    run_mpi: RunMPI, tmp_path: Path, when: str, torchrun: bool
) -> None:
    crashed = run_mpi("shuffle_crash.py", 2, "crash", str(tmp_path), when, torchrun=torchrun)
    assert crashed.returncode != 0 and crashed.find("dying", 1), crashed.output()
    assert not crashed.find("not killed", 1), crashed.output()  # rank 0 may finish committing
    resumed = run_mpi("shuffle_crash.py", 2, "resume", str(tmp_path), torchrun=torchrun)
    assert resumed.returncode == 0, resumed.output()
    stores = [resumed.one("stores", r) for r in range(2)]
    assert {s["layout"] for s in stores} == {"packs"}, "from_dataset writes pack files"
    assert sorted(i for s in stores for i in s["ids"]) == list(range(N)), resumed.output()
    # rolled forward: epoch 1's exchange counts as done (epoch 2); back: epoch 1 again
    assert {s["epoch"] for s in stores} == {2 if when == "committing" else 1}
    visited = [resumed.one("visited", r) for r in range(2)]
    assert sorted(i for v in visited for i in v["ids"]) == list(range(N))
    assert all(v["ids"] == v["values"] for v in visited)
    assert not any(s["staged"] for s in stores), "recovery must clear what was staged"
