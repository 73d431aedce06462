"""A training script as a torchrun user writes it: ``commlayer.init()``, collectives, a
``DistributedOptimizer`` step. Reports what the test checks.

``train``: size and ranks as torchrun gave them, exact allreduce/allgather/broadcast, a few
optimizer steps (parameters must end bitwise equal on every rank), then shutdown() and init()
twice more, an allreduce each time (``restarted``); ``init``: only init(),
reporting its error (a bad backend choice must fail clearly); ``mismatch``: rank 1 allreduces
another shape under the same name (every rank must get the error naming it); ``restart``:
rank 1 exits in torchrun's first attempt, the job (``--max-restarts 1``) must then run again.
"""

from __future__ import annotations

import os
import sys

import _worker
import torch

import commlayer as hvd

_worker.start()
mode = sys.argv[1]
if _worker.attempt("init", hvd.init) or mode == "init":
    sys.exit(0)
rank, size = hvd.rank(), hvd.size()
_worker.report(
    "ready",
    size=size,
    torchrun_world_size=int(os.environ["WORLD_SIZE"]),
    local_rank=hvd.local_rank(),
    gloo_enabled=hvd.gloo_enabled(),
    mpi_enabled=hvd.mpi_enabled(),
)
if mode == "train":
    total = hvd.allreduce(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="sum")
    rows = hvd.allgather(torch.full((rank + 1, 3), float(rank)), name="rows")
    root = hvd.broadcast(torch.full((4,), float(rank)), root_rank=size - 1, name="root")
    torch.manual_seed(rank)  # different starting weights: broadcast_parameters must fix them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(5):
        x = torch.randn(32, 8, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="params")
    _worker.report(
        "train",
        exact_sum=bool(torch.equal(total, torch.full((1000,), float(size * (size + 1) // 2)))),
        rows=rows[:, 0].tolist(),
        root=root.tolist(),
        params_equal=bool(all(torch.equal(everyone[0], row) for row in everyone)),
        losses=losses,
    )
elif mode == "mismatch":
    shape = (3,) if rank == 1 else (2,)
    _worker.attempt("mismatch", lambda: hvd.allreduce(torch.ones(shape), name="mismatched"))
elif mode == "restart":  # under torchrun --max-restarts 1: rank 1 dies in the first attempt
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    total = hvd.allreduce(torch.full((4,), float(rank + 1)), op=hvd.Sum, name="before")
    _worker.report("attempt", attempt=attempt, sum=float(total[0]))
    if attempt == 0:
        if rank == 1:
            os._exit(3)
        _worker.attempt("lost", lambda: hvd.allreduce(torch.ones(4), name="lost"))
        sys.exit(1)
hvd.shutdown()
if mode == "train":  # init() again, twice: torch.distributed restarted by commlayer each time
    sums = []
    for _ in range(2):
        hvd.init()
        total = hvd.allreduce(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="again")
        sums.append(float(total[0]) if bool((total == total[0]).all()) else None)
        hvd.shutdown()
    _worker.report("restarted", sums=sums)
_worker.report("done")
