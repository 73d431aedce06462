"""DistributedOptimizer with its buckets in the shared-memory window (COMMLAYER_WINDOW_BUCKETS=1)
when a rank fails in the middle of a step (test_window_bucket_faults.py).

``how``: ``sigkill``: rank 1 SIGKILLs itself inside an in-window allreduce, after it arrived
(its first flag raised, so the others reduce their slices and write them into its segment) and
before it reduced its own slice: the others wait for its second flag, the bucket half reduced.
``stall``: rank 1's training thread stops inside backward (a gradient hook) before its first
layer's gradients exist, so the bucket holding them is never submitted there while the others
have submitted it; its engine keeps running.

Every rank reports ``housed`` (its buckets are in the window) after two steps, then trains a
third step: a survivor reports the step's error (``failed``) with a checksum of its parameters
before and after it (a failed step must not update them), if its launcher has not ended it
first (test_window_bucket_faults.py).
"""

from __future__ import annotations

import os
import signal
import sys

import _worker
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as hvd
from commlayer.backends import shm

_worker.start()
how = sys.argv[1]
hvd.init()
rank = hvd.rank()


def all_reported(event: str, **fields: object) -> None:
    """Every rank has reported ``event`` (with ``fields``): the ranks start each phase
    together, so that a stall setting of seconds measures the stall made on purpose, not a slow
    start on a loaded machine (seen: 3 s between ranks building the model under torchrun)."""
    for r in range(hvd.size()):
        _worker.wait_for(event, r, **fields)


_worker.report("ready")
all_reported("ready")
FAIL_AT = 3  # the step (counted from 1) in which rank 1 fails

torch.manual_seed(0)
model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(128, 128), nn.Tanh())])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
_worker.report("built")
all_reported("built")
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
step_now = 0

if rank == 1 and how == "sigkill":
    reduce = shm._InWindow._reduce

    def reduce_or_die(self: shm._InWindow) -> None:
        if step_now == FAIL_AT:
            _worker.report("failing")
            os.kill(os.getpid(), signal.SIGKILL)
        reduce(self)

    shm._InWindow._reduce = reduce_or_die  # type: ignore[method-assign]

if rank == 1 and how == "stall":

    def stall(grad: torch.Tensor) -> torch.Tensor:
        if step_now == FAIL_AT:
            _worker.report("failing")
            _worker.engine_stopped("the stall")  # the engine's StallError ends the wait
        return grad

    model[0].weight.register_hook(stall)


def checksum() -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def train_step() -> None:
    global step_now
    step_now += 1
    g = torch.Generator().manual_seed(100 * step_now + rank)
    x, y = torch.randn(8, 128, generator=g), torch.randn(8, 128, generator=g)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


for done in range(FAIL_AT - 1):
    _worker.report("stepping", step=done + 1)
    all_reported("stepping", step=done + 1)
    train_step()
where = _worker.buckets_housed(opt)
housed = where["window_size"] is not None and all(where["in_window"])
_worker.report("housed", housed=housed, buckets=where["buckets"])
all_reported("housed")
before = checksum()
_worker.attempt("failed", train_step, before=before)
_worker.report("after", checksum=checksum())
# Exit only once every other rank still running has reported: a rank that exits after a failed
# step skips MPI_Finalize, and mpiexec then ends the others, maybe before they reported (the
# stall, where every rank fails; after a SIGKILL the launchers end the job anyway).
for r in range(hvd.size()):
    if r != rank and not (r == 1 and how == "sigkill"):
        _worker.wait_for("after", r)
hvd.shutdown()
_worker.report("done")
