"""Data-parallel training of a small CNN on scikit-learn's handwritten digits with commlayer.

    commlayerrun -np 2 python examples/train_digits.py --epochs 3   # the demo runs 15

Each rank trains on its shard of every epoch's shuffled training set; DistributedOptimizer
averages gradients while backward runs. Rank 0 shows a progress bar, the loss and test accuracy
per epoch, and at the end how much went over the wire and where the time in communication went
(``Ledger``): hidden behind backward, waited for in ``step()``, or in the other blocking calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import commlayer as cl


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 1x8x8 images: ~37 K parameters as
    (16, 32) channels and 64 hidden units (tests/parallel/test_compression_convergence.py), ~284 K
    as the demo's (32, 64) and 256 (``DEMO_MODEL``)."""

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels[0], 3, padding=1)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.fc1 = nn.Linear(channels[1] * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

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


# The demo's model: its gradients (1.14 MB) fill two of DistributedOptimizer's 1 MiB buckets, so
# the linear layers' bucket is reduced while backward still runs through the convolutions, and
# part of the communication hides behind backward. The 37 K-parameter default (148 KB of
# gradients) fills one bucket, sent when backward ends: nothing is left to hide it behind.
DEMO_MODEL = {"channels": (32, 64), "hidden": 256}


class Ledger:
    """Splits this rank's time in collectives (``communication_stats()["collective_now_s"]``,
    the engine's time inside collectives, the running one's elapsed part included) by what the
    training thread was doing meanwhile, so that the parts add up:

    1. ``seconds["step"]``: collective time that passed while ``step()`` ran (it waits for the
       gradients still in flight); ``seconds["blocking"]``: while a blocking call of this
       script ran (broadcasts, the per-epoch loss and accuracy allreduces).
    2. hidden = total - both: collective time that passed while forward or backward ran.
    3. ``step()``'s wait (``DistributedOptimizer.synchronize_wait_s``) = ``seconds["step"]`` +
       the wait outside any collective: negotiating while the peer is still in backward,
       queueing behind the engine thread, packing and unpacking buckets.
    """

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = {"step": 0.0, "blocking": 0.0}

    @contextmanager
    def completing(self, during: str) -> Iterator[None]:
        """Add to ``seconds[during]`` the collective time that passes inside the block."""
        before = cl.communication_stats()["collective_now_s"]
        yield
        self.seconds[during] += cl.communication_stats()["collective_now_s"] - before


def train(args: argparse.Namespace) -> float:
    cl.init()
    rank, size = cl.rank(), cl.size()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_split(args.seed)
    model = DigitsCNN(**DEMO_MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    ledger = Ledger()
    with ledger.completing("blocking"):
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
            with ledger.completing("step"):
                optimizer.step()
            loss_sum += loss.detach()
        with ledger.completing("blocking"):
            mean_loss = cl.allreduce(loss_sum / max(len(batches), 1), name="epoch.loss").item()
            accuracy = evaluate(model, x_test, y_test)
        if rank == 0:
            print(f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy {accuracy:.2%}")
    elapsed = time.perf_counter() - start
    report(optimizer, ledger, elapsed, accuracy)
    cl.shutdown()
    return accuracy


def report(
    optimizer: torch.optim.Optimizer, ledger: Ledger, elapsed_s: float, accuracy: float
) -> None:
    """Rank 0 prints the communication summary from its own counters (see ``Ledger``)."""
    stats = cl.communication_stats()
    if cl.rank() != 0:
        return
    total = stats["collective_now_s"]
    in_step, blocking = ledger.seconds["step"], ledger.seconds["blocking"]
    hidden = total - in_step - blocking
    gradients = hidden + in_step  # the gradient reductions DistributedOptimizer ran
    overlapped = hidden / gradients if gradients > 0 else 0.0
    waited = optimizer.synchronize_wait_s  # type: ignore[attr-defined]
    print(
        f"\ncommunication summary (rank 0): {stats['operations']:.0f} collectives in "
        f"{stats['cycles']:.0f} negotiation cycles, {stats['payload_bytes'] / 1e6:.1f} MB "
        f"reduced, ~{stats['wire_bytes'] / 1e6:.1f} MB sent, {total:.2f} s in collectives, "
        f"gradient reductions {overlapped:.0%} overlapped with backward; "
        f"training took {elapsed_s:.1f} s\n"
        f"  {total:.2f} s in collectives = {hidden:.2f} s hidden behind backward "
        f"+ {in_step:.2f} s waited for in step() + {blocking:.2f} s in blocking calls "
        f"(broadcasts, loss, accuracy)\n"
        f"  {waited:.2f} s step() waited = {in_step:.2f} s in collectives "
        f"+ {waited - in_step:.2f} s outside them (negotiation while the peer finished "
        f"backward, queueing, packing)"
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
