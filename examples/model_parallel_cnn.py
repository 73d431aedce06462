"""A small CNN trained with filter, channel, spatial, pipeline, hybrid or data parallelism,
checked against single-process training, timed per step.

    commlayerrun -np 2 python examples/model_parallel_cnn.py --strategy filter --check
    commlayerrun -np 4 python examples/model_parallel_cnn.py --strategy data+filter \\
        --model-ways 2 --check
    commlayerrun -np 3 python examples/model_parallel_cnn.py --strategy pipeline \\
        --micro-batches 8 --check

The model: conv 3->C, ReLU, conv C->C, ReLU, global average pool, linear C->10, on random
inputs (batch x 3 x H x W), SGD. The convolutions are the split layers:

1. filter: both convolutions' output channels divided among the ranks
   (model_parallel.FilterParallelConv2d); every rank trains on the whole batch.
2. channel: the second convolution's input channels divided (the first has 3).
3. spatial: the input's width divided; both convolutions exchange halos, the output is gathered
   along the width before pooling; the convolutions' weight gradients are summed over ranks.
4. data: each rank trains on its part of the batch (DistributedOptimizer, averaging).
5. data+filter, data+spatial: the ranks in groups of ``--model-ways`` consecutive ranks
   (model_parallel.grid), filter or spatial as above inside a group, each group on its part of
   the batch. data+filter averages every gradient over the ranks at the same place in the
   groups (DistributedOptimizer on that process set); data+spatial allreduces every gradient
   over all ranks at once (the convolutions' summed, the replicated FC's first divided by the
   group's size), then divides by the number of groups: one allreduce, as the oracle costs it.
6. pipeline (GPipe): the three layers (conv1+ReLU, conv2+ReLU, pool+FC) cut into one stage per
   rank (``--cuts``, default as even as the layers allow), the batch into ``--micro-batches``;
   every micro-batch forward through the stages, then every one backward in reverse order, the
   activations and their gradients sent between neighbouring stages (model_parallel.send and
   recv in a 2-rank process set); each stage steps its own layers. The loss is the last stage's.
``--check``: rank 0 also trains the single-process model on the same data and asserts that
the losses agree (float64, to 1e-9) at every step; ``--dtype float32`` for timing. Rank 0 prints
one ``RESULT {json}`` line (for benchmarks/oracle_model_parallel.py), then the same in words:
the strategy, the ranks, the median step time after ``--warmup`` steps and, with ``--check``,
how far the losses were from one process's.
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
from commlayer.core.process_sets import ProcessSet, global_process_set


class CNN(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc = nn.Linear(channels, 10)
        self.spatial = False  # True: the convolutions see this rank's columns only
        self.group: ProcessSet = global_process_set  # the ranks the layers are split among

    def forward(self, x: torch.Tensor) -> Any:
        for layer in range(len(LAYERS)):
            x = self.layer(layer, x)
        return x

    def layer(self, index: int, x: torch.Tensor) -> Any:
        """The oracle's layer ``index`` (torchmodel: conv1, conv2, fc) with the ReLU or pooling
        around it: the pipeline's unit."""
        if index == 0:
            return F.relu(self.conv1(x))
        if index == 1:
            y = F.relu(self.conv2(x))
            return mp.gather(y, -1, self.group) if self.spatial else y
        return self.fc(x.mean(dim=(2, 3)))


LAYERS = ("conv1", "conv2", "fc")


STRATEGIES = ("filter", "channel", "spatial", "data", "data+filter", "data+spatial", "pipeline")
DTYPE = {"float64": torch.float64, "float32": torch.float32}


def build(channels: int = 16, dtype: str = "float64") -> CNN:
    torch.manual_seed(0)
    return CNN(channels).to(DTYPE[dtype])


def parallelize(model: CNN, strategy: str, group: ProcessSet = global_process_set) -> CNN:
    """``strategy``'s split of ``model`` among the ranks of ``group`` (a hybrid's group)."""
    model.group = group
    split = strategy.removeprefix("data+")
    if split == "filter":
        model.conv1 = mp.FilterParallelConv2d(model.conv1, group)  # type: ignore[assignment]
        model.conv2 = mp.FilterParallelConv2d(model.conv2, group)  # type: ignore[assignment]
    elif split == "channel":
        model.conv2 = mp.ChannelParallelConv2d(model.conv2, group)  # type: ignore[assignment]
    elif split == "spatial":
        model.conv1 = mp.SpatialParallelConv2d(model.conv1, group)  # type: ignore[assignment]
        model.conv2 = mp.SpatialParallelConv2d(model.conv2, group)  # type: ignore[assignment]
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


def local_part(
    x: torch.Tensor, y: torch.Tensor, strategy: str, group: ProcessSet, data: ProcessSet
) -> tuple[torch.Tensor, ...]:
    """This rank's samples (its data set's part of the batch) and columns (spatial)."""
    if strategy.startswith("data"):
        start, stop = mp.shard(x.shape[0], data.rank(), data.size())
        x, y = x[start:stop], y[start:stop]
    if strategy.endswith("spatial"):
        start, stop = mp.shard(x.shape[-1], group.rank(), group.size())
        x = x[..., start:stop]
    return x, y


def stage_cuts(text: str | None, stages: int) -> list[tuple[int, int]]:
    """``--cuts a,b,...``: the first layer of stages 1.. (so ``1,2`` is [conv1], [conv2],
    [fc]); by default as even as the layers allow. One stage per rank, each non-empty."""
    if stages > len(LAYERS):
        raise ValueError(f"pipeline: {stages} ranks but only {len(LAYERS)} layers to cut")
    if text is None:
        starts = [mp.shard(len(LAYERS), k, stages)[0] for k in range(stages)]
    else:
        starts = [0] + [int(v) for v in text.split(",") if v]
    bounds = starts + [len(LAYERS)]
    if len(starts) != stages or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"--cuts {text!r}: give {stages - 1} increasing layer indices in 1..{len(LAYERS) - 1}"
            f" (one stage per rank, {stages} ranks)"
        )
    return list(zip(bounds, bounds[1:]))


class Pipeline:
    """This rank's stage of the GPipe pipeline: ``step`` runs one batch through it."""

    def __init__(self, model: CNN, args: argparse.Namespace) -> None:
        rank, size = cl.rank(), cl.size()
        self.model, self.args = model, args
        self.first, self.last = stage_cuts(args.cuts, size)[rank]
        # the pairs of neighbouring stages, registered on every rank in the same order
        pairs = [cl.add_process_set([k, k + 1]) for k in range(size - 1)]
        self.before = pairs[rank - 1] if rank > 0 else None
        self.after = pairs[rank] if rank < size - 1 else None

    def _forward(self, x: torch.Tensor) -> Any:
        for layer in range(self.first, self.last):
            x = self.model.layer(layer, x)
        return x

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward every micro-batch, then backward in reverse; the batch's loss (a mean over
        samples, the micro-batches' weighted by their share) on the last stage, else 0."""
        batch, micro = x.shape[0], self.args.micro_batches
        shape = (self.args.channels, self.args.size, self.args.size)
        ends, loss = [], x.new_zeros(())
        for m in range(micro):
            start, stop = mp.shard(batch, m, micro)
            if self.before is None:
                inputs = x[start:stop]
            else:
                inputs = mp.recv((stop - start, *shape), x.dtype, self.before)
            out = self._forward(inputs)
            if self.after is not None:
                ends.append(mp.send(out, self.after))
            else:
                part = F.cross_entropy(out, y[start:stop]) * ((stop - start) / batch)
                ends.append(part)
                loss = loss + part.detach()
        for end in reversed(ends):
            if self.after is not None:
                mp.backward_sent(end)
            else:
                end.backward()
        return loss


def _grad(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        raise RuntimeError(
            f"rank {cl.rank()}: a parameter of shape {tuple(param.shape)} has no gradient"
        )
    return param.grad


def train(args: argparse.Namespace) -> dict[str, Any]:
    group, data = global_process_set, global_process_set
    if args.strategy.startswith("data+"):
        group, data = mp.grid(args.model_ways)
    model = parallelize(build(args.channels, args.dtype), args.strategy, group)
    pipeline = Pipeline(model, args) if args.strategy == "pipeline" else None
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.strategy in ("data", "data+filter"):
        optimizer = cl.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), process_set=data
        )
    reference = build(args.channels, args.dtype) if args.check and cl.rank() == 0 else None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05) if reference else None
    times, worst = [], 0.0
    for step, (x, y) in enumerate(batches(args)):
        start_s = time.perf_counter()
        optimizer.zero_grad()
        if pipeline is not None:
            loss = pipeline.step(x, y)
        else:
            inputs, targets = local_part(x, y, args.strategy, group, data)
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
        if args.strategy == "spatial":  # each rank's part of the convolutions' gradients
            params = [p for conv in (model.conv1, model.conv2) for p in conv.parameters()]
            summed = cl.grouped_allreduce([_grad(p) for p in params], op=cl.Sum)
            for p, grad in zip(params, summed):
                p.grad = grad
        elif args.strategy == "data+spatial":
            # the convolutions' gradients summed over the group, every gradient averaged over
            # the groups: one Sum over all ranks, the FC's (the same on every rank of a group)
            # first divided by the group's size, then all divided by the number of groups
            convs = {id(p) for conv in (model.conv1, model.conv2) for p in conv.parameters()}
            params = list(model.parameters())
            grads = [_grad(p) / (1 if id(p) in convs else group.size()) for p in params]
            summed = cl.grouped_allreduce(grads, op=cl.Sum)
            for p, grad in zip(params, summed):
                p.grad = grad / data.size()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start_s)
        full = loss.detach()
        if args.check and args.strategy.startswith("data"):
            # the batch's loss: the mean over ranks (a group's ranks hold the same loss)
            full = cl.allreduce(full)
        elif args.check and args.strategy == "pipeline":
            full = cl.broadcast(full, cl.size() - 1)  # the last stage's
        if reference is not None and ref_optimizer is not None:
            ref_optimizer.zero_grad()
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_optimizer.step()
            worst = max(worst, abs(full.item() - ref_loss.item()))
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


def arguments_problem(args: argparse.Namespace, size: int) -> str | None:
    """What makes ``args`` impossible at ``size`` ranks (the same answer on every rank)."""
    if args.strategy.startswith("data+") and (args.model_ways < 1 or size % args.model_ways):
        return f"--model-ways {args.model_ways} must divide the {size} ranks into groups"
    groups = size // args.model_ways if args.strategy.startswith("data+") else size
    if args.strategy.startswith("data") and args.batch % groups:
        return (
            f"--batch {args.batch} must divide among {groups} data-parallel groups "
            "(unequal parts weigh samples unequally)"
        )
    if args.strategy == "pipeline":
        if not 1 <= args.micro_batches <= args.batch:
            return f"--micro-batches {args.micro_batches} must be in 1..--batch {args.batch}"
        try:
            stage_cuts(args.cuts, size)
        except ValueError as error:
            return str(error)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="filter")
    parser.add_argument(
        "--model-ways", type=int, default=2,
        help="hybrids: ranks per group (filter or spatial inside, data across); divides ranks",
    )  # fmt: skip
    parser.add_argument("--micro-batches", type=int, default=4, help="pipeline: GPipe's M")
    parser.add_argument("--cuts", help="pipeline: first layer of stages 1.. (e.g. 1,2)")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--size", type=int, default=16, help="input height and width")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args()
    cl.init()
    problem = arguments_problem(args, cl.size())
    if problem:
        print(f"rank {cl.rank()}: {problem}", file=sys.stderr)
        cl.shutdown()
        return 2
    result = train(args)
    cl.barrier()  # a pipeline's last stage ends before the first: none shuts down too early
    if cl.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
        said = (
            f"{args.strategy} parallelism on {cl.size()} ranks: {result['step_ms']:.1f} ms a step "
            f"(median after {args.warmup} warm-up steps)"
        )
        if args.check:
            said += (
                f"; every step's loss within {result['max_loss_diff']:.1g} of one process's "
                f"training ({args.dtype})"
            )
        print(said, flush=True)
        if args.check and result["max_loss_diff"] > 1e-9:
            print(
                f"losses differ from one process by {result['max_loss_diff']:.3g}", file=sys.stderr
            )
            return 1
    cl.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
