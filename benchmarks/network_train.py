"""Training across hosts of the namespace cluster (scripts/cluster.sh): DDP (gloo, torchrun
multi-node), Horovod and commlayer with every compressor, on rate-limited links (issue 21).

    sudo OMP_NUM_THREADS=1 python benchmarks/network_train.py --rates 1gbit,10gbit --layout 2x1

1. Brings the cluster up (``cluster.sh up H``), and for each rate in ``--rates`` sets every link
   to it live (``cluster.sh set``), then runs, per system, one job per task; the cluster comes
   down whatever happens. Systems start as users start them on real machines: DDP with one
   ``torchrun`` agent per host (``cluster.sh exec nodeK torchrun --nnodes H --rdzv-backend c10d
   --rdzv-endpoint node1:29400``), Horovod and commlayer with ``commlayerrun -H node1:R,...``
   (MPICH's hydra through the cluster's launcher); commlayer's compressor, sparse algorithm and
   hierarchy come from ``COMMLAYER_COMPRESSION`` / ``COMMLAYER_SPARSE_ALGORITHM`` /
   ``COMMLAYER_COMPRESSION_HIERARCHY`` (``flat`` for the systems measured before issue 51:
   every rank compresses its own gradients; ``... host``: once per host, the host's ranks
   summing the bucket over shared memory first; ``... auto``: decided per bucket). The
   ``torchrun ...`` systems are commlayer started as DDP is (one torchrun agent per host), its
   engine over gloo (issue 25).
2. Task ``throughput``: benchmarks/train.py's ``mlp`` (6.69 M parameters, 26.8 MB of float32
   gradients; ``--model resnet``: its small ResNet, compute-bound on a CPU) on random inputs,
   ``--batch`` samples per rank, SGD momentum 0.9: median step time over ``--steps`` after
   ``--warmup``, samples/s, and the bytes host 1's link carried per step in each direction
   (its eth0 counters in /proc/net/dev, read by rank 0 inside its host: the same physical
   count for every system, whatever it says it sent).
3. Task ``accuracy``: the demo's digits CNN (examples/train_digits.py, 284 K parameters) with
   Adam, lr 3e-3, ``--batch`` per rank, ``--epochs`` epochs of the shuffled training set split
   across ranks; after every epoch rank 0 scores the whole test set (untimed; the replicas are
   identical). Time to ``--target`` accuracy: training seconds until the first epoch at or above
   it; final accuracy after the last epoch.
   Task ``tta``: time to accuracy of a model whose step is link-bound (``fashion_mlp``: the
   anchor MLP on Fashion-MNIST, ``apt-get install -y dataset-fashion-mnist``), scored every
   ``--eval-every`` steps until ``--tta-target``: a compressor that needs more steps has to
   win them back in step time.
4. The link is the physical limit: an allreduce of S bytes across H hosts moves at least
   S x 2 (H - 1) / H bytes each way per host link (reduce-scatter plus allgather between
   hosts), so an uncompressed step cannot take less than ``26.8 MB x 2 (H - 1) / H / rate``
   (0.214 s at 1 Gbit/s with 2 hosts) unless it overlaps that with compute.
5. Writes ``network_train_<rates>_<layout>.md`` (tables per rate, ratios to DDP measured in
   the same run), ``.json`` (every result, machine-readable for the oracle and auto-tuning)
   and ``.png`` (samples/s per system and rate; accuracy against training time) under
   ``--out``.
   ``--replot JSON`` writes the tables and the picture again.
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
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "RESULT "
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]

from network import CLUSTER, layout, rate_bits, require_no_cluster  # noqa: E402

TORCHRUN = "commlayer-torchrun"  # commlayer's worker under torchrun (its engine over gloo)
# (label, system, COMMLAYER_COMPRESSION, COMMLAYER_SPARSE_ALGORITHM,
#  COMMLAYER_COMPRESSION_HIERARCHY)
SYSTEMS: list[tuple[str, str, str, str, str]] = [
    ("ddp", "ddp", "", "", ""),
    ("horovod", "horovod", "", "", ""),
    ("none", "commlayer", "none", "", "flat"),
    ("fp16", "commlayer", "fp16", "", "flat"),
    ("qsgd 8-bit", "commlayer", "qsgd:levels=127", "", "flat"),
    ("qsgd 4-bit", "commlayer", "qsgd:levels=7", "", "flat"),
    *[
        (f"topk 1% {alg}", "commlayer", "topk:ratio=0.01", alg, "flat")
        for alg in (
            "allgather",
            "dsar",
            "gtopk",
            "ssar_recursive_doubling",
            "ssar_split_allgather",
            "topo_sparse",
        )
    ],  # fmt: skip
    ("topk 1% sampled", "commlayer", "topk:ratio=0.01,mode=sampled", "allgather", "flat"),
    ("randomk 1%", "commlayer", "randomk:ratio=0.01", "", "flat"),
    ("powersgd r2", "commlayer", "powersgd:rank=2", "", "flat"),
    ("powersgd r4", "commlayer", "powersgd:rank=4", "", "flat"),
    ("efsignsgd", "commlayer", "efsignsgd", "", "flat"),
    # issue 39: per bucket none / a cast (auto), or a lossy one with error feedback too
    ("auto", "commlayer", "auto", "", "flat"),
    ("auto lossy", "commlayer", "auto:lossy=1", "", "flat"),
    # issue 51: compressed once per host (each the flat row above it in PER_HOST's pairs)
    ("fp16 host", "commlayer", "fp16", "", "host"),
    ("qsgd 8-bit host", "commlayer", "qsgd:levels=127", "", "host"),
    ("qsgd 4-bit host", "commlayer", "qsgd:levels=7", "", "host"),
    ("topk 1% allgather host", "commlayer", "topk:ratio=0.01", "allgather", "host"),
    ("topk 1% sampled host", "commlayer", "topk:ratio=0.01,mode=sampled", "allgather", "host"),
    ("randomk 1% host", "commlayer", "randomk:ratio=0.01", "", "host"),
    ("powersgd r2 host", "commlayer", "powersgd:rank=2", "", "host"),
    ("powersgd r4 host", "commlayer", "powersgd:rank=4", "", "host"),
    ("efsignsgd host", "commlayer", "efsignsgd", "", "host"),
    ("topk 1% allgather auto", "commlayer", "topk:ratio=0.01", "allgather", "auto"),
    ("auto lossy auto", "commlayer", "auto:lossy=1", "", "auto"),
    # commlayer launched as DDP is (torchrun, one agent per host), its engine over gloo
    ("torchrun none", TORCHRUN, "none", "", "flat"),
    ("torchrun fp16", TORCHRUN, "fp16", "", "flat"),
    ("torchrun powersgd r2", TORCHRUN, "powersgd:rank=2", "", "flat"),
    ("torchrun topk 1% allgather", TORCHRUN, "topk:ratio=0.01", "allgather", "flat"),
    ("torchrun powersgd r2 host", TORCHRUN, "powersgd:rank=2", "", "host"),
    ("torchrun topk 1% allgather host", TORCHRUN, "topk:ratio=0.01", "allgather", "host"),
]
# issue 51: (per host or auto, the same compressor flat), compared run by run in the tables
PER_HOST = [
    (label, label.rsplit(" ", 1)[0])
    for label, *_, hierarchy in SYSTEMS
    if hierarchy in ("host", "auto") and label.rsplit(" ", 1)[0] in {s[0] for s in SYSTEMS}
]
TASKS = ("throughput", "accuracy", "tta")


# -- worker: one system, one task, on the cluster ----------------------------------------------
def _link_bytes() -> tuple[int, int]:
    """(received, sent) bytes of this host's eth0 so far; /proc/net/dev is per network namespace,
    so a rank reads its own host's link. (0, 0) outside the cluster."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    return 0, 0


class System:
    """One system's init, model wrapping and optimizer wrapping behind one interface: DDP over
    torch.distributed, or Horovod and commlayer through their one (shared) API, ``self.hvd``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hvd: Any = None
        if name == "ddp":
            import torch.distributed as dist

            dist.init_process_group("gloo")  # torchrun's env:// rendezvous
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            return
        if name == "horovod":
            import horovod.torch as hvd
        else:
            import commlayer as hvd
        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        if self.hvd is None:
            return nn.parallel.DistributedDataParallel(model), optimizer
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        named = model.named_parameters()
        return model, self.hvd.DistributedOptimizer(optimizer, named_parameters=named)

    def stats(self) -> dict[str, float]:
        """commlayer's engine counters (communication_stats); nothing for DDP and Horovod."""
        if not self.name.startswith("commlayer"):
            return {}
        return dict(self.hvd.communication_stats())

    def barrier(self) -> None:
        if self.hvd is None:
            import torch.distributed as dist

            dist.barrier()
        else:
            self.hvd.allreduce(torch.zeros(1), name="network_train.barrier")

    def close(self) -> None:
        if self.hvd is None:
            import torch.distributed as dist

            dist.destroy_process_group()
        else:
            self.hvd.shutdown()


def throughput(system: System, args: argparse.Namespace) -> dict[str, Any]:
    from train import MODELS

    build, input_shape, classes = MODELS[args.model]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = system.wrap(model, optimizer)
    inputs = torch.randn(args.batch, *input_shape)
    targets = torch.randint(0, classes, (args.batch,))
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            system.barrier()
            rx0, tx0 = _link_bytes()
            stats0 = system.stats()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    rx1, tx1 = _link_bytes()
    stats1 = system.stats()
    decided = getattr(optimizer, "compression_decisions", None)  # compression="auto" (rank 0)
    decisions = decided() if decided else []
    choices = [d["choice"] for d in decisions]
    step_s = statistics.median(times[args.warmup :])
    quartiles = statistics.quantiles(times[args.warmup :], n=4)
    engine = {  # commlayer only: where a step's communication went
        f"{key}_per_step": (stats1[key] - stats0[key]) / args.steps
        for key in ("operations", "collective_s", "cycles")
        if key in stats1
    }
    return {
        **engine,
        **({"auto_choices": choices, "auto_decisions": decisions} if choices else {}),
        "step_ms": step_s * 1e3,
        "step_ms_iqr": [q * 1e3 for q in (quartiles[0], quartiles[2])],
        "samples_per_s": args.batch * system.size / step_s,
        "link_sent_mb_per_step": (tx1 - tx0) / args.steps / 1e6,
        "link_received_mb_per_step": (rx1 - rx0) / args.steps / 1e6,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor,
          index: torch.Tensor) -> None:  # fmt: skip
    optimizer.zero_grad()
    F.cross_entropy(model(x[index]), y[index]).backward()
    optimizer.step()


def _score(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy (untimed by the callers; the replicas are identical)."""
    with torch.no_grad():
        model.eval()
        correct = (model(x).argmax(1) == y).float().mean().item()
        model.train()
    return correct


def accuracy(system: System, args: argparse.Namespace) -> dict[str, Any]:
    from train_digits import DEMO_MODEL, DigitsCNN, load_split

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_split(args.seed)
    model = DigitsCNN(**DEMO_MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = system.wrap(model, optimizer)
    curve: list[dict[str, float]] = []
    train_s = 0.0
    rx0, tx0 = _link_bytes()
    steps = 0
    for epoch in range(1, args.epochs + 1):
        system.barrier()
        t0 = time.perf_counter()
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[system.rank :: system.size]
        for begin in range(0, len(mine) - args.batch + 1, args.batch):
            _step(model, optimizer, x_train, y_train, mine[begin : begin + args.batch])
            steps += 1
        system.barrier()
        train_s += time.perf_counter() - t0
        correct = _score(model, x_test, y_test)
        curve.append({"epoch": epoch, "train_s": train_s, "accuracy": correct})
    rx1, tx1 = _link_bytes()
    reached = [point["train_s"] for point in curve if point["accuracy"] >= args.target]
    return {
        "curve": curve,
        "final_accuracy": curve[-1]["accuracy"],
        "time_to_target_s": reached[0] if reached else None,
        "target": args.target,
        "train_s": train_s,
        "link_sent_mb_per_step": (tx1 - tx0) / max(steps, 1) / 1e6,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def fashion_mlp() -> nn.Module:
    """The anchor MLP (train.py's ``mlp``: 10 x [Linear(768, 768), LayerNorm, GELU]) between a
    Linear(784, 768) that takes Fashion-MNIST's pixels and a Linear(768, 10): 6.53 M parameters,
    26.1 MB of float32 gradients a step, so at 1 Gbit/s its step is link-bound."""
    from train import mlp

    body = list(mlp())[:-1]
    return nn.Sequential(nn.Linear(784, 768), *body, nn.Linear(768, 10))


def tta(system: System, args: argparse.Namespace) -> dict[str, Any]:
    """Task ``tta``: time to accuracy of a link-bound model, fashion_mlp() on Fashion-MNIST
    (Debian's dataset-fashion-mnist), Adam lr ``--tta-lr``, ``--batch`` per rank, the
    shuffled training set dealt across ranks. Every ``--eval-every`` steps all ranks stop the
    clock and score the first 2000 test images (identical replicas: the same answer on every
    rank); the job ends at ``--tta-target`` or after ``--tta-max-steps``."""
    from shuffle import FASHION, load_images

    if not FASHION.exists():
        raise SystemExit(f"task tta needs {FASHION}: apt-get install -y dataset-fashion-mnist")
    sets = load_images("fashion", argparse.Namespace(train_samples=60000, test_samples=2000))
    x_train, y_train, x_test, y_test = sets
    x_train, x_test = x_train.flatten(1), x_test.flatten(1)
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    torch.manual_seed(args.seed)
    model = fashion_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.tta_lr)
    model, optimizer = system.wrap(model, optimizer)
    curve: list[dict[str, float]] = []
    train_s, steps, epoch = 0.0, 0, 0
    rx0, tx0 = _link_bytes()
    reached: float | None = None
    while reached is None and steps < args.tta_max_steps:
        epoch += 1
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[system.rank :: system.size]
        begin = 0
        while reached is None and steps < args.tta_max_steps and begin + args.batch <= len(mine):
            system.barrier()
            t0 = time.perf_counter()
            for _ in range(args.eval_every):
                if begin + args.batch > len(mine):
                    break
                _step(model, optimizer, x_train, y_train, mine[begin : begin + args.batch])
                begin += args.batch
                steps += 1
            system.barrier()
            train_s += time.perf_counter() - t0
            correct = _score(model, x_test, y_test)
            curve.append({"step": steps, "train_s": train_s, "accuracy": correct})
            if correct >= args.tta_target:
                reached = train_s
    rx1, tx1 = _link_bytes()
    decided = getattr(optimizer, "compression_decisions", None)
    return {
        "curve": curve,
        "final_accuracy": curve[-1]["accuracy"],
        "time_to_target_s": reached,
        "steps_to_target": steps if reached is not None else None,
        "target": args.tta_target,
        "train_s": train_s,
        "step_ms": 1e3 * train_s / max(steps, 1),
        "link_sent_mb_per_step": (tx1 - tx0) / max(steps, 1) / 1e6,
        "parameters": sum(p.numel() for p in model.parameters()),
        "auto_choices": [d["choice"] for d in decided()] if decided else [],
    }


def worker(args: argparse.Namespace) -> None:
    system = System(args.worker)
    result = {"throughput": throughput, "accuracy": accuracy, "tta": tta}[args.task](system, args)
    result["ranks"] = system.size
    system.close()
    if system.rank == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


# -- driver ------------------------------------------------------------------------------------
def cluster(*args: str) -> None:
    subprocess.run(["bash", str(CLUSTER), *args], check=True, stdout=subprocess.DEVNULL)


def _script(name: str) -> str:
    return str(Path(sysconfig.get_path("scripts")) / name)


def launch(args: argparse.Namespace, system: str, task: str, env: dict[str, str]) -> str:
    """Runs one job on the cluster; returns its combined output."""
    hosts, per_host = args.layout
    worker_args = [
        str(Path(__file__).resolve()), "--worker", system, "--task", task,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--epochs", str(args.epochs), "--target", str(args.target), "--lr", str(args.lr),
        "--tta-target", str(args.tta_target), "--tta-lr", str(args.tta_lr),
        "--tta-max-steps", str(args.tta_max_steps), "--eval-every", str(args.eval_every),
        "--seed", str(args.seed), "--model", args.model,
    ]  # fmt: skip
    if system not in ("ddp", TORCHRUN):
        command = [
            _script("commlayerrun"), "-np", str(hosts * per_host),
            "-H", ",".join(f"node{k}:{per_host}" for k in range(1, hosts + 1)),
            sys.executable, *worker_args,
        ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=args.timeout_s
        )
        return done.stdout + done.stderr
    # DDP (and commlayer-torchrun) as torchrun runs it on real machines: one agent per host,
    # rendezvous on node1
    rdzv_id = f"nt{time.monotonic_ns()}"
    agents = [
        subprocess.Popen(
            [
                "bash",
                str(CLUSTER),
                "exec",
                f"node{k}",
                _script("torchrun"),
                "--nnodes",
                str(hosts),
                "--nproc-per-node",
                str(per_host),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "node1:29400",
                "--rdzv-id",
                rdzv_id,
                *worker_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )  # fmt: skip
        for k in range(1, hosts + 1)
    ]
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=args.timeout_s)[0])
        except subprocess.TimeoutExpired:
            agent.kill()
            outputs.append(agent.communicate()[0] + "\n(timed out)")
    return "\n".join(outputs)


def run_one(
    args: argparse.Namespace, entry: tuple[str, str, str, str, str], task: str
) -> dict[str, Any]:
    label, system, spec, sparse, hierarchy = entry
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
    if system.startswith("commlayer"):
        env["COMMLAYER_COMPRESSION"] = spec
        env["COMMLAYER_COMPRESSION_HIERARCHY"] = hierarchy
        if sparse:
            env["COMMLAYER_SPARSE_ALGORITHM"] = sparse
    t0 = time.perf_counter()
    try:
        output = launch(args, system, task, env)
    except subprocess.TimeoutExpired:
        output = f"(timed out after {args.timeout_s} s)"
    wall = time.perf_counter() - t0
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = dict(json.loads(line.removeprefix(RESULT_PREFIX)))
            result.update(label=label, system=system, compression=spec, sparse=sparse)
            result.update(hierarchy=hierarchy)
            result.update(task=task, wall_s=wall)
            return result
    tail = "\n".join(output.splitlines()[-15:])
    print(f"  {label} {task}: failed\n{tail}", file=sys.stderr, flush=True)
    return {"label": label, "system": system, "task": task, "error": tail[-2000:]}


def throughputs(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system label, in first-run order: the median over its throughput runs of step time,
    samples/s and link bytes, and the range of step times; or the error of a run that failed."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["task"] == "throughput":
            by_label.setdefault(r["label"], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for label, runs in by_label.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            out[label] = {"error": runs[-1]["error"] or "failed"}
            continue
        steps = [r["step_ms"] for r in good]
        out[label] = {
            "step_ms": statistics.median(steps),
            "step_ms_range": (min(steps), max(steps)),
            "runs": len(good),
            "failed_runs": len(runs) - len(good),
            **{
                key: statistics.median(r[key] for r in good)
                for key in ("samples_per_s", "link_sent_mb_per_step", "link_received_mb_per_step")
            },
        }
    return out


def _paired(rows: list[dict[str, Any]], label: str, base_label: str) -> str:
    """samples/s of ``label`` over the baseline's in the same round (runs taken in turn):
    median [min-max] over the rounds."""
    step = {
        (r["label"], r.get("round", 0)): r["step_ms"]
        for r in rows
        if r["task"] == "throughput" and "error" not in r
    }
    ratios = [
        step[base_label, k] / step[label, k]
        for (name, k) in step
        if name == label and (base_label, k) in step
    ]
    if not ratios:
        return "—"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def tables(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for rate in result["rates"]:
        rows = [r for r in result["runs"] if r["rate"] == rate]
        ddp = {r["task"]: r for r in rows if r["label"] == "ddp" and "error" not in r}
        # the baseline of the ratios: DDP where it ran, else uncompressed commlayer
        base_label = "ddp" if any(r["label"] == "ddp" for r in rows) else "none"
        model = result.get("model", "mlp")
        grads = 4 * result.get("parameters", {}).get(model, 6.69e6)  # float32 bytes a step
        bound = grads * 2 * (result["hosts"] - 1) / result["hosts"] * 8 / rate_bits(rate)
        lines += [f"## links at {rate}", ""]
        speeds = throughputs(rows)
        lines += [] if not speeds else [
            f"Throughput: benchmarks/train.py's {model}, batch {result['batch']} per rank; a run's "
            f"step time is the median of {result['steps']} steps after {result['warmup']}; "
            f"{result.get('rounds', 1)} runs per system, taken in turn: their median, and "
            "their range in brackets. Link MB: "
            "what host 1's link carried per step, each way (eth0 counters). Link floor for an "
            f"uncompressed step: {bound * 1e3:.0f} ms of transfer beyond compute.",
            "",
            f"| system | step ms | samples/s | vs {base_label} | vs {base_label} per round "
            "[min-max] | link MB/step out | link MB/step in | auto chose |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]  # fmt: skip
        base = speeds.get(base_label, {}).get("samples_per_s")
        for label, agg in speeds.items():
            if "error" in agg:
                lines.append(
                    f"| {label} | failed: {agg['error'].splitlines()[-1][:80]} | | | | | | |"
                )
                continue
            ratio = _fmt(agg["samples_per_s"] / base if base else None, ".2f")
            low, high = agg["step_ms_range"]
            paired = _paired(rows, label, base_label)
            choices = sorted(
                {c for r in rows if r["label"] == label for c in r.get("auto_choices", [])}
            )
            lines.append(
                f"| {label} | {agg['step_ms']:.1f} [{low:.0f}-{high:.0f}] | "
                f"{agg['samples_per_s']:.0f} | {ratio} | {paired} | "
                f"{agg['link_sent_mb_per_step']:.2f} | {agg['link_received_mb_per_step']:.2f} | "
                f"{', '.join(choices)} |"
            )
        lines += _per_host_table(rows)
        acc_rows = [r for r in rows if r["task"] == "accuracy"]
        if acc_rows:
            base_t = ddp.get("accuracy", {}).get("time_to_target_s")
            lines += [
                "",
                f"Accuracy: the demo's digits CNN, Adam lr {result['lr']}, batch "
                f"{result['batch']} per rank, {result['epochs']} epochs; time to "
                f"{result['target']:.0%} test accuracy (training seconds, evaluation untimed).",
                "",
                f"| system | time to {result['target']:.0%} s | vs DDP | final accuracy | "
                "training s | link MB/step out |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            lines += _to_target_rows(acc_rows, base_t, 6, lambda r, t, speed: (
                f"| {r['label']} | {_fmt(t, '.2f')} | {speed} | {r['final_accuracy']:.2%} | "
                f"{r['train_s']:.2f} | {r['link_sent_mb_per_step']:.3f} |"
            ))  # fmt: skip
        lines += _tta_table(result, rows)
        lines.append("")
    return lines


def _per_host_table(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 51 at one rate: each compressor once per host (or decided per bucket: auto)
    against itself flat and against uncompressed commlayer (none), samples/s per round, and
    the accuracy task's final accuracy of both where it ran."""
    speeds = throughputs(rows)
    pairs = [(host, flat) for host, flat in PER_HOST if host in speeds and flat in speeds]
    if not pairs:
        return []
    accuracy = {r["label"]: r for r in rows if r["task"] == "accuracy" and "error" not in r}
    lines = [
        "",
        "Once per host (issue 51): a compressor with the host's ranks summing each bucket "
        "first (host) or deciding per bucket (auto), against itself flat (every rank its own "
        "gradients) and against uncompressed commlayer, samples/s over the baseline's in the "
        "same round: median [min-max].",
        "",
        "| compressor | samples/s | flat samples/s | vs flat per round | vs none per round | "
        "link MB/step out (vs flat) | final accuracy (flat) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for host, flat in pairs:
        h, f = speeds[host], speeds[flat]
        if "error" in h or "error" in f:
            lines.append(f"| {host} | failed | | | | | |")
            continue
        scored = host in accuracy and flat in accuracy
        final = (
            f"{accuracy[host]['final_accuracy']:.2%} ({accuracy[flat]['final_accuracy']:.2%})"
            if scored
            else "—"
        )
        lines.append(
            f"| {host} | {h['samples_per_s']:.0f} | {f['samples_per_s']:.0f} | "
            f"{_paired(rows, host, flat)} | {_paired(rows, host, 'none')} | "
            f"{h['link_sent_mb_per_step']:.2f} ({f['link_sent_mb_per_step']:.2f}) | {final} |"
        )
    return lines


def _tta_table(result: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Task tta at one rate: time to the target against uncompressed commlayer (``none``)."""
    tta_rows = [r for r in rows if r["task"] == "tta"]
    if not tta_rows:
        return []
    base = next((r for r in tta_rows if r["label"] == "none" and "error" not in r), {})
    base_t = base.get("time_to_target_s")
    params = next((r["parameters"] for r in tta_rows if "parameters" in r), 0)
    lines = [
        "",
        f"Time to accuracy of a link-bound model: the anchor MLP on Fashion-MNIST "
        f"(`fashion_mlp`, {params / 1e6:.2f} M parameters), Adam lr {result['tta_lr']}, batch "
        f"{result['batch']} per rank; training seconds until the first score (every "
        f"{result['eval_every']} steps, 2000 test images, untimed) at or above "
        f"{result['tta_target']:.0%}.",
        "",
        f"| system | time to {result['tta_target']:.0%} s | vs none | steps to it | step ms | "
        "final accuracy | link MB/step out | auto chose |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    return lines + _to_target_rows(tta_rows, base_t, 8, lambda r, t, speed: (
        f"| {r['label']} | {_fmt(t, '.1f')} | {speed} | {_fmt(r['steps_to_target'], 'd')} | "
        f"{r['step_ms']:.0f} | {r['final_accuracy']:.2%} | {r['link_sent_mb_per_step']:.3f} "
        f"| {', '.join(sorted(set(r.get('auto_choices', []))))} |"
    ))  # fmt: skip


def _to_target_rows(
    runs: list[dict[str, Any]],
    base_t: float | None,
    columns: int,
    cells: Callable[[dict[str, Any], float | None, str], str],
) -> list[str]:
    """A table row per run: ``cells(run, its time to the target, its speed-up over base_t)``,
    or the run's label and "failed" in a table of ``columns`` columns."""
    out = []
    for r in runs:
        if "error" in r:
            out.append(f"| {r['label']} | failed |" + " |" * (columns - 2))
            continue
        t = r["time_to_target_s"]
        out.append(cells(r, t, _fmt(base_t / t if (base_t and t) else None, ".2f")))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["rates"]
    measured = {r["label"] for r in result["runs"]}
    labels = [label for label, *_ in SYSTEMS if label in measured]
    curves = "tta" if any(r["task"] == "tta" for r in result["runs"]) else "accuracy"
    has_throughput = any(r["task"] == "throughput" for r in result["runs"])
    # accuracy curves: the first rate's (digits CNN), or every rate's (tta)
    curve_rates = [] if not any(r["task"] == curves for r in result["runs"]) else (
        rates if curves == "tta" else rates[:1]
    )  # fmt: skip
    panels = int(has_throughput) + len(curve_rates)
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels if panels > 1 else 8, 6))
    axes = list(axes) if panels > 1 else [axes]
    if has_throughput:
        _throughput_panel(axes.pop(0), result, labels)
    for ax, rate in zip(axes, curve_rates, strict=True):
        _accuracy_panel(ax, result, curves, rate)
    fig.suptitle(
        f"{result['hosts']} hosts x {result['ranks_per_host']} rank(s) each, namespace cluster "
        "(veth + tbf), 2-core VM"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput_panel(left: Any, result: dict[str, Any], labels: list[str]) -> None:
    """samples/s per system, a bar per rate, whiskers the runs' range."""
    rates = result["rates"]
    width = 0.8 / len(rates)
    for i, rate in enumerate(rates):
        rows = [r for r in result["runs"] if r["rate"] == rate]
        got = {k: v for k, v in throughputs(rows).items() if "error" not in v}
        shown = [label for label in labels if label in got]
        xs = [j + i * width for j, label in enumerate(labels) if label in got]
        speed = [got[label]["samples_per_s"] for label in shown]
        # the runs' range: samples/s scale inversely with step time
        spread = [
            [v - v * got[k]["step_ms"] / got[k]["step_ms_range"][1] for k, v in zip(shown, speed)],
            [v * got[k]["step_ms"] / got[k]["step_ms_range"][0] - v for k, v in zip(shown, speed)],
        ]
        left.bar(xs, speed, width, yerr=spread, capsize=2, label=rate)
    left.set_xticks([j + width * (len(rates) - 1) / 2 for j in range(len(labels))])
    left.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    model = result.get("model", "mlp")
    params = result.get("parameters", {}).get(model, 6.69e6)
    left.set_ylabel(f"samples/s ({model}, {params / 1e6:.2f} M parameters)")
    left.set_title("training throughput (bars: median of the runs, whiskers: their range)")
    left.legend(title="link")
    left.grid(axis="y", alpha=0.3)


def _accuracy_panel(right: Any, result: dict[str, Any], task: str, first: str) -> None:
    """Test accuracy against training seconds at rate ``first``, one line per system (task
    ``accuracy``: the digits CNN; ``tta``: the Fashion-MNIST MLP, seconds on a log axis)."""
    import matplotlib

    right.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)  # 17 systems, distinct
    for r in result["runs"]:
        if r["rate"] == first and r["task"] == task and "error" not in r:
            curve = r["curve"]
            style = {"linewidth": 2.5, "color": "black"} if r["label"] == "ddp" else {}
            right.plot(
                [p["train_s"] for p in curve],
                [100 * p["accuracy"] for p in curve],
                marker="o",
                markersize=2,
                label=r["label"],
                **style,
            )
    target = result["tta_target"] if task == "tta" else result["target"]
    right.axhline(100 * target, color="grey", linestyle=":")
    right.set_xlabel("training seconds")
    right.set_ylabel("test accuracy %")
    right.set_ylim(*((60, 90) if task == "tta" else (80, 100)))
    right.set_title(f"{'Fashion-MNIST MLP' if task == 'tta' else 'digits CNN'} at {first}")
    if task == "tta":
        import matplotlib.ticker

        right.set_xscale("log")
        right.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.legend(fontsize=7, ncol=2, loc="lower right")
    right.grid(alpha=0.3)


def driver(args: argparse.Namespace) -> None:
    hosts, per_host = args.layout
    chosen = [s for s in SYSTEMS if not args.systems or s[0] in args.systems]
    unknown = set(args.systems or ()) - {s[0] for s in SYSTEMS}
    if unknown:
        sys.exit(f"unknown systems {sorted(unknown)}; known: {[s[0] for s in SYSTEMS]}")
    result: dict[str, Any] = {
        "date": str(datetime.date.today()),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": "sudo OMP_NUM_THREADS=1 python benchmarks/network_train.py " + " ".join(
            sys.argv[1:]
        ),
        "hosts": hosts, "ranks_per_host": per_host, "rates": args.rates,
        "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "epochs": args.epochs, "target": args.target, "lr": args.lr, "runs": [],
        "model": args.model, "parameters": {},
        "tta_target": args.tta_target, "tta_lr": args.tta_lr, "eval_every": args.eval_every,
    }  # fmt: skip
    tag = f"network_train_{'_'.join(args.rates)}_{hosts}x{per_host}"
    tag += f"_{args.suffix}" if args.suffix else ""
    args.out.mkdir(parents=True, exist_ok=True)
    require_no_cluster()
    try:
        cluster("up", str(hosts))
        for rate in args.rates:
            for k in range(1, hosts + 1):
                cluster("set", f"node{k}", "--rate", rate)
            for task in args.tasks:
                # throughput: rounds over every system in turn, so a drift of the machine's
                # speed spreads over all of them instead of landing on a few
                rounds = args.rounds if task == "throughput" else 1
                for round_ in range(rounds):
                    for entry in chosen:
                        run = run_one(args, entry, task)
                        run.update(rate=rate, round=round_)
                        result["runs"].append(run)
                        if task == "throughput" and "parameters" in run:
                            result["parameters"][args.model] = run["parameters"]
                        keys = (
                            "auto_choices",
                            "step_ms",
                            "samples_per_s",
                            "link_sent_mb_per_step",
                            "time_to_target_s",
                            "final_accuracy",
                            "error",
                        )
                        summary = {k: run[k] for k in keys if k in run}
                        print(f"{rate} {task} {round_} {entry[0]}: {summary}", flush=True)
                        (args.out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    finally:
        cluster("down")
    report(result, args.out / f"{tag}.json")


def report(result: dict[str, Any], path: Path) -> None:
    """The .md (tables) and .png beside the .json ``path``; printed too."""
    hosts, per_host = result["hosts"], result["ranks_per_host"]
    lines = [
        f"# training across {hosts} hosts x {per_host} ranks",
        "",
        f"{result['date']}, {result['machine']}, `{result['command']}` (scripts/cluster.sh: "
        "veth + tbf, no delay, no loss; MPI over TCP with UCX_TLS=tcp,self; DDP over gloo on "
        "eth0). 2-core VM: the ranks and the links' traffic share 2 cores.",
        "",
        *tables(result),
    ]
    path.with_suffix(".md").write_text("\n".join(lines))
    plot(result, path.with_suffix(".png"))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda s: s.split(","), default=["1gbit", "10gbit"])
    parser.add_argument("--layout", type=layout, default=(2, 1), help="HOSTSxRANKS, e.g. 2x1")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS))
    parser.add_argument("--systems", type=lambda s: s.split(","), help="labels, default all")
    parser.add_argument("--steps", type=int, default=10)
    # Steps before timing: auto's tuning explores its candidates for the first 6 calls of each
    # (autotune.round_calls: 12-24 calls per size class, one call per bucket and step). With 4,
    # uncompressed commlayer was timed while exploring: 0.73-0.82x DDP at 1 Gbit/s, 0.96-0.98x
    # with 24 (results/network_train_1gbit_2x1_tuned.md).
    parser.add_argument("--warmup", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="throughput runs per system")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=["mlp", "resnet"], default="mlp",
                        help="throughput: benchmarks/train.py's model")  # fmt: skip
    parser.add_argument("--tta-target", type=float, default=0.84, help="tta: test accuracy")
    parser.add_argument("--tta-lr", type=float, default=1e-4, help="tta: Adam's lr")
    parser.add_argument("--tta-max-steps", type=int, default=1500)
    parser.add_argument("--eval-every", type=int, default=25, help="tta: steps between scores")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--suffix", help="appended to the result files' names")
    parser.add_argument("--replot", type=Path, help="the .md and .png again from this .json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--task", choices=TASKS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.replot:
        report(json.loads(args.replot.read_text()), args.replot)
    else:
        for rate in args.rates:
            rate_bits(rate)
        driver(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
