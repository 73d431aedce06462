"""Checkpoints in a data-parallel job: rank 0 alone writes them, every rank resumes from them.

    commlayerrun -np 2 python examples/checkpoint.py --dir ckpt --epochs 2
    commlayerrun -np 2 python examples/checkpoint.py --dir ckpt --epochs 4   # resumes at 2

Every rank holds the same weights after each step, so one copy is enough: rank 0 writes it
(several ranks writing one file corrupt it). On a restart rank 0 reads the file and the others
get its contents by broadcast (they may not even see rank 0's disk): the weights
(``broadcast_parameters``), the optimizer's state (``broadcast_optimizer_state``: momentum
buffers) and the epoch to go on from (``broadcast_object``). Under ``torchrun --max-restarts N``
this is how a job goes on after a rank died.

Each rank says the epoch it starts at; rank 0 says each epoch it saved, with the epoch's loss
(averaged over the ranks: it falls across both runs), and at the end whether every rank holds
the same weights.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import commlayer as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the checkpoint lives")
    parser.add_argument("--epochs", type=int, default=2, help="train until this epoch")
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    args = parser.parse_args()
    path = os.path.join(args.dir, "checkpoint.pt")

    hvd.init()
    torch.manual_seed(hvd.rank())  # different on each rank until the broadcasts below
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.5)

    start = 0
    if hvd.rank() == 0 and os.path.exists(path):
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["epoch"]
    # rank 0's weights, optimizer state and epoch on every rank: fresh or resumed alike
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    start = hvd.broadcast_object(start, root_rank=0)
    print(f"rank {hvd.rank()}: starting at epoch {start}", flush=True)

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(start, args.epochs):
        # each rank its own batches, drawn from the epoch: a resumed run sees those it would have
        data = torch.Generator().manual_seed(1000 * epoch + hvd.rank())
        total = torch.zeros(())
        for _ in range(args.steps_per_epoch):
            x = torch.randn(16, 10, generator=data)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            optimizer.step()
            total += loss.detach()
        mean = hvd.allreduce(total / args.steps_per_epoch, name="loss")  # over every rank
        if hvd.rank() == 0:  # one writer; write then rename, so a crash leaves the last good one
            os.makedirs(args.dir, exist_ok=True)
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
            }
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
            print(f"rank 0: saved epoch {epoch + 1} to {path} (loss {mean:.3f})", flush=True)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {hvd.rank()}: parameter checksum {checksum:.10f}", flush=True)
    same = len(set(hvd.allgather_object(checksum))) == 1
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, " + ("the same weights on every rank" if same else
              "DIFFERENT weights"), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
