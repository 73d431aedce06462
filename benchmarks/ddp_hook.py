"""DDP communication hooks: PyTorch's own vs commlayer's (``commlayer.integrations.ddp``).

    OMP_NUM_THREADS=1 python benchmarks/ddp_hook.py [--np 2] [--out benchmarks/results/ddp_hook.md]

1. The driver launches one ``mpiexec -n N`` job per hook (a hook that hangs or fails is reported
   as such, the others still run) and prints a table: median step time, samples/s, ratio to
   DDP without a hook, all measured in this one run.
2. The model is benchmarks/train.py's ``mlp`` (6.69 M parameters, 42 tensors), DDP over gloo
   with its default 25 MB buckets, SGD momentum 0.9, batch 32 per rank of random inputs; a step
   is zero_grad, forward, backward, step. Median over ``--steps`` steps after ``--warmup``
   (>= 2: both PowerSGD hooks and ours reduce densely for the first 2 iterations).
3. Pairs with the same compressor: none (allreduce_hook / ours "none"), fp16
   (fp16_compress_hook / ours "fp16" and ``compress_wrapper(hook, "fp16")``), PowerSGD rank 2
   (powerSGD_hook / ours "powersgd:rank=2"); top-k (1%, error feedback) is ours only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

RESULT_PREFIX = "RESULT "
# name -> (whose, description)
HOOKS: dict[str, tuple[str, str]] = {
    "builtin": ("torch", "no hook (DDP's C++ allreduce)"),
    "torch_allreduce": ("torch", "allreduce_hook"),
    "ours_none": ("commlayer", 'CommState("none")'),
    "torch_fp16": ("torch", "fp16_compress_hook"),
    "ours_fp16": ("commlayer", 'CommState("fp16")'),
    "ours_wrap_fp16": ("commlayer", 'compress_wrapper(hook, "fp16"), CommState("none")'),
    "torch_powersgd": ("torch", "powerSGD_hook, rank 2, start_powerSGD_iter=2"),
    "ours_powersgd": ("commlayer", 'CommState("powersgd:rank=2")'),
    "ours_topk": ("commlayer", 'CommState("topk:ratio=0.01") (error feedback)'),
}


def _register(model: Any, hook: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from commlayer.integrations import ddp

    ours = {
        "ours_none": "none",
        "ours_fp16": "fp16",
        "ours_powersgd": "powersgd:rank=2",
        "ours_topk": "topk:ratio=0.01",
    }
    if hook in ours:
        model.register_comm_hook(ddp.CommState(compression=ours[hook]), ddp.hook)
    elif hook == "ours_wrap_fp16":
        model.register_comm_hook(ddp.CommState(), ddp.compress_wrapper(ddp.hook, "fp16"))
    elif hook == "torch_allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "torch_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=2, start_powerSGD_iter=2
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def worker(args: argparse.Namespace) -> None:
    from common import init_gloo
    from mpi4py import MPI
    from train import mlp

    world = MPI.COMM_WORLD
    init_gloo(world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    _register(model, args.worker)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inputs, targets = torch.randn(args.batch, 768), torch.randint(0, 1000, (args.batch,))
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    step_ms = statistics.median(times[args.warmup :]) * 1e3
    if world.rank == 0:
        result = {"hook": args.worker, "step_ms": step_ms, "ranks": world.size}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


def run_one(args: argparse.Namespace, hook: str) -> dict[str, Any]:
    from train import _mpiexec

    command = [
        _mpiexec(), "-n", str(args.np), sys.executable, __file__, "--worker", hook,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=args.timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"hook": hook, "error": f"no result after {args.timeout_s} s (hung)"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line.removeprefix(RESULT_PREFIX)))
    last = (done.stderr.strip().splitlines() or ["?"])[-1]
    return {"hook": hook, "error": f"exit {done.returncode}: {last}"}


def table(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    base = next((r["step_ms"] for r in results if r["hook"] == "builtin" and "step_ms" in r), None)
    rows = [
        f"# DDP communication hooks, {args.np} ranks, mlp (benchmarks/train.py), batch "
        f"{args.batch} per rank, median of {args.steps} steps after {args.warmup} warm-up",
        "",
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, gloo, OMP_NUM_THREADS=1, `{' '.join(['python', *sys.argv])}`",
        "",
        "| hook | whose | step ms | samples/s | vs no hook |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        whose, what = HOOKS[r["hook"]]
        if "error" in r:
            rows.append(f"| {what} | {whose} | {r['error']} | | |")
            continue
        rate = args.batch * args.np / (r["step_ms"] / 1e3)
        ratio = f"{base / r['step_ms']:.2f}" if base else "—"
        rows.append(f"| {what} | {whose} | {r['step_ms']:.1f} | {rate:.0f} | {ratio} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hooks", default=",".join(HOOKS))
    parser.add_argument("--timeout-s", type=int, default=180)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.worker:
        worker(args)
        return 0
    results = []
    for hook in args.hooks.split(","):
        results.append(run_one(args, hook))
        print(json.dumps(results[-1]), flush=True)
    text = "\n".join(table(args, results)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
