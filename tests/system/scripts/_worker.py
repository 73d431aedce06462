"""Shared by the worker scripts: result records, a watchdog and stack dumps on demand.

A worker calls ``start()`` first, then ``report(event, ...)`` for what the test checks. Records
are JSON lines in ``$SYSTEST_OUT_DIR/rank<R>.jsonl`` (opened per record, so a rank that dies
right after reporting loses nothing), echoed to stdout in one write so ranks do not interleave.
An exception nobody caught is a record too (``uncaught``), so tests read it from the rank
rather than from the launcher's copy of its stderr.

Ranks order their steps by waiting on what another process did (``wait_for``: a record of
another rank; ``engine_stopped``: this rank's engine noticed a peer's end), never by sleeping.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

# Hydra sets PMI_RANK, torchrun RANK; known before commlayer.init(), which some workers expect
# to fail.
RANK = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0")))
# A rank's own waits: below the harness's 45 s job limit (conftest.DEFAULT_TIMEOUT_S), so a
# wait that fails is reported by the rank that waited, not as a hang of the whole job.
WAIT_S = 30.0


def start() -> None:
    """Dump every thread's stack on SIGUSR2 (the harness sends it to a hung job), and dump and
    exit on our own after $SYSTEST_WATCHDOG_S, so a hang ends even without the harness.
    Not SIGUSR1: hydra sends that to the survivors when a rank dies, and MPICH handles it.
    An uncaught exception, of the main thread or another, is reported (``uncaught``) before
    Python prints it."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    faulthandler.dump_traceback_later(float(os.environ.get("SYSTEST_WATCHDOG_S", "40")), exit=True)
    python_hook, python_thread_hook = sys.excepthook, threading.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        report("uncaught", thread="MainThread", **error_fields(exc))
        python_hook(kind, exc, tb)  # and Python's traceback on stderr, as before

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            thread = args.thread.name if args.thread else None
            report("uncaught", thread=thread, **error_fields(args.exc_value))
        python_thread_hook(args)

    sys.excepthook, threading.excepthook = hook, thread_hook


def report(event: str, **fields: Any) -> None:
    record = {"rank": RANK, "event": event, "time": time.time(), **fields}
    line = json.dumps(record) + "\n"
    out_dir = os.environ.get("SYSTEST_OUT_DIR", ".")
    with open(os.path.join(out_dir, f"rank{RANK}.jsonl"), "a", encoding="utf-8") as out:
        out.write(line)
    os.write(sys.stdout.fileno(), line.encode())


def records(rank: int) -> list[dict[str, Any]]:
    """What ``rank`` reported so far: its complete lines (one being written is left out)."""
    path = os.path.join(os.environ.get("SYSTEST_OUT_DIR", "."), f"rank{rank}.jsonl")
    try:
        with open(path, encoding="utf-8") as done:
            lines = done.read().split("\n")[:-1]  # after the last newline: not complete yet
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def wait_for(event: str, rank: int, **fields: Any) -> dict[str, Any]:
    """The first ``event`` record of ``rank`` with ``fields``, once it has written one."""
    from waiting import wait_until  # tests/waiting.py, on the PYTHONPATH the harness sets

    found: list[dict[str, Any]] = []

    def written() -> bool:
        found[:] = [
            r for r in records(rank)
            if r["event"] == event and all(r.get(k) == v for k, v in fields.items())
        ]  # fmt: skip
        return bool(found)

    wait_until(written, WAIT_S, f"rank {RANK}: rank {rank} never reported {event!r}", 0.01)
    return found[0]


def engine_stopped(why: str) -> None:
    """Wait until this rank's commlayer engine has stopped (it noticed ``why``: a peer that
    shut down or died); a collective submitted afterwards must fail at its submission."""
    from waiting import wait_until

    from commlayer.core import runtime

    engine = runtime.engine()
    wait_until(lambda: not engine.running, WAIT_S, f"rank {RANK}: never noticed {why}", 0.01)


def allreduce_reporting(name: str) -> Any:
    """A blocking allreduce of ones(2) named ``name`` that reports ``submitted`` (with the name)
    between its submission and its wait: one without that record failed in its submission,
    at once, without waiting for anything."""
    import torch

    import commlayer as hvd

    handle = hvd.allreduce_async(torch.ones(2), name=name)
    report("submitted", name=name)
    return hvd.synchronize(handle)


def buckets_housed(opt: Any) -> dict[str, Any]:
    """Where DistributedOptimizer ``opt``'s planned buckets live: ``window_size`` (its
    shared-memory window's ranks; None: in process memory), ``across`` (a window per node whose
    slices cross between nodes), ``in_window`` (each bucket view's, in the window) and
    ``buckets``."""
    state = opt._commlayer
    window = state.window
    views = state.bucketer.view_of.values()
    return {
        "window_size": None if window is None else window.size,
        "across": window is not None and window.across is not None,
        "in_window": [window is not None and window.offset_of(v) is not None for v in views],
        "buckets": len(state.bucketer.buckets),
    }


def error_fields(exc: BaseException) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "classes": [cls.__name__ for cls in type(exc).__mro__],
        "message": str(exc),
    }


def _jsonable(value: Any) -> Any:
    """Tensors as nested lists, JSON values as they are, anything else as its repr."""
    if hasattr(value, "tolist"):
        return value.tolist()
    try:
        json.dumps(value)
    except TypeError:
        return repr(value)
    return value


def attempt(event: str, operation: Callable[[], Any], **fields: Any) -> bool:
    """Run ``operation``; report its result or its error under ``event``. True if it raised."""
    started = time.monotonic()
    try:
        result = operation()
    except Exception as exc:  # noqa: BLE001 - reporting it is the point
        report(event, elapsed_s=time.monotonic() - started, **fields, **error_fields(exc))
        return True
    report(
        event, elapsed_s=time.monotonic() - started, error=None, result=_jsonable(result), **fields
    )
    return False
