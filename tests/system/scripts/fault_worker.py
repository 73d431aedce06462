"""One job on the namespace cluster (2 hosts x 2 ranks) that a fault hits, started by
tests/system/test_cluster_faults.py through ``commlayerrun -H node1:2,node2:2``.

``mode``:
- ``sigkill``: DistributedOptimizer training steps; rank 3 (on node2) SIGKILLs itself in the
  middle of a step, after its backward started the gradient allreduces.
- ``train``: the same training steps until an error (the test takes node2's link down).
- ``loop``: 4 MiB allreduces in a loop until an error (the test takes node2's link down).
- ``exact``: 16 MiB allreduces checked exact, timed, before and after the test sets the loss
  on node2's link (it creates ``$SYSTEST_OUT_DIR/go`` once it has).

Both training modes report ``housed`` after 3 steps: where the optimizer's planned buckets live
(``_worker.buckets_housed``: under COMMLAYER_WINDOW_BUCKETS a window per host whose slices
cross between hosts; ``window_size`` None for buckets in process memory).

Every rank reports ``ready``, then ``step`` now and then (``time``: the wall clock, which is
one clock for every host of the cluster), and ``error`` with the exception when one reaches it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path

import _worker
import torch
from torch import nn
from waiting import wait_until

import commlayer as cl

_worker.start()
mode = sys.argv[1]
cl.init()
rank = cl.rank()
_worker.report("ready", hostname=socket.gethostname(), pid=os.getpid())


def train(die: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    cl.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(32, 256)
    for step in range(100_000):
        opt.zero_grad()
        loss = model(data).square().mean()
        if die and rank == 3 and step == 20:
            # mid-step: the last layer's gradient is in flight when this rank dies
            model[2].weight.register_hook(lambda g: _die())
        loss.backward()
        opt.step()
        if step == 3:
            _worker.report("housed", **_worker.buckets_housed(opt))
        if step % 10 == 0:
            _worker.report("step", step=step)


def _die() -> None:
    _worker.report("failing")
    os.kill(os.getpid(), signal.SIGKILL)


def loop() -> None:
    data = torch.ones(1 << 20)
    for step in range(1_000_000):
        cl.allreduce(data, name="loop", op=cl.Sum)
        if step % 20 == 0:
            _worker.report("step", step=step)


def exact() -> None:
    numel = 4 << 20
    mine = (torch.arange(numel, dtype=torch.int64) * (rank + 1) % 1000).float()
    want = sum((torch.arange(numel, dtype=torch.int64) * (q + 1) % 1000).float() for q in range(4))
    for phase in ("before", "after"):
        if phase == "after":
            go = Path(os.environ["SYSTEST_OUT_DIR"]) / "go"
            wait_until(go.exists, _worker.WAIT_S, f"rank {rank}: the test never wrote {go}", 0.05)
            cl.barrier()
        times, same = [], True
        for i in range(5):
            started = time.perf_counter()
            got = cl.allreduce(mine, name=f"{phase}.{i}", op=cl.Sum)
            times.append(time.perf_counter() - started)
            same = same and torch.equal(got, want)
        _worker.report(phase, exact=same, seconds=times)


try:
    {"sigkill": partial(train, True), "train": partial(train, False), "loop": loop, "exact": exact}[
        mode
    ]()
except Exception as exc:  # noqa: BLE001 - reporting it is the point
    _worker.report("error", **_worker.error_fields(exc))
    raise
cl.shutdown()
_worker.report("done")
