"""One rank of tests/gpu/test_stream_order_cuda.py (under mpiexec: CUDA tensors staged through
the host; under torchrun with COMMLAYER_NCCL=1: the direct path). DistributedOptimizer with
fp16 compression on a CUDA parameter, trained on the default stream and on a stream of its own:
the reduced gradient is written back on the engine's side ~0.1 s late (slow_cast.py), and the
step must still apply it. Prints ORDER OK, or which case failed."""

from __future__ import annotations

import sys

import torch
from slow_cast import SlowZeroingFP16, fp16_exact

import commlayer as cl
from commlayer.core import device, runtime


def main() -> None:
    cl.init()
    torch.cuda.set_device(cl.local_rank() % torch.cuda.device_count())
    here = torch.device("cuda", torch.cuda.current_device())
    route = device.path(runtime.engine().backend(0), here, torch.float32)
    grad = fp16_exact(4096)
    failed = []
    for case in ("default", "side"):
        stream = torch.cuda.current_stream() if case == "default" else torch.cuda.Stream()
        with torch.cuda.stream(stream):
            p = torch.nn.Parameter(torch.zeros(4096, device=here))
            opt = cl.DistributedOptimizer(
                torch.optim.SGD([p], lr=1.0),
                named_parameters=[(f"order.{case}", p)],
                compression=SlowZeroingFP16(),
            )
            (p * grad.to(here)).sum().backward()  # every rank's gradient: grad
            opt.step()
            after = p.detach().clone()  # on this stream, after the step
        if not torch.equal(after.cpu(), -grad):
            failed.append(f"{case} stream: {after[:4].tolist()}, expected {(-grad[:4]).tolist()}")
    where = "staged" if route is None else f"direct {route}"
    print(f"rank {cl.rank()} over {runtime.backend_name()} ({where}): "
          f"{'FAILED ' + '; '.join(failed) if failed else 'ORDER OK'}", flush=True)  # fmt: skip
    cl.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
