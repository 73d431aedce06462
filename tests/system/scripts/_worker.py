"""Shared by the worker scripts: result records, a watchdog and stack dumps on demand.

A worker calls ``start()`` first, then ``report(event, ...)`` for what the test checks. Records
are JSON lines in ``$SYSTEST_OUT_DIR/rank<R>.jsonl`` (opened per record, so a rank that dies
right after reporting loses nothing), echoed to stdout in one write so ranks do not interleave.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

# Hydra sets PMI_RANK, torchrun RANK; known before commlayer.init(), which some workers expect
# to fail.
RANK = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0")))


def start() -> None:
    """Dump every thread's stack on SIGUSR2 (the harness sends it to a hung job), and dump and
    exit on our own after $SYSTEST_WATCHDOG_S, so a hang ends even without the harness.
    Not SIGUSR1: hydra sends that to the survivors when a rank dies, and MPICH handles it."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    faulthandler.dump_traceback_later(float(os.environ.get("SYSTEST_WATCHDOG_S", "40")), exit=True)


def report(event: str, **fields: Any) -> None:
    record = {"rank": RANK, "event": event, "time": time.time(), **fields}
    line = json.dumps(record) + "\n"
    out_dir = os.environ.get("SYSTEST_OUT_DIR", ".")
    with open(os.path.join(out_dir, f"rank{RANK}.jsonl"), "a", encoding="utf-8") as out:
        out.write(line)
    os.write(sys.stdout.fileno(), line.encode())


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
