"""Allreduces through the engine under the COMMLAYER_ALLREDUCE_ALGORITHM the job sets: fused
small tensors, a large single tensor (past the shm chunk), a grouped call; reports what the
engine picked and whether every result was right."""

from __future__ import annotations

import _worker
import torch

import commlayer as cl
from commlayer.core import runtime

_worker.start()
cl.init()
n, r = cl.size(), cl.rank()
expected = float(sum(range(1, n + 1)))
ok = []
for _ in range(3):
    small = [torch.full((k + 1,), float(r + 1)) for k in range(20)]
    handles = [cl.allreduce_async_(t, op=cl.Sum, name=f"small.{k}") for k, t in enumerate(small)]
    results = [cl.synchronize(h) for h in handles]
    ok.append(all(torch.equal(t, torch.full_like(t, expected)) for t in results))
    big = torch.full(((5 << 20) + 3,), float(r + 1), dtype=torch.float64)  # 40 MiB
    ok.append(torch.equal(cl.allreduce(big, op=cl.Sum, name="big"), torch.full_like(big, expected)))
    group = cl.grouped_allreduce([torch.full((3,), float(r + 1))] * 4, op=cl.Average, name="g")
    ok.append(all(torch.allclose(t, torch.full((3,), expected / n)) for t in group))
engine = runtime.engine()
_worker.report(
    "done",
    configured=engine.config.allreduce_algorithm,
    picked_big=engine._allreduce.choose(engine._global.backend, (5 << 20) + 3, 8),
    all_right=all(ok),
)
cl.shutdown()
