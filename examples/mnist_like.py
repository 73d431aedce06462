"""An MNIST-like classifier as Horovod's users write it: a DistributedSampler, the learning rate
scaled by the number of ranks with a warm-up, and metrics averaged over the ranks.

    commlayerrun -np 2 python examples/mnist_like.py --epochs 2 --train-size 1024 --warmup-steps 10

The data are synthetic 28x28 "digits" (10 noisy class patterns, made from a seed, the same on
every rank): no download. With your own data set, only ``make_dataset`` changes.

- **Sharding**: ``DistributedSampler`` gives each rank ``len / size`` samples a epoch, reshuffled
  by ``set_epoch``; the test set is sharded the same way.
- **Learning rate**: the global batch is ``size`` times a rank's, so the base rate is scaled
  by ``size`` (Goyal et al. 2017), reached by a linear warm-up over the first ``--warmup-steps``
  steps, which keeps the first large steps from diverging.
- **Metrics**: each rank's loss and accuracy cover its shard only; ``Metric`` averages them
  over the ranks (one allreduce), so rank 0 prints the figure for the whole set.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import commlayer as hvd


def make_dataset(n: int, seed: int) -> TensorDataset:
    """``n`` noisy 1x28x28 images of 10 class patterns, the same for a given seed."""
    patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234)) > 0.7
    rng = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=rng)
    images = patterns[labels].float() + 2.0 * torch.randn(n, 1, 28, 28, generator=rng)
    return TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 5, stride=2)  # -> 8x12x12
        self.fc1 = nn.Linear(8 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x)).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


class Metric:
    """A running mean of one rank's values; ``avg`` is the mean over every rank."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.total = torch.tensor(0.0)
        self.count = torch.tensor(0.0)

    def update(self, value: torch.Tensor, n: int) -> None:
        self.total += value.detach() * n
        self.count += n

    @property
    def avg(self) -> float:
        both = hvd.allreduce(torch.stack([self.total, self.count]), op=hvd.Sum, name=self.name)
        return float(both[0] / both[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--base-lr", type=float, default=0.02, help="for one rank")
    parser.add_argument("--warmup-steps", type=int, default=20)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train, test = make_dataset(args.train_size, seed=1), make_dataset(512, seed=2)
    train_sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    test_sampler = DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test, batch_size=128, sampler=test_sampler)

    model = Net()
    lr = args.base_lr * hvd.size()  # scaled to the global batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # the scheduler drives the wrapped optimizer, as with any torch.optim optimizer
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps)
    )
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, learning rate {args.base_lr} x {hvd.size()} = {lr:g} "
              f"after {args.warmup_steps} warm-up steps", flush=True)  # fmt: skip

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        train_loss = Metric("train_loss")
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            warmup.step()
            train_loss.update(loss, len(y))
        model.eval()
        test_loss, test_accuracy = Metric("test_loss"), Metric("test_accuracy")
        with torch.no_grad():
            for x, y in test_loader:
                out = model(x)
                test_loss.update(F.cross_entropy(out, y), len(y))
                test_accuracy.update((out.argmax(1) == y).float().mean(), len(y))
        # every rank takes part in each average (an allreduce), rank 0 prints
        averages = (train_loss.avg, test_loss.avg, test_accuracy.avg)
        if hvd.rank() == 0:
            lr_now = optimizer.param_groups[0]["lr"]
            print(
                f"epoch {epoch}: lr {lr_now:.4f}, train loss {averages[0]:.4f}, test loss "
                f"{averages[1]:.4f}, test accuracy {100 * averages[2]:.2f}% (averaged over "
                f"{hvd.size()} ranks)",
                flush=True,
            )


if __name__ == "__main__":
    main()
