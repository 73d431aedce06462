"""The one line that says what a job got (``commlayer.startup_summary()``; rank 0 logs it at
info level, the default, from ``init()``): ranks, nodes with their hosts and ranks, backend,
algorithm, compression, fusion."""

from __future__ import annotations

import pytest

import commlayer
from commlayer import kernels
from commlayer.common.config import Config
from commlayer.common.errors import NotInitializedError
from commlayer.core import runtime


def test_one_node() -> None:
    line = runtime.summary_line([0, 0], ["box", "box"], "mpi", Config())
    assert line == (
        "commlayer started: 2 ranks on 1 node (2 ranks per node; box: 0-1), backend mpi, "
        "allreduce algorithm auto, compression none, fusion 64 MiB, wait policy auto"
    )


@pytest.mark.parametrize(
    ("threshold_bytes", "said"),
    [(0, "fusion off"), (32 << 20, "fusion 32 MiB"), (1 << 30, "fusion 1 GiB"),
     (1000, "fusion 1000 B")],
)  # fmt: skip
def test_fusion_threshold_as_it_is_written(threshold_bytes: int, said: str) -> None:
    line = runtime.summary_line(
        [0], ["solo"], "mpi", Config(fusion_threshold_bytes=threshold_bytes)
    )
    assert f", {said}, " in line


def test_several_nodes_with_their_ranks_and_settings() -> None:
    cfg = Config(allreduce_algorithm="ring", compression="fp16", topology="nodes=2,local=2")
    line = runtime.summary_line([0, 0, 1, 1], ["n1", "n1", "n2", "n2"], "torch", cfg)
    assert "4 ranks on 2 nodes (2 ranks per node; n1: 0-1; n2: 2-3)" in line
    assert "topology nodes=2,local=2, backend torch, allreduce algorithm ring" in line
    assert "compression fp16" in line


def test_uneven_and_interleaved_nodes() -> None:
    line = runtime.summary_line([0, 1, 0, 0], ["a", "b", "a", "a"], "mpi", Config())
    assert "4 ranks on 2 nodes (1-3 ranks per node; a: 0,2-3; b: 1)" in line


def test_one_rank() -> None:
    line = runtime.summary_line([0], ["solo"], "mpi", Config())
    assert line.startswith("commlayer started: 1 rank on 1 node (1 rank per node; solo: 0)")


def test_many_hosts_are_cut_short() -> None:
    nodes = list(range(12))
    line = runtime.summary_line(nodes, [f"h{n}" for n in nodes], "mpi", Config(), most_hosts=3)
    assert "h0: 0; h1: 1; h2: 2; ... 9 more" in line and "h3" not in line


def test_startup_summary_before_init_raises() -> None:
    if commlayer.is_initialized():
        pytest.skip("commlayer is running in this process")
    with pytest.raises(NotInitializedError):
        commlayer.startup_summary()


@pytest.mark.parametrize("level", [None, "warning"], ids=["default", "warning"])
def test_init_logs_the_summary_by_default(caplog: pytest.LogCaptureFixture, level: str) -> None:
    """A one-rank init() (no launcher: the MPI backend over this process alone) logs the line
    at info, the default level; COMMLAYER_LOG_LEVEL=warning leaves it out."""
    if commlayer.is_initialized():
        pytest.skip("commlayer is running in this process")
    before = kernels.configured()
    commlayer.init(**({"log_level": level} if level else {}))
    try:
        summary = commlayer.startup_summary()
    finally:
        commlayer.shutdown()
        kernels.use(before)
    assert summary.startswith("commlayer started: 1 rank on 1 node (1 rank per node; ")
    assert "backend mpi, allreduce algorithm auto" in summary
    logged = [r.getMessage() for r in caplog.records if r.name == "commlayer"]
    assert logged.count(summary) == (1 if level is None else 0), logged
