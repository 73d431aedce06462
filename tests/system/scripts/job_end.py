"""Faults end the whole job: a stall, or an uncaught commlayer error on one rank, while a peer is
blocked where commlayer cannot reach it (in user code).

``stall``: every rank but 1 allreduces 'step.grad', which rank 1 never submits; run with
COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS short (the default is 10 minutes). Rank 1 waits in user
code until its engine has stopped (the stall stops commlayer on every rank), reports the error
its next collective raises (``later``: at once, in its submission), then sleeps for ever. The
other ranks report their StallError (``stalled``), wait for rank 1's report (so that the
records do not race the end of the job), then leave it uncaught: that must end the job.

``raise <peer>``: rank 1 raises an uncaught CommlayerError once rank 0 is blocked in user code,
for ever (``sleep``: time.sleep; ``gil``: a C call that holds Python's GIL, so that rank 0's
engine thread cannot answer either) and rank 2, when there is one, waits in a collective rank 1
never joins (its ``blocked`` record: the error it got, if it reports before the job ends).

Nothing here ends the job by itself: without commlayer ending it, the harness reports a hang.
"""

from __future__ import annotations

import ctypes
import sys
import time

import _worker
import torch

import commlayer as hvd

FOREVER_S = 3600


def hold_the_gil(seconds: int) -> None:
    """libc's sleep() called without releasing the GIL (ctypes.PyDLL keeps it): a rank stuck in
    a long C call, as in pickling a large object; no other thread of the process runs."""
    ctypes.PyDLL(None).sleep(seconds)


_worker.start()
mode = sys.argv[1]
hvd.init()
rank = hvd.rank()
hvd.allreduce(torch.ones(2), name="warmup")
_worker.report("ready")

if mode == "stall":
    if rank == 1:
        _worker.engine_stopped("the stall")  # in user code: not in any collective
        _worker.attempt("later", lambda: _worker.allreduce_reporting("later"))
        time.sleep(FOREVER_S)
    try:
        hvd.allreduce(torch.ones(2), name="step.grad")
    except hvd.StallError as exc:
        _worker.report("stalled", **_worker.error_fields(exc))
        _worker.wait_for("later", 1)
        raise
elif mode == "raise":
    peer = sys.argv[2]
    if rank == 1:
        _worker.wait_for("blocking", 0)
        if hvd.size() > 2:
            _worker.wait_for("submitted", 2, name="blocked")
        _worker.report("failing")
        raise hvd.CommlayerError("rank 1 fails on purpose")
    if rank == 0:
        _worker.report("blocking")
        if peer == "gil":
            hold_the_gil(FOREVER_S)
        else:
            time.sleep(FOREVER_S)
    _worker.attempt("blocked", lambda: _worker.allreduce_reporting("blocked"))
    time.sleep(FOREVER_S)
_worker.report("done")  # never: every path above ends in an error or for ever
