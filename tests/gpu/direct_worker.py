"""One rank of tests/gpu/test_direct_cuda.py (run under torchrun or mpiexec): every collective
and a DistributedOptimizer step on CUDA tensors through the direct path (device.py: NCCL over the
torch backend, or a CUDA-aware MPI), checked against the values computed on the CPU. No host
stand-in may be made, and an input produced on a busy side stream must be read only after its
producer finished (the engine waits on the event recorded on the caller's stream)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

import commlayer as cl
from commlayer.core import device, runtime


def main() -> None:
    cl.init()
    if os.environ.get("DIRECT_WORKER_CPU") == "1":  # the checks themselves, checked on the CPU
        device.DIRECT_CPU = device.Path("host", "worker-cpu")
        here = torch.device("cpu")
    else:
        torch.cuda.set_device(cl.local_rank() % torch.cuda.device_count())
        here = torch.device("cuda", torch.cuda.current_device())
    route = device.path(runtime.engine().backend(0), here, torch.float32)
    assert route is not None, f"CUDA tensors are staged over {runtime.backend_name()}"
    made: list[int] = []
    real = device._host_buffer
    device._host_buffer = lambda like: (made.append(like.numel()), real(like))[1]  # type: ignore[assignment]
    size, me = cl.size(), cl.rank()
    ranks_sum = size * (size - 1) // 2

    def ramp(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.arange(n, dtype=dtype) % 97

    # allreduce: a lone tensor, a fused group, a large one (8 MiB), Average, pre/postscale
    small = cl.allreduce((ramp(1000) + me).to(here), op=cl.Sum, name="d.small")
    group = cl.grouped_allreduce([(ramp(n) + me).to(here) for n in (7, 300, 1)], op=cl.Sum,
                                 name="d.group")  # fmt: skip
    large = cl.allreduce((ramp(1 << 21) + me).to(here), op=cl.Sum, name="d.large")
    avg = cl.allreduce((ramp(64) + me).to(here), name="d.avg")
    scaled = cl.allreduce((ramp(64) + me).to(here), op=cl.Sum, prescale_factor=2.0,
                          postscale_factor=0.25, name="d.scaled")  # fmt: skip
    ints = cl.allreduce((ramp(33, torch.int64) + me).to(here), op=cl.Max, name="d.ints")
    # an input produced on a busy side stream, submitted from that stream
    side = torch.cuda.Stream() if here.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        busy = torch.randn(2048 if side is not None else 64, 64, device=here)
        for _ in range(20):
            busy = torch.tanh(busy @ busy.T)
        produced = busy.sum().mul(0).add(me + 1).expand(4096).contiguous()
        late = cl.allreduce(produced, op=cl.Sum, name="d.produced")
    # the other collectives
    gathered = cl.allgather(torch.full((me + 1, 3), float(me), device=here), name="d.gather")
    bcast = cl.broadcast((ramp(10) + me).to(here), size - 1, name="d.bcast")
    sent = torch.arange(2 * size, dtype=torch.float32, device=here) + 100 * me
    rows, received = cl.alltoall(sent, splits=[2] * size, name="d.alltoall")
    scattered = cl.reducescatter((ramp(4 * size).view(2 * size, 2) + me).to(here), op=cl.Sum,
                                 name="d.rs")  # fmt: skip
    if here.type == "cuda":
        torch.cuda.synchronize()
    checks = {
        "small": torch.equal(small.cpu(), ramp(1000) * size + ranks_sum),
        "group": all(
            torch.equal(g.cpu(), ramp(n) * size + ranks_sum) for g, n in zip(group, (7, 300, 1))
        ),  # fmt: skip
        "large": torch.equal(large.cpu(), ramp(1 << 21) * size + ranks_sum),
        "avg": torch.allclose(avg.cpu(), (ramp(64) * size + ranks_sum) / size),
        "scaled": torch.allclose(scaled.cpu(), (ramp(64) * size + ranks_sum) * 0.5),
        "ints": torch.equal(ints.cpu(), ramp(33, torch.int64) + size - 1),
        "produced": torch.equal(late.cpu(), torch.full((4096,), float(size * (size + 1) // 2))),
        "gather": torch.equal(
            gathered.cpu(), torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
        ),  # fmt: skip
        "bcast": torch.equal(bcast.cpu(), ramp(10) + size - 1),
        "alltoall": torch.equal(
            rows.cpu(),
            torch.cat(
                [
                    torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * q
                    for q in range(size)
                ]
            ),
        )
        and received.tolist() == [2] * size,  # fmt: skip
        "reducescatter": torch.equal(
            scattered.cpu(),
            (ramp(4 * size).view(2 * size, 2) * size + ranks_sum)[2 * me : 2 * me + 2],
        ),  # fmt: skip
        "on device": all(
            t.device == here for t in (small, large, gathered, bcast, rows, scattered)
        ),
        "no host stand-ins": not made,
    }
    # DistributedOptimizer: the CUDA model ends where the same model on the CPU does
    params = []
    for i, where in enumerate((torch.device("cpu"), here)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 3)).to(where)  # fmt: skip
        opt = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[(f"m{i}.{n}", p) for n, p in model.named_parameters()],
        )
        g = torch.Generator().manual_seed(100 + me)
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.to(where)), y.to(where)).backward()
            opt.step()
        params.append([p.detach().cpu() for p in model.parameters()])
    checks["optimizer"] = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*params))
    failed = [name for name, ok in checks.items() if not ok]
    print(f"rank {me} of {size} over {runtime.backend_name()} {route}: "
          f"{'FAILED ' + ', '.join(failed) if failed else 'DIRECT OK'}", flush=True)  # fmt: skip
    cl.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
