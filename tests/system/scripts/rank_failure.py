"""Rank 1 fails while the others need it; the others must get an error or be ended, not hang.

``how``: ``raise`` (an uncaught exception: under mpiexec commlayer aborts the job at exit;
under torchrun the rank says goodbye, 3 s at most, and exits 1), ``exit1``/``exit0``
(``os._exit``: no atexit, no goodbye), ``sigkill`` (SIGKILL of itself). ``when``: ``blocked``
(rank 1 fails once rank 0 has submitted its allreduce and waits in it: rank 0's ``submitted``
record) or ``early`` (right after init). Rank 2, when there is one, is idle (not in a
collective) when rank 1 fails: it submits its allreduces only once its engine has noticed the
failure between collectives and stopped (``noticed``), and they must fail at their submission.
The survivors report their errors and exit 0, so only rank 1's fate sets the job's status.
"""

from __future__ import annotations

import os
import signal
import sys

import _worker
import torch

import commlayer as hvd

_worker.start()
how, when = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
hvd.allreduce(torch.ones(2), name="warmup")
# the MPICH shared-memory files this rank maps (test_launcher_shm.py: removed after a kill)
with open("/proc/self/maps", encoding="utf-8") as maps:
    shm = sorted({line.split()[-1] for line in maps if "/dev/shm/mpich_shm_" in line})
_worker.report("ready", shm=shm)

if rank == 1:
    # Its own pending operation, never matched: shutting down must not trip over it.
    hvd.allreduce_async(torch.ones(2), name="pending.1")
    if when == "blocked":
        _worker.wait_for("submitted", 0, name="blocked")
    _worker.report("failing")
    if how == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0 if how == "exit0" else 1)

if rank == 2:
    _worker.engine_stopped("rank 1's failure")
    _worker.report("noticed")
_worker.attempt("blocked", lambda: _worker.allreduce_reporting("blocked"))
_worker.attempt("later", lambda: _worker.allreduce_reporting("later"))
hvd.shutdown()
_worker.report("done")
