"""Rank 1 fails while the others need it; the others must get an error, not hang.

``how``: ``raise`` (an uncaught exception: Python exits 1 after atexit, where commlayer shuts
down and tells the others), ``exit1``/``exit0`` (``os._exit``: no atexit, no goodbye),
``sigkill`` (SIGKILL of itself). ``when``: ``blocked`` (the others are already waiting in an
allreduce) or ``early`` (right after init). Rank 2, when there is one, is idle (sleeping, not
in a collective) when rank 1 fails and submits an allreduce only afterwards: it must fail too.
The survivors report their errors and exit 0, so only rank 1's fate sets the job's status.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import _worker
import torch

import commlayer as hvd

_worker.start()
how, when = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
hvd.allreduce(torch.ones(2), name="warmup")
_worker.report("ready")

if rank == 1:
    # Its own pending operation, never matched: shutting down must not trip over it.
    hvd.allreduce_async(torch.ones(2), name="pending.1")
    if when == "blocked":
        time.sleep(0.5)  # the others are in their allreduce by now
    _worker.report("failing")
    if how == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0 if how == "exit0" else 1)

if rank == 2:
    time.sleep(2.5)  # idle while rank 1 fails: the engine notices between collectives
_worker.attempt("blocked", lambda: hvd.allreduce(torch.ones(2), name="blocked"))
_worker.attempt("later", lambda: hvd.allreduce(torch.ones(2), name="later"))
hvd.shutdown()
_worker.report("done")
