"""Keep PyTorch's DistributedDataParallel and let commlayer compress its gradients: the DDP
communication hook.

    torchrun --standalone --nproc_per_node 2 examples/ddp_hook.py --compression fp16
    commlayerrun -np 2 python examples/ddp_hook.py --compression topk:ratio=0.1

``model.register_comm_hook(ddp.CommState(compression=...), ddp.hook)``: DDP hands each bucket of
gradients to the hook, which averages it over the process group's own collectives (gloo here,
NCCL on GPUs) with the compressor applied; no ``commlayer.init()`` is needed. Under torchrun the
process group comes from torchrun's variables; under commlayerrun/mpiexec this script uses
commlayer only to agree on an address for it.

Each rank trains on batches of its own; rank 0 prints the loss on a fixed test batch before and
after, and whether every rank ended with the same weights, as averaged gradients make them.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from commlayer.integrations import ddp


def start_process_group() -> None:
    """gloo over torchrun's variables, or, under an MPI launcher, at an address rank 0 picks."""
    if "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        return
    import commlayer

    commlayer.init()
    address = None
    if commlayer.rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = (socket.gethostname(), s.getsockname()[1])
    host, port = commlayer.broadcast_object(address, root_rank=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=commlayer.rank(),
        world_size=commlayer.size(),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="fp16", help="fp16, topk:ratio=0.01, ...")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    start_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # DDP also broadcasts rank 0's weights when it wraps the model
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DDP(net)
    state = ddp.CommState(process_group=None, compression=args.compression)
    model.register_comm_hook(state, ddp.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # the target: the first feature; a fixed test batch, the same on every rank, scores it
    test = torch.randn(256, 32, generator=torch.Generator().manual_seed(1234))

    def test_loss() -> float:
        with torch.no_grad():
            return float(F.mse_loss(net(test), test[:, :1]))

    first = test_loss()
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for _ in range(args.steps):
        x = torch.randn(16, 32, generator=data)
        optimizer.zero_grad()
        F.mse_loss(model(x), x[:, :1]).backward()  # the hook reduces each bucket, compressed
        optimizer.step()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {rank} of {size}: {args.compression} hook, parameter checksum {checksum:.10f}",
          flush=True)  # fmt: skip
    checksums: list[float] = [0.0] * size
    dist.all_gather_object(checksums, checksum)
    if rank == 0:
        agree = "the same weights on every rank" if len(set(checksums)) == 1 else "DIFFERENT"
        print(f"{args.compression} hook, {args.steps} steps: test loss {first:.4f} -> "
              f"{test_loss():.4f}; {size} ranks, {agree}", flush=True)  # fmt: skip
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
