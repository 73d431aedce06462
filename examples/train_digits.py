"""Data-parallel training of a small CNN on scikit-learn's handwritten digits with commlayer.

    commlayerrun -np 2 python examples/train_digits.py [--epochs 15] [--batch-size 32]

Each rank trains on its shard of every epoch's shuffled training set; DistributedOptimizer
averages gradients while backward runs. Rank 0 shows a progress bar, the loss and test accuracy
per epoch, and at the end how much went over the wire and how much of it backward hid.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import commlayer as cl


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 1x8x8 images (~37 K parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits scaled to [0, 1], 80/20 train/test split, identical on every rank."""
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.tensor(np.random.default_rng(seed).permutation(len(labels)))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy over the whole test set; each rank scores its shard, then one allreduce."""
    shard = slice(cl.rank(), None, cl.size())
    model.eval()
    with torch.no_grad():
        correct = (model(images[shard]).argmax(1) == labels[shard]).sum()
    model.train()
    counts = torch.tensor([float(correct), float(labels[shard].numel())])
    total = cl.allreduce(counts, op=cl.Sum, name="eval.counts")
    return float(total[0] / total[1])


def train(args: argparse.Namespace) -> float:
    cl.init()
    rank, size = cl.rank(), cl.size()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_split(args.seed)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    cl.broadcast_parameters(model.state_dict(), root_rank=0)
    cl.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = cl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    if rank == 0:
        print(
            f"commlayer demo: {size} ranks, {len(y_train)} training and {len(y_test)} test "
            f"images, {sum(p.numel() for p in model.parameters())} parameters"
        )
    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::size]
        batches = range(0, len(mine) - args.batch_size + 1, args.batch_size)
        bar = tqdm(batches, desc=f"epoch {epoch:2d}", disable=rank != 0, leave=False, ncols=80)
        loss_sum = torch.zeros(1)
        for begin in bar:
            index = mine[begin : begin + args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[index]), y_train[index])
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        mean_loss = cl.allreduce(loss_sum / max(len(batches), 1), name="epoch.loss").item()
        accuracy = evaluate(model, x_test, y_test)
        if rank == 0:
            print(f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy {accuracy:.2%}")
    elapsed = time.perf_counter() - start
    report(optimizer, elapsed, accuracy)
    cl.shutdown()
    return accuracy


def report(optimizer: torch.optim.Optimizer, elapsed_s: float, accuracy: float) -> None:
    """Rank 0 prints the communication summary (rank 0's own counters)."""
    stats = cl.communication_stats()
    if cl.rank() != 0:
        return
    waited = optimizer.synchronize_wait_s  # type: ignore[attr-defined]
    comm = stats["collective_s"]
    hidden = max(0.0, 1.0 - waited / comm) if comm > 0 else 0.0
    print(
        f"\ncommunication summary (rank 0): {stats['operations']:.0f} collectives in "
        f"{stats['cycles']:.0f} negotiation cycles, {stats['payload_bytes'] / 1e6:.1f} MB "
        f"reduced, ~{stats['wire_bytes'] / 1e6:.1f} MB sent, {comm:.2f} s in communication, "
        f"{waited:.2f} s of it waited for in step(): {hidden:.0%} overlapped with backward; "
        f"training took {elapsed_s:.1f} s"
    )
    print(f"final test accuracy {accuracy:.2%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-accuracy", type=float, default=0.95, help="exit non-zero below this test accuracy"
    )
    args = parser.parse_args()
    accuracy = train(args)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
