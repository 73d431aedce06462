"""Hugging Face Accelerate training with commlayer's DDP communication hook.

    accelerate launch --multi_gpu --num_processes 2 integrations/accelerate/train.py
    torchrun --standalone --nproc_per_node 2 integrations/accelerate/train.py
    ... train.py --compression topk:ratio=0.1 --algorithm ring --compare-ddp

``Accelerator.prepare`` wraps the model in PyTorch's DistributedDataParallel, on CPUs as on
GPUs: ``--multi_gpu`` only makes ``accelerate launch`` start N processes through torchrun, and
on a machine without a GPU ``Accelerator(cpu=True)`` runs them over gloo (without it Accelerate
would not wrap the model there: this script stops with an error if it is not wrapped).
commlayer's hook goes on the prepared model,
``model.register_comm_hook(ddp.CommState(compression=...), ddp.hook)``; everything else is
Accelerate's loop as usual. ``--algorithm auto`` averages each bucket with torch.distributed's
own collectives (no ``commlayer.init()``); a named one (``ring``, ``rabenseifner``...) starts
commlayer on the process group Accelerate made and reduces the buckets through its engine.
``--compare-ddp`` trains a second copy of the model on the same batches, prepared by Accelerate
without the hook, and prints how far apart the two end.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import commlayer
from commlayer.integrations import ddp


def say(line: str) -> None:
    """One line in one write: the ranks' (or Ray's log threads') lines do not cut into it."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)  # the same first weights for the hooked model and the reference
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def checksum(model: torch.nn.Module) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.mse_loss(model(x), y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="fp16", help="none, fp16, topk:ratio=0.01, ...")
    parser.add_argument("--algorithm", default="auto", help="auto, or ring, rabenseifner, ...")
    parser.add_argument("--steps", type=int, default=20, help="batches a rank trains on")
    parser.add_argument("--compare-ddp", action="store_true", help="also train without the hook")
    args = parser.parse_args()

    # Starts torch.distributed from the launcher's variables. cpu=True where there is no GPU:
    # without it Accelerate leaves the model unwrapped there, each rank training alone.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if args.algorithm != "auto":  # commlayer's engine, on the process group Accelerate made
        commlayer.init(allreduce_algorithm=args.algorithm)
    rank, size = accelerator.process_index, accelerator.num_processes

    # y = x . w + noise; the prepared loader gives each rank its own share of the batches
    data = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * size * 16, 32, generator=data)
    w = torch.randn(32, 1, generator=data) / 32**0.5
    y = x @ w + 0.1 * torch.randn(len(x), 1, generator=data)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)

    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise SystemExit(
            f"rank {rank}: Accelerate did not wrap the model in DistributedDataParallel "
            f"({accelerator.distributed_type}, {size} process(es)): start 2 or more processes "
            "with `accelerate launch --multi_gpu --num_processes N` or torchrun"
        )
    state = ddp.CommState(compression=args.compression, algorithm=args.algorithm)
    model.register_comm_hook(state, ddp.hook)  # DDP hands each gradient bucket to commlayer
    pairs = [(model, optimizer)]
    if args.compare_ddp:  # the same model, prepared by Accelerate without the hook
        plain = make_net()
        pairs.append(accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.05)))

    before = evaluate(model, x, y)
    steps = 0
    for inputs, targets in loader:
        for net, opt in pairs:
            opt.zero_grad()
            loss = F.mse_loss(net(inputs), targets)
            accelerator.backward(loss)  # the hook averages the gradients over the ranks
            opt.step()
        steps += 1

    if accelerator.is_main_process:
        say(f"{size} ranks, {steps} steps each: loss on all the data {before:.4f} -> "
              f"{evaluate(model, x, y):.4f}")  # fmt: skip
    through = f"{state.iteration} steps through the hook"
    if commlayer.is_initialized():
        through += f", commlayer operations {int(commlayer.communication_stats()['operations'])}"
    say(f"rank {rank} of {size}: {args.compression} hook ({args.algorithm}), {through}, "
          f"parameter checksum {checksum(model):.10f}")  # fmt: skip
    if args.compare_ddp:
        gap = max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), pairs[1][0].parameters(), strict=True)
        )
        say(f"rank {rank} of {size}: largest difference from plain DDP {gap:.3e}")
    if commlayer.is_initialized():
        commlayer.shutdown()
    accelerator.end_training()


if __name__ == "__main__":
    main()
