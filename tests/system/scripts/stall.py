"""Operations some ranks never submit: a warning, then StallError, then normal service.

``lonely``: every rank r submits allreduce 'lonely.<r>' that no other rank submits; each must
fail with StallError on its own rank. ``barrier``: rank 0 submits allreduce 'lonely' while the
others wait in barrier(), which rank 0 never calls, so both stall: rank 0's allreduce and the
others' barrier must each fail with StallError. Then every rank allreduces and calls barrier().
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
_worker.attempt("after", lambda: hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum))
_worker.attempt("barrier_after", hvd.barrier)
hvd.shutdown()
_worker.report("done")
