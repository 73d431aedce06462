"""Timeline: Chrome-trace events land with the right times, rows and ranks; the file stays valid."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until

from commlayer.core import timeline as timeline_module
from commlayer.core.timeline import NullTimeline, Timeline, open_timeline


def _load(path: Path) -> list[dict[str, Any]]:
    events = json.loads(path.read_text())
    assert isinstance(events, list)
    return events


def _load_unclosed(path: Path) -> list[dict[str, Any]]:
    """Read a trace before close(), as Chrome does: the closing bracket may be missing."""
    text = path.read_text().rstrip()
    assert text.startswith("[")
    assert not text.endswith(","), "a trailing comma would make the closed file invalid"
    return json.loads(text + "\n]")


def _by_phase(events: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == phase]


def _thread_names(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}


def test_span_and_instant_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=3)
    t0 = time.perf_counter()
    tl.span("grad.w", "NEGOTIATING", t0 + 0.001, t0 + 0.0035, bytes=4096)
    tl.span("grad.b", "COLLECTIVE", t0 + 0.002, t0 + 0.002)
    tl.instant("grad.w", "CACHE_HIT", t0 + 0.004, algorithm="ring")
    tl.close()

    events = _load(path)
    assert all(e["pid"] == 3 for e in events)
    assert {"name": "process_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "rank 3"}} in (
        events
    )
    names = _thread_names(events)
    assert sorted(names.values()) == ["grad.b", "grad.w"]
    tid_of = {name: tid for tid, name in names.items()}
    assert tid_of["grad.w"] != tid_of["grad.b"]

    neg, coll = _by_phase(events, "X")
    assert (neg["name"], neg["tid"], neg["args"]) == (
        "NEGOTIATING",
        tid_of["grad.w"],
        {"bytes": 4096},
    )
    assert (coll["name"], coll["tid"], coll["dur"]) == ("COLLECTIVE", tid_of["grad.b"], 0)
    assert "args" not in coll
    # ts is µs since the Timeline was created, which happened just before t0.
    assert 1000 <= neg["ts"] < 1000 + 0.5e6
    assert neg["dur"] == pytest.approx(2500, abs=0.01)
    assert coll["ts"] - neg["ts"] == pytest.approx(1000, abs=0.01)

    (inst,) = _by_phase(events, "i")
    assert (inst["name"], inst["tid"], inst["s"], inst["args"]) == (
        "CACHE_HIT",
        tid_of["grad.w"],
        "t",
        {"algorithm": "ring"},
    )
    assert inst["ts"] - neg["ts"] == pytest.approx(3000, abs=0.01)


def test_row_named_once_per_tensor_and_any_activity(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=0)
    now = time.perf_counter()
    for activity in ("QUEUED", "NEGOTIATING", "FUSION_PACK", "COLLECTIVE", "FUSION_UNPACK", "MY X"):
        tl.span('layer.0 weight/"grad"', activity, now, now + 1e-6)
    tl.close()
    events = _load(path)
    assert list(_thread_names(events).values()) == ['layer.0 weight/"grad"']
    assert [e["name"] for e in _by_phase(events, "X")][-1] == "MY X"


def test_unserializable_args_are_shown_as_text(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=0)
    tl.instant("x", "DONE", time.perf_counter(), dtype=object())
    tl.close()
    (inst,) = _by_phase(_load(path), "i")
    assert inst["args"]["dtype"].startswith("<object object")


def test_readable_before_close_and_valid_json_after(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=0)
    assert _by_phase(_load_unclosed(path), "M")  # header and process name are on disk at once
    tl.span("a", "QUEUED", time.perf_counter(), time.perf_counter())
    tl.flush()
    assert len(_by_phase(_load_unclosed(path), "X")) == 1
    tl.close()
    tl.close()  # idempotent
    tl.span("a", "QUEUED", 0.0, 1.0)  # after close: dropped, not an error
    assert len(_by_phase(_load(path), "X")) == 1


def test_empty_timeline_is_valid_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    Timeline(str(path), rank=1).close()
    events = _load(path)
    assert _by_phase(events, "X") == [] and _by_phase(events, "M")


def test_flushes_in_chunks_and_stays_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline_module, "_FLUSH_EVENTS", 10)
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=0)
    now = time.perf_counter()
    sizes = []
    for i in range(95):
        tl.span(f"t{i % 7}", "COLLECTIVE", now + i * 1e-3, now + i * 1e-3 + 1e-4, i=i)
        sizes.append(len(_by_phase(_load_unclosed(path), "X")))
    # Written in chunks while running, not per event and not only at the end.
    assert 0 < sizes[-1] < 95
    assert len(set(sizes)) > 5
    tl.close()
    spans = _by_phase(_load(path), "X")
    assert [e["args"]["i"] for e in spans] == list(range(95))
    assert len(_thread_names(_load(path))) == 7


def test_close_from_another_thread_while_writing(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=0)
    stop = threading.Event()
    written = [0]

    def engine() -> None:
        while not stop.is_set():
            i = written[0]
            tl.span(f"t{i % 50}", "COLLECTIVE", time.perf_counter(), time.perf_counter())
            written[0] = i + 1

    thread = threading.Thread(target=engine)
    thread.start()
    # close once the writer is well under way (it goes on writing): not after a guessed time
    wait_until(lambda: written[0] >= 100, 10.0, "the writer thread did not write 100 spans")
    tl.close()
    stop.set()
    thread.join()
    assert _by_phase(_load(path), "X")


def test_open_timeline_off_is_null() -> None:
    assert isinstance(open_timeline("", rank=0), NullTimeline)


def test_open_timeline_rank_template(tmp_path: Path) -> None:
    template = str(tmp_path / "trace-{rank}.json")
    timelines = [open_timeline(template, rank) for rank in range(3)]
    assert all(isinstance(t, Timeline) for t in timelines)
    for t in timelines:
        t.instant("x", "HELLO", time.perf_counter())
        t.close()
    for rank in range(3):
        events = _load(tmp_path / f"trace-{rank}.json")
        assert {e["pid"] for e in events} == {rank}


def test_open_timeline_without_template_only_rank_0_writes(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    rank0 = open_timeline(str(path), rank=0)
    rank1 = open_timeline(str(path), rank=1)
    assert isinstance(rank0, Timeline)
    assert isinstance(rank1, NullTimeline)
    rank1.span("x", "QUEUED", 0.0, 1.0, k=1)
    rank1.instant("x", "Q", 0.0)
    rank1.flush()
    rank1.close()
    rank0.close()
    assert {e["pid"] for e in _load(path)} == {0}


def test_unwritable_path_names_rank_and_path(tmp_path: Path) -> None:
    bad = str(tmp_path / "missing-dir" / "t.json")
    with pytest.raises(OSError, match=r"rank 2: .*missing-dir"):
        Timeline(bad, rank=2)
