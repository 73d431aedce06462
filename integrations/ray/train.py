"""Ray Train: a TorchTrainer runs a commlayer training function on N workers.

    python integrations/ray/train.py --workers 2                   # a local Ray cluster
    RAY_ADDRESS=auto python integrations/ray/train.py --workers 8  # a running cluster

Ray starts the workers, gives each torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE...) and initializes torch.distributed in them (gloo here: ``TorchConfig``)
before it calls the training function. ``commlayer.init()`` inside the function then runs
commlayer's engine over torch.distributed (``COMMLAYER_BACKEND=auto`` picks the torch backend,
as under torchrun) on a gloo group of its own beside Ray's; the rest is a commlayer script as
under commlayerrun or torchrun: ``DistributedOptimizer``, ``broadcast_parameters``.

``--compare-ddp`` also trains a copy of the model wrapped in PyTorch's DDP on Ray's process
group, on the same batches, and reports how far apart the two end. Rank 0 reports one record
(``ray.train.report``): every rank's parameter checksum and commlayer operation count, gathered
with commlayer, and the variables Ray gave each worker; the driver prints it as one JSON line
(``result: {...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.nn.functional as F


def say(line: str) -> None:
    """One line in one write: the ranks' (or Ray's log threads') lines do not cut into it."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# What Ray sets in a worker (recorded in the result; torchrun sets the same names).
SEEN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")  # fmt: skip


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def train_func(config: dict[str, Any]) -> None:
    """One worker: commlayer over the process group Ray started."""
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import commlayer as hvd

    torch_ready = dist.is_initialized()  # by Ray, before this function
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # y = x . w + noise: the same data set on every rank, a shard each (the sampler)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(config["steps"] * size * 16, 32, generator=data)
    w = torch.randn(32, 1, generator=data) / 32**0.5
    y = x @ w + 0.1 * torch.randn(len(x), 1, generator=data)
    dataset = TensorDataset(x, y)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=size, rank=rank, shuffle=False
    )
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(rank)  # different first weights on each rank: broadcast makes them alike
    model = make_net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    pairs: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = [(model, optimizer)]
    if config["compare_ddp"]:  # the same start (rank 0's weights), averaged by DDP over Ray's group
        plain = make_net()
        plain.load_state_dict(model.state_dict())
        plain_ddp = DDP(plain)
        pairs.append((plain_ddp, torch.optim.SGD(plain_ddp.parameters(), lr=0.05)))

    with torch.no_grad():
        before = float(F.mse_loss(model(x), y))
    for inputs, targets in loader:
        for net, opt in pairs:
            opt.zero_grad()
            F.mse_loss(net(inputs), targets).backward()  # DistributedOptimizer reduces meanwhile
            opt.step()
    with torch.no_grad():
        after = float(F.mse_loss(model(x), y))

    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    mine_record = {
        "checksum": checksum,
        "operations": int(hvd.communication_stats()["operations"]),
        "torch_distributed_before_init": torch_ready,
        "env": {name: os.environ.get(name) for name in SEEN},
    }
    if config["compare_ddp"]:
        mine_record["ddp_gap"] = max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), plain.parameters(), strict=True)
        )
    ranks = hvd.allgather_object(mine_record)
    summary = hvd.startup_summary()
    hvd.shutdown()
    metrics = {"size": size, "steps": len(loader), "loss_before": before, "loss_after": after,
               "commlayer": summary, "ranks": json.dumps(ranks)}  # fmt: skip
    with tempfile.TemporaryDirectory() as saved:
        checkpoint = None
        if rank == 0:  # one checkpoint, rank 0's (the weights are the same on every rank)
            torch.save(model.state_dict(), os.path.join(saved, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(saved)
        # Every worker reports (a barrier); the result keeps the checkpoint's, rank 0's, metrics.
        ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="batches a worker trains on")
    parser.add_argument("--compare-ddp", action="store_true", help="also train plain DDP")
    parser.add_argument(
        "--storage",
        help="Ray Train's storage: a temporary directory by default; on several machines, one "
        "they all reach",
    )
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not os.environ.get("RAY_ADDRESS"):  # a local cluster just big enough, started here
        ray.init(num_cpus=args.workers + 1, object_store_memory=200 * 2**20,
                 include_dashboard=False)  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"steps": args.steps, "compare_ddp": args.compare_ddp},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
            run_config=RunConfig(name="commlayer", storage_path=args.storage or scratch),
        )
        result = trainer.fit()
        if result.checkpoint is None or result.metrics is None:
            raise SystemExit(f"Ray Train's result holds no checkpoint from rank 0: {result}")
        with result.checkpoint.as_directory() as saved:
            weights = torch.load(os.path.join(saved, "model.pt"))
    metrics = dict(result.metrics)
    metrics["ranks"] = json.loads(metrics["ranks"])
    say(f"{metrics['size']} workers, {metrics['steps']} steps each: loss on all the data "
        f"{metrics['loss_before']:.4f} -> {metrics['loss_after']:.4f}")  # fmt: skip
    saved_sum = sum(float(t.double().sum()) for t in weights.values())
    say(f"checkpoint: parameter checksum {saved_sum:.10f}")
    for rank, record in enumerate(metrics["ranks"]):
        say(f"rank {rank}: parameter checksum {record['checksum']:.10f}, commlayer operations "
            f"{record['operations']}")  # fmt: skip
    keys = ("size", "steps", "loss_before", "loss_after", "commlayer", "ranks")
    say("result: " + json.dumps({k: metrics[k] for k in keys}))


if __name__ == "__main__":
    main()
