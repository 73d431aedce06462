"""The oracle against measured runs on this machine: data parallelism of train.py's models.

    OMP_NUM_THREADS=1 python benchmarks/oracle.py [--np 2,4] [--models mlp,resnet] \
        [--calibration benchmarks/results/algorithms_np2.calibration.json ...] [--out F]

1. Profile: one process trains the model alone (``train.py --worker single``: zero_grad,
   forward, backward, SGD step on random inputs, median step); its seconds per sample are the
   model's compute, spread over the layers by FLOPs as ParaDL spreads a profiled total
   (torchmodel.py counts them on the meta device).
2. Predict: ``oracle.predict`` for data parallelism at each rank count, communication from the
   calibrations given (``commlayer calibrate`` on this machine, as committed with the algorithm
   benchmarks), the gradient buckets overlapped with backward.
3. Measure: ``train.py --worker commlayer`` under ``mpiexec -n N`` (DistributedOptimizer),
   median step. ``--measured train.md``: take the profile (``single``) and the measured steps
   (``commlayer``) from a table train.py wrote instead of running them (the numbers of a
   quieter machine: the load average is printed with each run).
Accuracy is 1 - |predicted - measured| / measured. This machine has ``--cores`` cores; with more
ranks than cores the ranks share them, which a model of one GPU per rank does not know, so
the prediction is given twice: as the oracle makes it, and with compute scaled by
ranks / cores beyond that (the platform fact, stated, not fitted).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
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


def this_machine(ranks: int) -> oracle.Platform:
    """One node holding every rank; the network figures come from the calibrations."""
    return oracle.Platform(
        mem_per_gpu_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        gpu_speed_flops=1.0,
        bandwidth_bytes_s=1e9,
        latency_s=1e-5,
        max_gpus=max(ranks, 1),
        gpus_per_node=max(ranks, 1),
        path=platform.node(),
    )


def predict_step_s(
    net: oracle.Net, ranks: int, batch: int, cals: list[Any], overlap: bool = True
) -> dict[str, Any]:
    rows = oracle.predict(
        net,
        this_machine(ranks),
        "data",
        [ranks],
        batch_per_gpu=batch,
        calibrations=cals,
        overlap=overlap,
    )
    (row,) = rows
    return {
        "step_s": row.iter_s,
        "comp_s": row.tcomp_s / row.iterations,
        "comm_s": row.tcomm_s / row.iterations,
        "hidden_s": row.hidden_s / row.iterations,
    }


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["mlp", "resnet"])
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        help="calibration file(s); default the committed algorithms_np*.json",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--measured", help="train.py's table to read instead of running")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    paths = args.calibration or sorted(
        str(p) for p in (HERE / "results").glob("algorithms_np*.calibration.json")
    )
    cals = [c for p in paths for c in costmodel.load_all(Path(p))]
    lines = [
        f"# the oracle against measured data-parallel steps (batch {args.batch} per rank)",
        "",
        f"{datetime.date.today()}, {platform.node()}, {args.cores} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        + (
            f"steps measured: the first table of {args.measured}"
            if args.measured
            else f"load average {os.getloadavg()[0]:.1f} at the start"
        )
        + ", calibrations: "
        + ", ".join(f"{c.size} ranks on {c.nodes} node(s) ({c.host} {c.date})" for c in cals),
        "",
        f"`python benchmarks/oracle.py --np {','.join(map(str, args.np))} --models "
        f"{','.join(args.models)} --steps {args.steps} --warmup {args.warmup}"
        + (f" --measured {args.measured}`" if args.measured else "`"),
        "",
        "| model | ranks | measured step ms | predicted ms (comp + comm - hidden) | accuracy | "
        f"predicted, compute x ranks/{args.cores} cores | accuracy | same, no overlap | "
        "accuracy |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    accuracies: dict[str, list[float]] = {"raw": [], "cores": [], "serial": []}
    table = read_table(Path(args.measured)) if args.measured else {}

    def step_ms(system: str, model: str, ranks: int) -> float:
        if args.measured:
            return table[(model, system, ranks)]
        return float(train.run_one(args, system, model, ranks)["step_ms"])

    for model in args.models:
        single = {"step_ms": step_ms("single", model, 1)}
        per_sample_s = single["step_ms"] / 1e3 / args.batch
        net = profiled_net(model, per_sample_s)
        lines.append(f"| {model} | 1 | {single['step_ms']:.1f} | (the profile) | | | | | |")
        for ranks in args.np:
            measured_s = step_ms("commlayer", model, ranks) / 1e3
            got = predict_step_s(net, ranks, args.batch, cals)
            share = max(1.0, ranks / args.cores)
            scaled_s = got["step_s"] + got["comp_s"] * (share - 1)
            serial_s = scaled_s + got["hidden_s"]
            acc = 1 - abs(got["step_s"] - measured_s) / measured_s
            acc_cores = 1 - abs(scaled_s - measured_s) / measured_s
            acc_serial = 1 - abs(serial_s - measured_s) / measured_s
            accuracies["raw"].append(acc)
            accuracies["cores"].append(acc_cores)
            accuracies["serial"].append(acc_serial)
            lines.append(
                f"| {model} | {ranks} | {measured_s * 1e3:.1f} | {got['step_s'] * 1e3:.1f} "
                f"({got['comp_s'] * 1e3:.1f} + {got['comm_s'] * 1e3:.1f} - "
                f"{got['hidden_s'] * 1e3:.1f}) | {acc:.1%} | {scaled_s * 1e3:.1f} | "
                f"{acc_cores:.1%} | {serial_s * 1e3:.1f} | {acc_serial:.1%} |"
            )
            print(lines[-1], flush=True)
    for key, label in (
        ("raw", "as predicted"),
        ("cores", "compute scaled by ranks/cores"),
        ("serial", "compute scaled, no overlap"),
    ):
        values = accuracies[key]
        if values:
            lines.append(
                f"\naverage accuracy, {label}: {sum(values) / len(values):.1%} "
                f"over {len(values)} cases"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
