"""Fake device streams and events for CPU tensors: a model of what CUDA orders after what.

``FakeDevice.install(monkeypatch)`` replaces commlayer/core/device.py's device-dependent functions
(the streams, the current stream of a thread, events, ``record_stream``) with these fakes, so the
direct and staged paths run on CPU tensors with their stream logic intact: the engine thread
makes the work stream its current one, the caller's stream records the producer event, and so
on. Tensor operations still run at once on the CPU; tests name the device work they care about
with ``enqueue`` (a decompress, a write into a gradient, an optimizer step) on the calling
thread's current stream.

What orders what, as on a GPU (vector clocks, one entry per stream):
- work on one stream runs in the order it was queued;
- ``stream.wait_event(e)``: what is queued on the stream from then on runs after the work that
  was queued on ``e``'s stream before ``e`` was recorded;
- ``e.synchronize()`` / ``e.query() is True`` (a host wait): that work is done, so whatever any
  thread queues afterwards runs after it.
Nothing else orders two streams: in particular a future completing on the host does not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from commlayer.core import device

Clock = dict[str, int]


def _join(into: Clock, other: Clock) -> None:
    for name, count in other.items():
        if into.get(name, 0) < count:
            into[name] = count


class FakeEvent:
    """An event recorded on a fake stream: the stream's clock when it was recorded."""

    def __init__(self, world: FakeDevice, clock: Clock, stream: str) -> None:
        self.world, self.clock, self.stream = world, clock, stream

    def synchronize(self) -> None:
        self.world.host_waited(self, "synchronize")

    def query(self) -> bool:
        if self.world.busy:
            return False
        self.world.host_waited(self, "query")
        return True

    def wait(self, stream: Any = None) -> None:
        (stream or self.world.current()).wait_event(self)


class FakeStream:
    """A stream: its clock is what the next work queued on it runs after."""

    def __init__(self, world: FakeDevice, name: str) -> None:
        self.world, self.name = world, name
        self.clock: Clock = {}
        self.queued = 0

    def wait_event(self, event: FakeEvent) -> None:
        with self.world.lock:
            _join(self.clock, event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self.wait_event(self.world.record(other))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class Work:
    """Device work queued on a stream: ``after`` is what it is ordered after."""

    def __init__(self, what: str, stream: str, number: int, after: Clock) -> None:
        self.what, self.stream, self.number, self.after = what, stream, number, after

    def before(self, other: Work) -> bool:
        """Whether this work certainly runs before ``other``."""
        return other.after.get(self.stream, 0) >= self.number

    def __repr__(self) -> str:
        return f"{self.what}@{self.stream}#{self.number}"


class FakeDevice:
    """Streams for one (CPU) device: ``default`` (every thread's current stream at first),
    the engine's ``work`` stream, the staged path's ``d2h`` and ``h2d`` streams, and a ``side``
    stream for a caller."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.default, self.work, self.d2h, self.h2d, self.side = (
            FakeStream(self, name) for name in ("default", "work", "d2h", "h2d", "side")
        )
        self._done: Clock = {}  # work the host has seen complete
        self._current = threading.local()
        self.log: list[Work] = []
        self.host_waits: list[tuple[str, str]] = []  # (synchronize or query, the event's stream)
        self.busy = False  # queries answer "not done" (and the host learns nothing)

    # -- the clock model ---------------------------------------------------------------------
    def current(self) -> FakeStream:
        return getattr(self._current, "stream", self.default)

    def set_current(self, stream: FakeStream) -> None:
        self._current.stream = stream

    def record(self, stream: FakeStream) -> FakeEvent:
        with self.lock:
            return FakeEvent(self, dict(stream.clock), stream.name)

    def host_waited(self, event: FakeEvent, how: str) -> None:
        with self.lock:
            _join(self._done, event.clock)
            self.host_waits.append((how, event.stream))

    def enqueue(self, what: str) -> Work:
        """Device work ``what`` queued now on the calling thread's current stream."""
        stream = self.current()
        with self.lock:
            stream.queued += 1
            _join(stream.clock, self._done)
            stream.clock[stream.name] = stream.queued
            work = Work(what, stream.name, stream.queued, dict(stream.clock))
            self.log.append(work)
        return work

    def unordered(self, first: str, then: str) -> list[tuple[Work, Work]]:
        """Pairs (a ``first`` work, a later ``then`` work) where the ``then`` work, queued after
        the other in time, is not ordered after it on the device."""
        found = []
        for j, later in enumerate(self.log):
            if later.what == then:
                earlier = [w for w in self.log[:j] if w.what == first]
                found += [(w, later) for w in earlier if not w.before(later)]
        return found

    # -- commlayer/core/device.py's seams ---------------------------------------------------
    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Replace device.py's device-dependent functions with this model's, for the test."""

        @contextlib.contextmanager
        def on(stream: Any) -> Iterator[None]:
            before = self.current()
            if stream is not None:
                self.set_current(stream)
            try:
                yield
            finally:
                self.set_current(before)

        def copy(dst: Any, src: Any) -> None:
            self.enqueue("copy")
            dst.copy_(src)

        monkeypatch.setattr(device, "_work_stream", lambda _device: self.work)
        monkeypatch.setattr(device, "_d2h_stream", lambda _device: self.d2h)
        monkeypatch.setattr(device, "_h2d_stream", lambda _device: self.h2d)
        monkeypatch.setattr(device, "_copy", copy)
        monkeypatch.setattr(device, "_host_pool", device._HostPool())  # none from other tests
        monkeypatch.setattr(device, "_current_stream", lambda _device: self.current())
        monkeypatch.setattr(device, "_set_stream", lambda _device, stream: self.set_current(stream))
        monkeypatch.setattr(device, "_on", on)
        monkeypatch.setattr(device, "_event", self.record)
        monkeypatch.setattr(device, "_keep", lambda tensor, stream: None)
        monkeypatch.setattr(device, "_marked", ())
