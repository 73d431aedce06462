"""A few named collectives with COMMLAYER_TIMELINE set. ``explicit``: shutdown() closes the
trace; ``atexit``: the script just ends and commlayer's exit hook must close it."""

from __future__ import annotations

import sys

import _worker
import torch

import commlayer as hvd

_worker.start()
hvd.init()
for _ in range(3):
    hvd.allreduce(torch.ones(4), name="grad.a")
    handles = [hvd.allreduce_async(torch.ones(8), name=f"grad.b{i}") for i in range(3)]
    for handle in handles:
        hvd.synchronize(handle)
hvd.allgather(torch.ones(2), name="gathered")
hvd.broadcast(torch.ones(2), root_rank=0, name="broadcasted")
_worker.report("done")
if sys.argv[1] == "explicit":
    hvd.shutdown()
