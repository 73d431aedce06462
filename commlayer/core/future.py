"""Future: the result of an asynchronous operation, with torch's Future interface.

Every ``*_async`` call returns one. It answers ``wait()``, ``value()``, ``done()``,
``then(callback)`` and ``add_done_callback(callback)`` as ``torch.futures.Future`` does, and
``commlayer.synchronize(handle)`` / ``commlayer.poll(handle)`` as Horovod's handles do
(``Handle`` is the same class under Horovod's name). Why not ``torch.futures.Future`` itself:

1. Errors keep their type through a chain. A torch Future re-raises a callback's error (or one
   it chained from) as a ``RuntimeError`` whose text embeds the original; commlayer's errors
   (``TensorMismatchError``, ``RankDiedError``...) are caught by type in user code.
2. Creation is cheap (a held lock is the latch: 0.1 us, against ~2 us for a torch Future),
   which counts at 100s of operations per step.

Device order, as torch's CUDA futures: in a process that queues device work for its operations
(commlayer/core/device.py, **Order**), a future is completed with ``marks``, events recorded on the
completing thread's current streams after the work queued for its value (the engine's finish,
the callbacks that completed it: a compressor's decompress, the copy into a gradient). ``wait()``
and ``value()`` make the caller's current streams wait on them (no host wait), and so does
every callback before it runs; a future made by a callback (``then``, ``combined``, a
communicator's rounds) is completed with marks of its own, after the callback's work. So the
stream that consumes a value (``step()``'s, DDP's) is ordered after all of that work, on
whatever stream and thread it was queued. A CPU job's futures carry none (one check).

Callbacks run on the thread that completes the future: the engine's thread for an operation
(or the caller's, if it was already done). They must be short and must not wait on another
commlayer operation: the engine would be waiting on itself. Such a wait raises at once instead
of hanging. ``to_torch()`` gives a ``torch.futures.Future`` completed from a callback, for
APIs that need torch's own type (a DDP communication hook), with no thread in between.
"""

from __future__ import annotations

import _thread
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commlayer.core import device

log = logging.getLogger("commlayer")

# The thread that runs the engine (set by it): a wait there on a pending future cannot end.
_engine_threads: set[int] = set()
# One lock guards every future's callback list against completion racing registration: a
# future is completed once and callbacks are rare, so a shared lock is never contended long,
# and a lock per future would double the cost of creating one.
_callbacks_lock = threading.Lock()


def mark_engine_thread(ident: int | None, running: bool) -> None:
    """Record (or forget) the engine's thread: waits on it are refused (module docstring)."""
    if ident is None:
        return
    if running:
        _engine_threads.add(ident)
    else:
        _engine_threads.discard(ident)


class Future:
    """Result of an asynchronous operation (module docstring)."""

    __slots__ = ("name", "_latch", "_done", "_result", "_error", "_callbacks", "_marks")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._latch = _thread.allocate_lock()
        self._latch.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] | None = None
        self._marks: device.Marks | None = None  # (module docstring, device order)

    # -- torch.futures.Future's interface ----------------------------------------------------
    def done(self) -> bool:
        """Whether the operation has completed (with a result or an error)."""
        return self._done

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until done; return the result or raise the operation's error. The caller's
        current streams wait for the device work queued for the result (module docstring)."""
        if not self._done:
            if _thread.get_ident() in _engine_threads:
                raise RuntimeError(
                    f"operation {self.name!r} waited on from a callback the engine runs: it "
                    "would never complete; chain it with then() instead of waiting"
                )
            if not self._latch.acquire(timeout=-1 if timeout_s is None else timeout_s):
                raise TimeoutError(f"operation {self.name!r} did not complete in {timeout_s} s")
            self._latch.release()  # let other waiters through
        if self._error is not None:
            raise self._error
        if self._marks is not None:
            device.follow(self._marks)
        return self._result

    def __call__(self) -> Any:
        """``handle()`` is ``wait()``: horovod.torch's sparse_allreduce_async returns a function
        to call for the result, and code written for it calls commlayer's future alike."""
        return self.wait()

    def value(self) -> Any:
        """The result of a completed future (raises its error); RuntimeError if not done."""
        if not self._done:
            raise RuntimeError(f"operation {self.name!r} has not completed: wait() for it first")
        return self.wait()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A future of ``callback(self)``, run once this one is done; an error raised by the
        callback (``self.value()`` re-raises this one's) completes it with that error."""
        chained = Future(self.name)

        def run(done: Future) -> None:
            try:
                result = callback(done)
            except BaseException as exc:  # noqa: BLE001 - it is the chained future's outcome
                chained.set_exception(exc)
            else:
                chained.set_result(result)

        self.add_done_callback(run)
        return chained

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        """Run ``callback(self)`` once done (now, if it is). Its errors are logged, not raised:
        use ``then`` to carry them on."""
        with _callbacks_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        _run(callback, self)

    def set_result(self, result: Any) -> None:
        self._set(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._set(None, error)

    # -- completion ------------------------------------------------------------------------------
    def _set(self, result: Any = None, error: BaseException | None = None) -> None:
        marks = device.marks() if error is None else None  # after the work queued for result
        with _callbacks_lock:
            if self._done:
                raise RuntimeError(f"operation {self.name!r} was completed twice")
            self._result, self._error, self._marks = result, error, marks
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
        self._latch.release()
        for callback in callbacks or ():
            _run(callback, self)

    def to_torch(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` completed with this one's result or error; where devices
        are in use it declares them, so it records events after the work queued for the result
        and its waiters (DDP's reducer) and callbacks wait on them."""
        devices: list[Any] = device.future_devices()  # (torch.device, int or str)
        out: torch.futures.Future[Any] = torch.futures.Future(devices=devices or None)

        def forward(done: Future) -> None:
            if done._error is not None:
                out.set_exception(done._error)
            else:
                out.set_result(done._result)

        self.add_done_callback(forward)
        return out

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<commlayer.Handle {self.name!r} {state}>"  # Horovod's name for it


Handle = Future  # Horovod's name for what an *_async call returns


def combined(name: str, parts: Sequence[Any], combine: Callable[[list[Any]], Any]) -> Future:
    """A future over several (commlayer or torch) futures: done once all are, its result
    ``combine(results)`` (or the first part's error), computed by the thread that completes the
    last part; done at once, with ``combine([])``, when there are none."""
    out = Future(name)
    remaining = [len(parts)]
    lock = threading.Lock()

    def finish() -> None:
        try:
            results = [part.wait() for part in parts]  # all done: no wait, or a part's error
            out.set_result(combine(results))
        except BaseException as exc:  # noqa: BLE001 - the combined future's outcome
            out.set_exception(exc)

    def one_done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        finish()

    if not parts:
        finish()
    for part in parts:
        part.add_done_callback(one_done)
    return out


def _run(callback: Callable[[Future], None], future: Future) -> None:
    """``callback(future)``, its work queued after the future's (module docstring)."""
    try:
        if future._marks is not None:
            device.follow(future._marks)
        callback(future)
    except Exception:  # noqa: BLE001 - a user's callback must not stop the engine
        log.exception("commlayer: a callback on %r raised", future)
