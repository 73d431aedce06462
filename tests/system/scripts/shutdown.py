"""Shutdown: ``all`` ranks shut down together, collectives fail clearly afterwards, init() starts
again (as in Horovod) and shuts down again; ``one`` rank (0) shuts down and exits while the
others go on: once their engine has stopped (it noticed rank 0's goodbye) their next
collective fails with ShutdownError naming rank 0, in its submission; ``reinit_alone``: every
rank shuts down, one rank (argv[2]) alone calls init() again (COMMLAYER_INIT_TIMEOUT_SECONDS
short) and must get an error naming it, not hang."""

from __future__ import annotations

import sys

import _worker
import torch

import commlayer as hvd

_worker.start()
mode = sys.argv[1]
hvd.init()
rank = hvd.rank()
_worker.attempt("before", lambda: hvd.allreduce(torch.ones(2), name="t", op=hvd.Sum))

if mode == "all":
    hvd.shutdown()
    _worker.report("initialized", value=hvd.is_initialized())
    _worker.attempt("allreduce", lambda: hvd.allreduce(torch.ones(2), name="t"))
    _worker.attempt("allreduce_async", lambda: hvd.allreduce_async(torch.ones(2), name="t"))
    _worker.attempt("barrier", hvd.barrier)
    _worker.attempt("rank", hvd.rank)
    _worker.attempt("shutdown_again", hvd.shutdown)
    _worker.attempt("init_again", hvd.init)
    _worker.attempt("rank_again", lambda: [hvd.rank(), hvd.size()])
    # Same name as before the restart (the new engine's cache is empty), and a new one.
    _worker.attempt("same_name", lambda: hvd.allreduce(torch.ones(2), name="t", op=hvd.Sum))
    _worker.attempt("new_name", lambda: hvd.allreduce(torch.ones(3), name="u", op=hvd.Sum))
    _worker.attempt("barrier_again", hvd.barrier)
    _worker.attempt("final_shutdown", hvd.shutdown)
elif mode == "reinit_alone":
    hvd.shutdown()
    if rank == int(sys.argv[2]):
        _worker.attempt("init_alone", hvd.init)
        _worker.report("initialized", value=hvd.is_initialized())
elif rank == 0:
    hvd.shutdown()
    _worker.report("left")
    sys.exit(0)
else:
    # Rank 0's goodbye stops this rank's engine; a collective after that must fail at once.
    _worker.engine_stopped("rank 0's shutdown")
    _worker.attempt("allreduce", lambda: _worker.allreduce_reporting("t2"))
    hvd.shutdown()
_worker.report("done")
