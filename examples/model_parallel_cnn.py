"""A small CNN trained with filter, channel or spatial parallelism (or data), checked against
single-process training, timed per step.

    commlayerrun -np 2 python examples/model_parallel_cnn.py --strategy filter [--check]

The model: conv 3->C, ReLU, conv C->C, ReLU, global average pool, linear C->10, on random
inputs (batch x 3 x H x W), SGD. The convolutions are the split layers:
1. filter: both convolutions' output channels divided among the ranks
   (model_parallel.FilterParallelConv2d); every rank trains on the whole batch.
2. channel: the second convolution's input channels divided (the first has 3).
3. spatial: the input's width divided; both convolutions exchange halos, the output is gathered
   along the width before pooling; the convolutions' weight gradients are summed over ranks.
4. data: each rank trains on its part of the batch (DistributedOptimizer, averaging).
``--check``: rank 0 also trains the single-process model on the same data and asserts that
the losses agree (float64, to 1e-9) at every step; ``--dtype float32`` for timing. Prints one
``RESULT {json}`` line: the median step time after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import commlayer as cl
from commlayer import model_parallel as mp


class CNN(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc = nn.Linear(channels, 10)
        self.spatial = False  # True: the convolutions see this rank's columns only

    def forward(self, x: torch.Tensor) -> Any:
        y = F.relu(self.conv2(F.relu(self.conv1(x))))
        if self.spatial:
            y = mp.gather(y, -1)
        return self.fc(y.mean(dim=(2, 3)))


DTYPE = {"float64": torch.float64, "float32": torch.float32}


def build(channels: int = 16, dtype: str = "float64") -> CNN:
    torch.manual_seed(0)
    return CNN(channels).to(DTYPE[dtype])


def parallelize(model: CNN, strategy: str) -> CNN:
    if strategy == "filter":
        model.conv1 = mp.FilterParallelConv2d(model.conv1)  # type: ignore[assignment]
        model.conv2 = mp.FilterParallelConv2d(model.conv2)  # type: ignore[assignment]
    elif strategy == "channel":
        model.conv2 = mp.ChannelParallelConv2d(model.conv2)  # type: ignore[assignment]
    elif strategy == "spatial":
        model.conv1 = mp.SpatialParallelConv2d(model.conv1)  # type: ignore[assignment]
        model.conv2 = mp.SpatialParallelConv2d(model.conv2)  # type: ignore[assignment]
        model.spatial = True
    return model


def batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch, 3, args.size, args.size)
    return [
        (torch.randn(shape, generator=gen, dtype=DTYPE[args.dtype]),
         torch.randint(0, 10, (args.batch,), generator=gen))
        for _ in range(args.warmup + args.steps)
    ]  # fmt: skip


def local_part(x: torch.Tensor, y: torch.Tensor, strategy: str) -> tuple[torch.Tensor, ...]:
    rank, size = cl.rank(), cl.size()
    if strategy == "data":
        start, stop = mp.shard(x.shape[0], rank, size)
        return x[start:stop], y[start:stop]
    if strategy == "spatial":
        start, stop = mp.shard(x.shape[-1], rank, size)
        return x[..., start:stop], y
    return x, y


def train(args: argparse.Namespace) -> dict[str, Any]:
    model = parallelize(build(args.channels, args.dtype), args.strategy)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.strategy == "data":
        optimizer = cl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    reference = build(args.channels, args.dtype) if args.check and cl.rank() == 0 else None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05) if reference else None
    times, worst = [], 0.0
    for step, (x, y) in enumerate(batches(args)):
        start_s = time.perf_counter()
        optimizer.zero_grad()
        inputs, targets = local_part(x, y, args.strategy)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        if args.strategy == "spatial":  # each rank's part of the convolutions' gradients
            params = [p for conv in (model.conv1, model.conv2) for p in conv.parameters()]
            summed = cl.grouped_allreduce([p.grad for p in params], op=cl.Sum)
            for p, grad in zip(params, summed):
                p.grad = grad
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start_s)
        if reference is not None and ref_optimizer is not None:
            ref_optimizer.zero_grad()
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_optimizer.step()
            full = loss.detach()
            full = cl.allreduce(full) if args.strategy == "data" else full
            worst = max(worst, abs(full.item() - ref_loss.item()))
        elif args.strategy == "data" and args.check:
            cl.allreduce(loss.detach())  # rank 0 averages the losses: every rank joins
    result = {
        "strategy": args.strategy,
        "ranks": cl.size(),
        "batch": args.batch,
        "size": args.size,
        "channels": args.channels,
        "step_ms": statistics.median(times) * 1e3 if times else 0.0,
    }
    if args.check:
        result["max_loss_diff"] = worst
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy", choices=("filter", "channel", "spatial", "data"), default="filter"
    )
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--size", type=int, default=16, help="input height and width")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args()
    cl.init()
    if args.strategy == "data" and args.batch % cl.size():
        print(
            f"--batch {args.batch} must divide among {cl.size()} ranks for data parallelism "
            "(unequal parts weigh samples unequally)",
            file=sys.stderr,
        )
        return 2
    result = train(args)
    if cl.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
        if args.check and result["max_loss_diff"] > 1e-9:
            print(
                f"losses differ from one process by {result['max_loss_diff']:.3g}", file=sys.stderr
            )
            return 1
    cl.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
