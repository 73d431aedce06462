"""Hangs on purpose (no MPI, starts at once): checks that the harness ends and reports a hang."""

from __future__ import annotations

import threading
import time

import _worker

_worker.start()
_worker.report("hanging")
threading.Thread(target=time.sleep, args=(600,), name="sleeper", daemon=True).start()
time.sleep(600)
