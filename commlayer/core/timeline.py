"""Timeline: a Chrome trace of what the engine did to each tensor, for chrome://tracing or Perfetto.

The file is the trace-event JSON *array* format: ``[`` then one event per line. Every rank is a
process (pid = rank, named "rank N"); every tensor name is a row (tid, named after the tensor);
engine activities ("QUEUED", "NEGOTIATING", "FUSION_PACK", "COLLECTIVE", "FUSION_UNPACK", or any
other string) are complete ("X") events on that row, and markers are instant ("i") events.

1. Times come in as ``time.perf_counter()`` seconds and are written as microseconds since the
   Timeline was created, which is what the format expects.
2. Events are buffered and written in chunks (more than ``_FLUSH_EVENTS`` pending, and on
   ``close()``) so the engine thread does not pay a ``write`` per event.
3. Before ``close()`` the file lacks its closing ``]``, which Chrome and Perfetto accept, so a
   trace of a run that crashed or is still going can be opened; after ``close()`` it is valid
   JSON (``json.load`` reads it).
4. ``span``/``instant`` run on the engine thread, ``close()`` may run on another (shutdown, atexit):
   one lock guards the buffer and the file.
"""

from __future__ import annotations

import json
import threading
import time
from typing import IO, Any

# About 1000 events (~150 B each, ~150 KiB) per write: large enough that a write is rare (a few
# per training step at most), small enough that a crash loses little and memory stays bounded.
_FLUSH_EVENTS = 1000

_RANK_FIELD = "{rank}"


class Timeline:
    """Writes one rank's trace to ``path``; see the module docstring for the format."""

    __slots__ = ("_buffer", "_file", "_lock", "_path", "_rank", "_t0_s", "_tids", "_wrote_any")

    def __init__(self, path: str, rank: int) -> None:
        self._path = path
        self._rank = rank
        self._t0_s = time.perf_counter()
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._buffer: list[dict[str, Any]] = []
        self._wrote_any = False
        try:
            self._file: IO[str] | None = open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise OSError(
                f"rank {rank}: cannot open the timeline file {path!r} (COMMLAYER_TIMELINE): {exc}"
            ) from exc
        self._file.write("[\n")
        self._buffer.append(self._metadata("process_name", 0, f"rank {rank}"))
        self._buffer.append(self._metadata("process_sort_index", 0, rank, key="sort_index"))
        self.flush()

    @property
    def path(self) -> str:
        """The file this timeline writes."""
        return self._path

    def span(
        self, tensor_name: str, activity: str, start_s: float, end_s: float, **args: object
    ) -> None:
        """Record that ``tensor_name`` was in ``activity`` from ``start_s`` to ``end_s``
        (``time.perf_counter()`` seconds); ``args`` show in the trace viewer's detail pane."""
        event: dict[str, Any] = {
            "name": activity,
            "ph": "X",
            "ts": self._us(start_s),
            "dur": max(0.0, round((end_s - start_s) * 1e6, 3)),
        }
        self._add(tensor_name, event, args)

    def instant(self, tensor_name: str, label: str, ts_s: float, **args: object) -> None:
        """Record a point event ``label`` on ``tensor_name``'s row at ``ts_s`` (perf_counter s)."""
        event: dict[str, Any] = {"name": label, "ph": "i", "s": "t", "ts": self._us(ts_s)}
        self._add(tensor_name, event, args)

    def flush(self) -> None:
        """Write buffered events to the file (still without the closing bracket)."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Flush, close the JSON array and the file. Idempotent; later events are dropped."""
        with self._lock:
            if self._file is None:
                return
            self._flush_locked()
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    def _us(self, t_s: float) -> float:
        # Rounded to ns: keeps the file short and stable; viewers show at most ns anyway.
        return round((t_s - self._t0_s) * 1e6, 3)

    def _metadata(self, name: str, tid: int, value: object, key: str = "name") -> dict[str, Any]:
        return {"name": name, "ph": "M", "pid": self._rank, "tid": tid, "args": {key: value}}

    def _add(self, tensor_name: str, event: dict[str, Any], args: dict[str, object]) -> None:
        with self._lock:
            if self._file is None:
                return
            tid = self._tids.get(tensor_name)
            if tid is None:
                # tid 0 is left for process-wide metadata; rows appear in first-seen order.
                tid = self._tids[tensor_name] = len(self._tids) + 1
                self._buffer.append(self._metadata("thread_name", tid, tensor_name))
            event["pid"] = self._rank
            event["tid"] = tid
            if args:
                event["args"] = args
            self._buffer.append(event)
            if len(self._buffer) > _FLUSH_EVENTS:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is None or not self._buffer:
            return
        # default=str: args may hold torch.dtype, torch.Size, enums; show them rather than fail.
        lines = [json.dumps(event, separators=(",", ":"), default=str) for event in self._buffer]
        self._buffer.clear()
        prefix = ",\n" if self._wrote_any else ""
        self._file.write(prefix + ",\n".join(lines))
        self._file.flush()
        self._wrote_any = True


class NullTimeline:
    """The timeline when it is off: every method does nothing."""

    __slots__ = ()

    def span(
        self, tensor_name: str, activity: str, start_s: float, end_s: float, **args: object
    ) -> None:
        """Do nothing."""

    def instant(self, tensor_name: str, label: str, ts_s: float, **args: object) -> None:
        """Do nothing."""

    def flush(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


def open_timeline(path_template: str, rank: int) -> Timeline | NullTimeline:
    """The timeline ``rank`` should write, from ``COMMLAYER_TIMELINE``'s value.

    ``""`` turns it off; a path containing ``{rank}`` gives every rank its own file (the field is
    replaced by the rank); any other path is written by rank 0 alone.
    """
    if not path_template:
        return NullTimeline()
    if _RANK_FIELD in path_template:
        return Timeline(path_template.replace(_RANK_FIELD, str(rank)), rank)
    if rank == 0:
        return Timeline(path_template, rank)
    return NullTimeline()
