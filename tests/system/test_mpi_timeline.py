"""COMMLAYER_TIMELINE: a run of named collectives writes a valid Chrome trace (JSON array) with
QUEUED, NEGOTIATING and COLLECTIVE spans for each named tensor, in that order; under mpiexec,
and per rank under torchrun (the engine over gloo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import RunMPI

ALLREDUCED = ["grad.a", "grad.b0", "grad.b1", "grad.b2"]
TENSORS = [*ALLREDUCED, "gathered", "broadcasted"]
PHASES = ["QUEUED", "NEGOTIATING", "COLLECTIVE"]
_SLACK_US = 1.0  # rounding of the written timestamps


def _spans(events: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """tensor -> activity -> its complete ("X") events, in file order."""
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for event in events:
        if event["ph"] == "X":
            spans.setdefault(rows[event["tid"]], {}).setdefault(event["name"], []).append(event)
    return spans


def _check_trace(path: Path, rank: int) -> None:
    events = json.loads(path.read_text())  # valid JSON: the closing bracket was written
    assert isinstance(events, list) and events
    assert all(e["pid"] == rank for e in events)
    spans = _spans(events)
    for tensor in TENSORS:
        assert tensor in spans, f"no row for {tensor!r} in {sorted(spans)}"
        for phase in PHASES:
            assert phase in spans[tensor], f"{tensor!r} has no {phase} span"
        repeats = 3 if tensor in ALLREDUCED else 1
        for i in range(repeats):
            queued, negotiating, collective = (spans[tensor][p][i] for p in PHASES)
            for earlier, later in ((queued, negotiating), (negotiating, collective)):
                end = earlier["ts"] + earlier["dur"]
                assert end <= later["ts"] + _SLACK_US, (tensor, earlier, later)
        assert len(spans[tensor]["COLLECTIVE"]) == repeats


@pytest.mark.parametrize(
    ("size", "template", "closing", "torchrun"),
    [
        (2, "trace.json", "explicit", False),
        (3, "trace.{rank}.json", "atexit", False),
        (3, "trace.{rank}.json", "atexit", True),
    ],
    ids=["np2-rank0-shutdown", "np3-per-rank-atexit", "np3-per-rank-atexit-torchrun"],
)
def test_timeline_is_a_valid_trace_of_the_named_tensors(
    run_mpi: RunMPI, tmp_path: Path, size: int, template: str, closing: str, torchrun: bool
) -> None:
    path = tmp_path / template
    job = run_mpi(
        "timeline.py", size, closing, env={"COMMLAYER_TIMELINE": str(path)}, torchrun=torchrun,
    )  # fmt: skip
    assert job.returncode == 0, job.output()
    assert len(job.find("done")) == size, job.output()
    if "{rank}" in template:
        written = sorted(p.name for p in tmp_path.glob("trace.*.json"))
        assert written == [f"trace.{r}.json" for r in range(size)]
        for rank in range(size):
            _check_trace(Path(str(path).replace("{rank}", str(rank))), rank)
    else:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # rank 0 only
        _check_trace(path, 0)


@pytest.mark.parametrize(
    ("template", "failing"),
    [("missing/trace.json", [0]), ("r{rank}/trace.json", [1])],
    ids=["rank0-no-such-directory", "rank1-no-such-directory"],
)
def test_a_timeline_file_a_rank_cannot_open_ends_init_on_every_rank(
    run_mpi: RunMPI, tmp_path: Path, template: str, failing: list[int]
) -> None:
    """The rank that cannot open its file raised alone in init() and the others waited in the
    engine's first collective for ever: now init() raises on every rank, naming the path and
    the rank that failed (a hang fails at the harness's time limit)."""
    (tmp_path / "r0").mkdir()  # rank 0's directory of the per-rank template; rank 1's missing
    path = tmp_path / template
    job = run_mpi("timeline.py", 2, "explicit", env={"COMMLAYER_TIMELINE": str(path)})
    assert job.returncode != 0 and not job.find("done"), job.output()
    for rank in range(2):
        error = job.one("uncaught", rank)
        assert error["error"] == "ConfigError", job.output()
        message = error["message"]
        assert message.startswith(f"rank {rank}: commlayer cannot start, rank(s) {failing}"), (
            message
        )
        bad = str(path).replace("{rank}", str(failing[0]))
        assert f"rank {failing[0]}: cannot open the timeline file {bad!r}" in message, message
