"""Operations some ranks never submit: a warning, then StallError on every rank, and commlayer
stops there (a stall ends the job: its later collectives fail at once with the StallError).

``lonely``: every rank r submits allreduce 'lonely.<r>' that no other rank submits. ``barrier``:
rank 0 submits allreduce 'lonely' while the others wait in barrier(), which rank 0 never calls.
Both operations stall in either mode; whichever is failed first stops every engine, and the
other then fails with its StallError. Then every rank tries an allreduce and a barrier, catches
their errors, and shuts down: the job exits 0 (an uncaught StallError would end it non-zero).
Run with COMMLAYER_STALL_CHECK_TIME_SECONDS=1 and COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS=2.
"""

from __future__ import annotations

import logging
import sys

import _worker
import torch

import commlayer as hvd


class _Warnings(logging.Handler):
    """Report each stall warning with its time, to check it comes before the StallError."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            _worker.report("warning", message=record.getMessage())


_worker.start()
mode = sys.argv[1]
hvd.init()
logging.getLogger("commlayer").addHandler(_Warnings())
rank = hvd.rank()
_worker.report("start")
if mode == "lonely":
    _worker.attempt("stalled", lambda: hvd.allreduce(torch.ones(2), name=f"lonely.{rank}"))
elif rank == 0:
    _worker.attempt("stalled", lambda: hvd.allreduce(torch.ones(2), name="lonely"))
else:
    _worker.attempt("stalled", hvd.barrier)
_worker.attempt("after", lambda: _worker.allreduce_reporting("after"))
_worker.attempt("barrier_after", hvd.barrier)
hvd.shutdown()
_worker.report("done")
