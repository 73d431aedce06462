"""The oracle against measured runs on this machine: data parallelism of train.py's models.

    OMP_NUM_THREADS=1 python benchmarks/oracle.py [--np 1,2,3,4] [--models mlp,resnet] \
        [--rounds 3] [--quiet-load 1.5] [--calibration F ...] [--out F]

1. Profile: one process trains the model alone (``train.py --worker single``: zero_grad,
   forward, backward, SGD step on random inputs, median step); its seconds per sample are the
   model's compute, spread over the layers by FLOPs as ParaDL spreads a profiled total
   (torchmodel.py counts them on the meta device).
2. Predict: ``oracle.predict`` for data parallelism at each rank count on this machine as a
   platform: one node of ``--cores`` cores (CORES_PER_NODE: ranks beyond the cores compute
   ranks / cores times slower and overlap nothing), communication from the calibrations given
   (``commlayer calibrate`` on this machine, as committed with the algorithm benchmarks), the
   gradient buckets overlapped with backward. Also shown: the same as if every rank had a
   device of its own (the GPU model, no CORES_PER_NODE), to see what the cores change.
3. Measure: ``train.py --worker commlayer`` under ``mpiexec -n N`` (DistributedOptimizer),
   median step.
This machine is shared: other jobs' load changes a profile several-fold within minutes. So
the measurement is repeated in ``--rounds`` rounds; in each, every run is preceded at once by
its own profile, and both by a wait (at most ``--quiet-wait-s``) until the runnable threads of
other jobs, sampled from /proc/loadavg, average at most ``--quiet-load``; the figure before
and after the pair and the 1-minute load average are recorded, and a pair with both at most
``--quiet-load`` counts as quiet. Accuracy is 1 - |predicted - measured| /
measured per round (each round's prediction from its own profile); the table gives the median
over rounds and the range. ``--measured train.md``: read one round from a table train.py wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train  # noqa: E402

from commlayer import costmodel, oracle  # noqa: E402
from commlayer.oracle import torchmodel  # noqa: E402

INPUTS = {"mlp": "768", "resnet": "3x32x32"}


def profiled_net(model: str, seconds_per_sample: float) -> oracle.Net:
    """The model's layers with the measured total on the first, as a ``*_profall`` file."""
    net = torchmodel.describe(f"train:{model}", INPUTS[model], 1)
    first = dataclasses.replace(net.layers[0], t_s=seconds_per_sample)
    rest = tuple(dataclasses.replace(la, t_s=0.0) for la in net.layers[1:])
    return dataclasses.replace(net, layers=(first, *rest))


def this_machine(ranks: int, cores: int | None = None) -> oracle.Platform:
    """One node holding every rank, its ``cores`` shared by them (None: a device per rank);
    the network figures come from the calibrations."""
    return oracle.Platform(
        mem_per_gpu_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        gpu_speed_flops=1.0,
        bandwidth_bytes_s=1e9,
        latency_s=1e-5,
        max_gpus=max(ranks, 1),
        gpus_per_node=max(ranks, 1),
        path=platform.node(),
        cores_per_node=cores,
    )


def predict_step_s(
    net: oracle.Net, ranks: int, batch: int, cals: list[Any], cores: int | None
) -> dict[str, Any]:
    (row,) = oracle.predict(
        net,
        this_machine(ranks, cores),
        "data",
        [ranks],
        batch_per_gpu=batch,
        calibrations=cals,
    )
    return {
        "step_s": row.iter_s,
        "comp_s": row.tcomp_s / row.iterations,
        "comm_s": row.tcomm_s / row.iterations,
        "hidden_s": row.hidden_s / row.iterations,
    }


# -- the machine's load ---------------------------------------------------------------------------
def runnable_now(seconds: float = 2.0, samples: int = 20) -> float:
    """Runnable threads on the machine, averaged over ``seconds`` (/proc/loadavg's 4th field,
    less this sampling process itself)."""
    total = 0.0
    for _ in range(samples):
        with open("/proc/loadavg") as f:
            total += int(f.read().split()[3].split("/")[0]) - 1
        time.sleep(seconds / samples)
    return total / samples


def wait_quiet(limit: float | None, wait_s: float) -> dict[str, float]:
    """Wait until ``runnable_now() <= limit`` or ``wait_s`` passed; what was seen."""
    start = time.monotonic()
    seen = runnable_now()
    while limit is not None and seen > limit and time.monotonic() - start < wait_s:
        time.sleep(3.0)
        seen = runnable_now()
    return {"runnable": seen, "load1": os.getloadavg()[0], "waited_s": time.monotonic() - start}


def spread(values: list[float], fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    """``median [min-max]`` (the median alone for one value)."""
    med = statistics.median(values) * scale
    if len(values) == 1:
        return fmt.format(med)
    lo, hi = min(values) * scale, max(values) * scale
    return f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def read_table(path: Path) -> dict[tuple[str, str, int], float]:
    """(model, system, ranks) -> step ms, from the first table of a train.py results file."""
    steps = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[1].isdigit():
            try:
                steps.setdefault((cells[0], cells[2], int(cells[1])), float(cells[3]))
            except ValueError:
                continue
    return steps


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["mlp", "resnet"])
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        help="calibration file(s); default the committed algorithms_np*.json",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-load", type=float, help="wait for at most this many runnable")
    parser.add_argument("--quiet-wait-s", type=float, default=120.0)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--measured", help="train.py's table to read instead of running")
    parser.add_argument("--out", help="also write the markdown report here")
    args = parser.parse_args()
    if args.measured:
        args.rounds = 1
    return args


def measure(args: argparse.Namespace, cals: list[Any]) -> list[dict[str, Any]]:
    """Every round, model and rank count: a quiet wait, the one-process profile, at once the
    run it predicts, and the load after; one record each."""
    table = read_table(Path(args.measured)) if args.measured else {}
    records = []
    for round_ in range(args.rounds):
        for model in args.models:
            for ranks in args.np:
                load = wait_quiet(args.quiet_load, args.quiet_wait_s)
                if args.measured:
                    single_ms = table[(model, "single", 1)]
                    measured_ms = table[(model, "commlayer", ranks)]
                else:
                    single_ms = float(train.run_one(args, "single", model, 1)["step_ms"])
                    measured_ms = float(train.run_one(args, "commlayer", model, ranks)["step_ms"])
                after = runnable_now(1.0, 10)
                net = profiled_net(model, single_ms / 1e3 / args.batch)
                record = {
                    "round": round_,
                    "model": model,
                    "ranks": ranks,
                    "profile_ms": single_ms,
                    "load": load,
                    "load_after": after,
                    "quiet": args.quiet_load is not None
                    and max(load["runnable"], after) <= args.quiet_load,
                    "measured_s": measured_ms / 1e3,
                    "cores": predict_step_s(net, ranks, args.batch, cals, args.cores),
                    "gpu": predict_step_s(net, ranks, args.batch, cals, None),
                }
                for key in ("cores", "gpu"):
                    got, real = record[key]["step_s"], record["measured_s"]
                    record[key]["accuracy"] = 1 - abs(got - real) / real
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


def report(args: argparse.Namespace, cals: list[Any], records: list[dict[str, Any]]) -> str:
    loads = [r["load"]["runnable"] for r in records] + [r["load_after"] for r in records]
    load1 = [r["load"]["load1"] for r in records]
    lines = [
        f"# the oracle against measured data-parallel steps (batch {args.batch} per rank)",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()},"
        f" {args.cores} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"niceness {os.nice(0)}, {args.rounds} round(s); "
        + (
            f"steps read from the first table of {args.measured}"
            if args.measured
            else f"other jobs' runnable threads before and after each run {spread(loads)} "
            f"(quiet wait: <= {args.quiet_load} for at most {args.quiet_wait_s:.0f} s), "
            f"1-minute load average {spread(load1)}"
        )
        + "; calibrations: "
        + ", ".join(f"{c.size} ranks on {c.nodes} node(s) ({c.host} {c.date})" for c in cals),
        "",
        f"`python benchmarks/oracle.py --np {','.join(map(str, args.np))} --models "
        f"{','.join(args.models)} --steps {args.steps} --warmup {args.warmup} --rounds "
        f"{args.rounds}"
        + (f" --quiet-load {args.quiet_load}" if args.quiet_load else "")
        + (f" --measured {args.measured}`" if args.measured else "`"),
        "",
        "Median over rounds [min-max]; each round's prediction from its own profile.",
        "",
        f"| model | ranks | profile ms | measured step ms | predicted ms, {args.cores} cores "
        "(comp + comm - hidden) | accuracy | predicted, a device per rank | accuracy |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    cases: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        cases.setdefault((r["model"], r["ranks"]), []).append(r)
    for (model, ranks), rs in cases.items():
        c = [r["cores"] for r in rs]
        comp, comm, hidden = (
            statistics.median(x[k] for x in c) * 1e3 for k in ("comp_s", "comm_s", "hidden_s")
        )
        parts = (
            f"{spread([x['step_s'] for x in c], scale=1e3)} "
            f"({comp:.1f} + {comm:.1f} - {hidden:.1f})"
        )
        lines.append(
            f"| {model} | {ranks} | {spread([r['profile_ms'] for r in rs])} | "
            f"{spread([r['measured_s'] for r in rs], scale=1e3)} | {parts} | "
            f"{spread([x['accuracy'] for x in c], '{:.1%}')} | "
            f"{spread([r['gpu']['step_s'] for r in rs], scale=1e3)} | "
            f"{spread([r['gpu']['accuracy'] for r in rs], '{:.1%}')} |"
        )
    lines.append("")
    quiet = [r for r in records if r["quiet"]]
    for label, keep in (("every rank count", lambda n: True), ("2-4 ranks", lambda n: n > 1)):
        for key, name in (("cores", f"{args.cores} cores"), ("gpu", "a device per rank")):
            per_round = [
                statistics.mean(
                    r[key]["accuracy"] for r in records if r["round"] == i and keep(r["ranks"])
                )
                for i in range(args.rounds)
                if any(r["round"] == i and keep(r["ranks"]) for r in records)
            ]
            calm = [r[key]["accuracy"] for r in quiet if keep(r["ranks"])]
            if per_round:
                lines.append(
                    f"- average accuracy, {label}, {name}: {statistics.mean(per_round):.1%} "
                    f"(rounds: {', '.join(f'{a:.1%}' for a in per_round)})"
                    + (
                        f"; over the {len(calm)} runs with other jobs' runnable threads <= "
                        f"{args.quiet_load} before and after: {statistics.mean(calm):.1%}"
                        if calm
                        else ""
                    )
                )
    return "\n".join(lines)


def main() -> int:
    args = _arguments()
    paths = args.calibration or sorted(
        str(p) for p in (HERE / "results").glob("algorithms_np*.calibration.json")
    )
    cals = [c for p in paths for c in costmodel.load_all(Path(p))]
    records = measure(args, cals)
    text = report(args, cals, records)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
