"""Ranks submit one name with different shape/dtype/op/root/kind; each case must fail on every
rank with TensorMismatchError, and a normal allreduce must work right after it."""

from __future__ import annotations

import _worker
import torch

import commlayer as hvd

_worker.start()
hvd.init()
rank, size = hvd.rank(), hvd.size()
ones = torch.ones


def fused_batch() -> object:
    """Good tensors negotiated in the same cycle as a bad one must still complete correctly."""
    good = [hvd.allreduce_async(ones(3) * (i + 1), name=f"good.{i}", op=hvd.Sum) for i in range(4)]
    bad = hvd.allreduce_async(ones(3 + rank), name="t.batch", op=hvd.Sum)
    _worker.report("batch_good", result=[hvd.synchronize(h).tolist() for h in good])
    return hvd.synchronize(bad)


def steady_then_reshaped() -> object:
    """A name first seen with one shape on every rank (so it is cached), then changed on one."""
    for _ in range(3):
        hvd.allreduce(ones(4), name="t.cached")
    return hvd.allreduce(ones(4 if rank == 0 else 5), name="t.cached")


CASES = {
    "shape": lambda: hvd.allreduce(ones(rank + 1), name="t.shape"),
    "dtype": lambda: hvd.allreduce(
        ones(2, dtype=torch.float32 if rank == 0 else torch.float64), name="t.dtype"
    ),
    "op": lambda: hvd.allreduce(ones(2), name="t.op", op=hvd.Sum if rank == 0 else hvd.Max),
    "root": lambda: hvd.broadcast(ones(2), root_rank=0 if rank == 0 else 1, name="t.root"),
    "kind": lambda: (
        hvd.allreduce(ones(2), name="t.kind")
        if rank == 0
        else hvd.allgather(ones(2), name="t.kind")
    ),
    "allgather_trailing": lambda: hvd.allgather(ones(2, rank + 1), name="t.gather"),
    "batch": fused_batch,
    "cached": steady_then_reshaped,
}

for case, operation in CASES.items():
    _worker.attempt("mismatch", operation, case=case)
    after = hvd.allreduce(ones(2), name=f"after.{case}", op=hvd.Sum)
    _worker.report("after", case=case, result=after.tolist())
# The name that failed is usable again with agreeing shapes.
_worker.attempt("reuse", lambda: hvd.allreduce(ones(3), name="t.shape", op=hvd.Sum))
hvd.shutdown()
_worker.report("done")
