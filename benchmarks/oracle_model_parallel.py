"""The oracle against measured model-parallel runs: examples/model_parallel_cnn.py each way.

    OMP_NUM_THREADS=1 python benchmarks/oracle_model_parallel.py [--np 2] [--out F]

1. Profile: the CNN trained by one process (``--strategy data`` at 1 rank, float32), its
   seconds per sample spread over the layers by FLOPs (torchmodel.py on the meta device).
2. Predict, per strategy and rank count: ``oracle.predict`` with the split layers as the
   example splits them (filter and spatial: both convolutions; channel: the second), the
   batch as it runs it (model parallelism: every rank the whole batch, ``--batch-per-gpu B``;
   data: B / ranks each; data+filter and data+spatial: groups of ``--model-ways`` ranks,
   B / groups each, measured where there are at least 2 groups; pipeline: B / ranks per rank
   as GPipe's ``b p``, ``--micro-batches``, the example cut where the oracle cuts, measured
   where the 3 layers give every rank a stage), communication from this machine's committed
   calibrations.
3. Measure: the example under ``mpiexec -n N``, median step.
Accuracy 1 - |predicted - measured| / measured; and whether the oracle ranks the strategies
as measured. This machine is the platform: one node of ``--cores`` cores (CORES_PER_NODE:
ranks beyond them compute ranks / cores times slower). The prediction is given twice: as the
calibration alone makes it, and with the engine's cost per collective call (``op_latency_s``:
the median of 50 blocking 4-byte allreduces at that rank count, measured just before,
independent of the runs predicted). As benchmarks/oracle.py: ``--rounds`` rounds; every run
preceded at once by its own profile and op latency, the three by a wait for a quiet machine
(``--quiet-load``); median over rounds [min-max], accuracy per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "model_parallel_cnn.py"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(EXAMPLE.parent))

from oracle import runnable_now, spread, this_machine, wait_quiet  # noqa: E402

from commlayer import costmodel  # noqa: E402
from commlayer import oracle as cl_oracle  # noqa: E402
from commlayer.oracle import torchmodel  # noqa: E402

STRATEGIES = ("data", "filter", "channel", "spatial", "pipeline", "data+filter", "data+spatial")


def applies(strategy: str, ranks: int, args: argparse.Namespace) -> bool:
    """Whether the example runs ``strategy`` at ``ranks`` (a hybrid: with 2 groups or more)."""
    from model_parallel_cnn import arguments_problem

    run = argparse.Namespace(**{**vars(args), "strategy": strategy, "cuts": None})
    if strategy.startswith("data+") and ranks < 2 * args.model_ways:
        return False
    return arguments_problem(run, ranks) is None


def cuts_of(net: cl_oracle.Net, ranks: int) -> str:
    """The oracle's pipeline stages (balanced compute) as the example's ``--cuts``."""
    times = net.layer_times_s(1.0, per_layer=True)
    parts = cl_oracle.model.stages(times, ranks)
    if parts is None:
        raise ValueError(f"pipeline: no {ranks} stages of {len(times)} layers")
    return ",".join(str(first) for first, _ in parts[1:])


def run_example(
    strategy: str, ranks: int, args: argparse.Namespace, cuts: str | None = None
) -> float:
    command = [
        "mpiexec", "-n", str(ranks), sys.executable, str(EXAMPLE), "--strategy", strategy,
        "--dtype", "float32", "--batch", str(args.batch), "--size", str(args.size),
        "--channels", str(args.channels), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--model-ways", str(args.model_ways),
        "--micro-batches", str(args.micro_batches),
    ]  # fmt: skip
    if cuts:
        command += ["--cuts", cuts]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(json.loads(line[7:])["step_ms"]) / 1e3
    raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


OP_LATENCY = """
import statistics, time, torch, commlayer as cl
cl.init(); t = torch.zeros(1)
for _ in range(10): cl.allreduce(t)
times = []
for _ in range(50):
    start = time.perf_counter(); cl.allreduce(t); times.append(time.perf_counter() - start)
if cl.rank() == 0: print("RESULT", statistics.median(times))
cl.shutdown()
"""


def engine_op_latency_s(ranks: int) -> float:
    command = ["mpiexec", "-n", str(ranks), sys.executable, "-c", OP_LATENCY]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(line.split()[1])
    raise RuntimeError(f"op latency run failed:\n{done.stdout}\n{done.stderr}")


def layer_shares(args: argparse.Namespace) -> dict[str, float]:
    """Each convolution's share of the one-process step (forward + backward, in this process,
    the fastest of 40 interleaved runs), the rest (ReLUs, pooling, the FC, the loss, SGD, the
    autograd calls) on ``fc``: on a CPU that rest is not in proportion to FLOPs (here 27-41%
    of the step for under 1% of its FLOPs), and the FC is replicated by every strategy, as the
    rest is, so the step is spread over the layers as measured, not by FLOPs."""
    import torch
    import torch.nn.functional as F
    from model_parallel_cnn import build

    model = build(args.channels, "float32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(args.batch, 3, args.size, args.size)
    hidden = torch.randn(args.batch, args.channels, args.size, args.size, requires_grad=True)
    y = torch.randint(0, 10, (args.batch,))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    parts: dict[str, Any] = {
        "step": step,
        "conv1": lambda: model.conv1(x).sum().backward(),
        "conv2": lambda: model.conv2(hidden).sum().backward(),
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    for rep in range(45):  # interleaved, so that a change of the machine's load hits all three
        for name, fn in parts.items():
            start = time.perf_counter()
            fn()
            if rep >= 5:
                times[name].append(time.perf_counter() - start)
    # the fastest of each: the run no other job interrupted (the medians moved 2-3x with load)
    whole, conv1, conv2 = (min(times[n]) for n in ("step", "conv1", "conv2"))
    shares = {"conv1": conv1 / whole, "conv2": conv2 / whole}
    shares["fc"] = max(0.0, 1.0 - shares["conv1"] - shares["conv2"])
    return shares


def net_of(
    args: argparse.Namespace, per_sample_s: float, shares: dict[str, float]
) -> cl_oracle.Net:
    """The example's CNN as it runs (``--channels``, float32), the profile spread by
    ``shares``."""
    from model_parallel_cnn import build

    net = torchmodel.describe_model(
        functools.partial(build, args.channels, "float32"),
        f"3x{args.size}x{args.size}",
        1,
        "model_parallel_cnn:build",
    )
    layers = [
        dataclasses.replace(la, t_s=per_sample_s * shares.get(la.name.split("_", 1)[-1], 0.0))
        for la in net.layers
    ]
    return dataclasses.replace(net, layers=tuple(layers))


def mask_of(net: cl_oracle.Net, strategy: str) -> tuple[bool, ...]:
    split = {"filter": ("conv1", "conv2"), "spatial": ("conv1", "conv2"), "channel": ("conv2",)}
    names = split.get(strategy.removeprefix("data+"), ("conv1", "conv2"))
    return tuple(any(la.name.endswith(n) for n in names) for la in net.layers)


def predict_s(
    net: cl_oracle.Net,
    strategy: str,
    ranks: int,
    args: argparse.Namespace,
    cals: list,
    op_latency_s: float,
) -> float:
    per_gpu: float = args.batch
    if strategy in ("data", "pipeline"):  # pipeline: B = b p
        per_gpu = args.batch / ranks
    elif strategy.startswith("data+"):
        per_gpu = args.batch / (ranks // args.model_ways)
    (row,) = cl_oracle.predict(
        net, this_machine(ranks, args.cores), strategy, [ranks],
        batch_per_gpu=per_gpu,  # type: ignore[arg-type]
        mask=mask_of(net, strategy), calibrations=cals, op_latency_s=op_latency_s,
        micro_batches=args.micro_batches, model_ways=args.model_ways,
    )  # fmt: skip
    return row.iter_s


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-ways", type=int, default=2, help="hybrids' group size")
    parser.add_argument("--micro-batches", type=int, default=4, help="pipeline's GPipe m")
    parser.add_argument(
        "--strategies",
        type=lambda s: s.split(","),
        default=list(STRATEGIES),
        help="comma list of " + ", ".join(STRATEGIES),
    )
    parser.add_argument("--quiet-load", type=float, help="wait for at most this many runnable")
    parser.add_argument("--quiet-wait-s", type=float, default=120.0)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out")
    parser.add_argument("--repredict", help="a .jsonl of earlier runs: predict them again")
    return parser.parse_args()


def measure(args: argparse.Namespace, cals: list, shares: dict[str, float]) -> list[dict]:
    """Every round, rank count and strategy: a quiet wait, the one-process profile, the op
    latency, at once the run they predict, and the load after; one record each."""
    records = []
    for round_ in range(args.rounds):
        for ranks in args.np:
            for strategy in args.strategies:
                if not applies(strategy, ranks, args):
                    continue
                load = wait_quiet(args.quiet_load, args.quiet_wait_s)
                single_s = run_example("data", 1, args)
                op_latency_s = engine_op_latency_s(ranks)
                net = net_of(args, single_s / args.batch, shares)
                cuts = cuts_of(net, ranks) if strategy == "pipeline" else None
                measured_s = run_example(strategy, ranks, args, cuts)
                after = runnable_now(1.0, 10)
                record = {
                    "round": round_, "strategy": strategy, "ranks": ranks, "cuts": cuts,
                    "model_ways": args.model_ways, "micro_batches": args.micro_batches,
                    "profile_s": single_s, "load": load, "load_after": after,
                    "quiet": args.quiet_load is not None
                    and max(load["runnable"], after) <= args.quiet_load,
                    "op_latency_s": op_latency_s, "measured_s": measured_s,
                    "plain_s": predict_s(net, strategy, ranks, args, cals, 0.0),
                    "latency_s": predict_s(net, strategy, ranks, args, cals, op_latency_s),
                }  # fmt: skip
                for key in ("plain", "latency"):
                    got = record[f"{key}_s"]
                    record[f"{key}_accuracy"] = 1 - abs(got - measured_s) / measured_s
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


def _order(records: list[dict], key: str) -> list[str]:
    return [r["strategy"] for r in sorted(records, key=lambda r: r[key])]


def report(args: argparse.Namespace, records: list[dict]) -> str:
    loads = [r["load"]["runnable"] for r in records] + [r["load_after"] for r in records]
    lines = [
        "# the oracle against measured model-parallel steps of examples/model_parallel_cnn.py",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{args.cores} cores, niceness {os.nice(0)}, {args.rounds} round(s); other jobs' "
        f"runnable threads before and after each run {spread(loads)} (quiet wait: <= "
        f"{args.quiet_load} for at most {args.quiet_wait_s:.0f} s), 1-minute load average "
        f"{spread([r['load']['load1'] for r in records])}; batch {args.batch} of "
        f"3x{args.size}x{args.size}, {args.channels} channels, float32, median of "
        f"{args.steps} steps after {args.warmup}",
        "",
        f"`python benchmarks/oracle_model_parallel.py --np {','.join(map(str, args.np))} "
        f"--batch {args.batch} --size {args.size} --channels {args.channels} "
        f"--steps {args.steps} --rounds {args.rounds} --model-ways {args.model_ways} "
        f"--micro-batches {args.micro_batches} --strategies {','.join(args.strategies)}"
        + (f" --quiet-load {args.quiet_load}" if args.quiet_load else "")
        + (f" --repredict {args.repredict}`" if args.repredict else "`"),
        "",
        "Median over rounds [min-max]; each round's prediction from its own profile and op "
        "latency.",
        "",
        "| strategy | ranks | measured step ms | predicted ms | accuracy | predicted with the "
        "engine's op latency, ms | accuracy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| one process | 1 | {spread([r['profile_s'] for r in records], scale=1e3)} "
        "| (the profile, before each run) | | | |",
    ]
    for ranks in args.np:
        at = [r for r in records if r["ranks"] == ranks]
        latency = [r["op_latency_s"] for r in at]
        lines.append(
            f"| (engine op latency at {ranks} ranks: {spread(latency, '{:.2f}', 1e3)} ms) |||||||"
        )
        for strategy in STRATEGIES:
            rs = [r for r in at if r["strategy"] == strategy]
            if not rs:
                continue
            lines.append(
                f"| {strategy} | {ranks} | {spread([r['measured_s'] for r in rs], scale=1e3)} | "
                f"{spread([r['plain_s'] for r in rs], scale=1e3)} | "
                f"{spread([r['plain_accuracy'] for r in rs], '{:.1%}')} | "
                f"{spread([r['latency_s'] for r in rs], scale=1e3)} | "
                f"{spread([r['latency_accuracy'] for r in rs], '{:.1%}')} |"
            )
    lines.append("")
    for ranks in args.np:
        for round_ in range(args.rounds):
            rs = [r for r in records if r["ranks"] == ranks and r["round"] == round_]
            if not rs:
                continue
            measured, predicted = _order(rs, "measured_s"), _order(rs, "latency_s")
            same = "same" if measured == predicted else "different"
            lines.append(
                f"- {ranks} ranks, round {round_ + 1}: measured fastest first "
                f"{', '.join(measured)}; predicted (with op latency) {', '.join(predicted)} "
                f"({same})"
            )
    lines.append("")
    for key in ("plain", "latency"):
        label = "calibration alone" if key == "plain" else "with op latency"
        per_round = [
            statistics.mean(r[f"{key}_accuracy"] for r in records if r["round"] == i)
            for i in range(args.rounds)
        ]
        calm = [r[f"{key}_accuracy"] for r in records if r["quiet"]]
        lines.append(
            f"- average accuracy, {label}: {statistics.mean(per_round):.1%} over "
            f"{len(records) // args.rounds} cases (rounds: "
            f"{', '.join(f'{a:.1%}' for a in per_round)})"
            + (
                f"; over the {len(calm)} runs with other jobs' runnable threads <= "
                f"{args.quiet_load} before and after: {statistics.mean(calm):.1%}"
                if calm
                else ""
            )
        )
    return "\n".join(lines)


def repredict(args: argparse.Namespace, cals: list, shares: dict[str, float]) -> list[dict]:
    """The runs recorded in ``args.repredict`` (this script's .jsonl) predicted again with
    this version of the model, from each run's own profile and op latency."""
    records = [json.loads(line) for line in Path(args.repredict).read_text().splitlines()]
    for record in records:
        net = net_of(args, record["profile_s"] / args.batch, shares)
        for key, latency in (("plain", 0.0), ("latency", record["op_latency_s"])):
            got = predict_s(net, record["strategy"], record["ranks"], args, cals, latency)
            record[f"{key}_s"] = got
            record[f"{key}_accuracy"] = 1 - abs(got - record["measured_s"]) / record["measured_s"]
    args.np = sorted({r["ranks"] for r in records})
    args.rounds = max(r["round"] for r in records) + 1
    return records


def main() -> int:
    args = _arguments()
    paths = sorted((HERE / "results").glob("algorithms_np*.calibration.json"))
    cals = [c for p in paths for c in costmodel.load_all(p)]
    shares = layer_shares(args)
    print(f"layer shares of the one-process step: {shares}", flush=True)
    records = repredict(args, cals, shares) if args.repredict else measure(args, cals, shares)
    text = report(args, records).replace(
        "\n\nMedian over rounds",
        "\n\nThe profile spread over the layers by a per-layer one-process profile: "
        + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
        + (f" (runs of {args.repredict}, predicted again)" if args.repredict else "")
        + ".\n\nMedian over rounds",
        1,
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
