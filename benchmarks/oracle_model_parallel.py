"""The oracle against measured model-parallel runs: examples/model_parallel_cnn.py each way.

    OMP_NUM_THREADS=1 python benchmarks/oracle_model_parallel.py [--np 2] [--out F]

1. Profile: the CNN trained by one process (``--strategy data`` at 1 rank, float32), its
   seconds per sample spread over the layers by FLOPs (torchmodel.py on the meta device).
2. Predict, per strategy and rank count: ``oracle.predict`` with the split layers as the
   example splits them (filter and spatial: both convolutions; channel: the second), the
   batch as it runs it (model parallelism: every rank the whole batch, ``--batch-per-gpu B``;
   data: B / ranks each), communication from this machine's committed calibrations.
3. Measure: the example under ``mpiexec -n N``, median step.
Accuracy 1 - |predicted - measured| / measured; and whether the oracle ranks the strategies
as measured. Compute is scaled by ranks / cores where ranks exceed the cores. The prediction is
given twice: as the calibration alone makes it, and with the engine's cost per collective call
(``op_latency_s``: the median of 50 blocking 4-byte allreduces at that rank count, measured
just before, independent of the runs predicted).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "model_parallel_cnn.py"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(EXAMPLE.parent))

from oracle import this_machine  # noqa: E402

from commlayer import costmodel  # noqa: E402
from commlayer import oracle as cl_oracle  # noqa: E402
from commlayer.oracle import torchmodel  # noqa: E402

STRATEGIES = ("data", "filter", "channel", "spatial")


def run_example(strategy: str, ranks: int, args: argparse.Namespace) -> float:
    command = [
        "mpiexec", "-n", str(ranks), sys.executable, str(EXAMPLE), "--strategy", strategy,
        "--dtype", "float32", "--batch", str(args.batch), "--size", str(args.size),
        "--channels", str(args.channels), "--steps", str(args.steps),
        "--warmup", str(args.warmup),
    ]  # fmt: skip
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


def net_of(args: argparse.Namespace, per_sample_s: float) -> cl_oracle.Net:
    net = torchmodel.describe("model_parallel_cnn:build", f"3x{args.size}x{args.size}", 1)
    layers = [dataclasses.replace(la, t_s=0.0) for la in net.layers]
    layers[0] = dataclasses.replace(layers[0], t_s=per_sample_s)
    return dataclasses.replace(net, layers=tuple(layers))


def mask_of(net: cl_oracle.Net, strategy: str) -> tuple[bool, ...]:
    split = {"filter": ("conv1", "conv2"), "spatial": ("conv1", "conv2"), "channel": ("conv2",)}
    names = split.get(strategy, ())
    return tuple(any(la.name.endswith(n) for n in names) for la in net.layers)


def predict_s(
    net: cl_oracle.Net, strategy: str, ranks: int, batch: int, cals: list, op_latency_s: float
) -> tuple[float, float]:
    per_gpu = batch // ranks if strategy == "data" else batch
    rows = cl_oracle.predict(
        net, this_machine(ranks), strategy, [ranks], batch_per_gpu=per_gpu,
        mask=mask_of(net, strategy), calibrations=cals, op_latency_s=op_latency_s,
    )  # fmt: skip
    (row,) = rows
    return row.iter_s, row.tcomp_s / row.iterations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out")
    args = parser.parse_args()
    paths = sorted((HERE / "results").glob("algorithms_np*.calibration.json"))
    cals = [c for p in paths for c in costmodel.load_all(p)]
    single_s = run_example("data", 1, args)
    net = net_of(args, single_s / args.batch)
    lines = [
        "| strategy | ranks | measured step ms | predicted ms | accuracy | "
        "predicted with the engine's op latency, ms | accuracy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| one process | 1 | {single_s * 1e3:.1f} | (the profile) | | | |",
    ]
    accuracy: dict[str, list[float]] = {"calibration alone": [], "with op latency": []}
    for ranks in args.np:
        op_latency_s = engine_op_latency_s(ranks)
        lines.append(f"| (engine op latency at {ranks} ranks: {op_latency_s * 1e3:.2f} ms) |||||||")
        measured, predicted = {}, {}
        for strategy in STRATEGIES:
            measured[strategy] = run_example(strategy, ranks, args)
            got = []
            for latency in (0.0, op_latency_s):
                step_s, comp_s = predict_s(net, strategy, ranks, args.batch, cals, latency)
                got.append(step_s + comp_s * (max(1.0, ranks / args.cores) - 1))
            predicted[strategy] = got[1]
            acc = [1 - abs(g - measured[strategy]) / measured[strategy] for g in got]
            for key, value in zip(accuracy, acc):
                accuracy[key].append(value)
            lines.append(
                f"| {strategy} | {ranks} | {measured[strategy] * 1e3:.1f} | {got[0] * 1e3:.1f} | "
                f"{acc[0]:.1%} | {got[1] * 1e3:.1f} | {acc[1]:.1%} |"
            )
            print(lines[-1], flush=True)
        order_m = sorted(STRATEGIES, key=measured.__getitem__)
        order_p = sorted(STRATEGIES, key=predicted.__getitem__)
        same = "same" if order_m == order_p else "different"
        lines.append(
            f"\n{ranks} ranks: measured fastest first {', '.join(order_m)}; predicted (with op "
            f"latency) {', '.join(order_p)} ({same})\n"
        )
    for key, values in accuracy.items():
        lines.append(
            f"average accuracy, {key}: {sum(values) / len(values):.1%} over {len(values)} cases\n"
        )
    head = (
        f"# the oracle against measured model-parallel steps of examples/model_parallel_cnn.py\n\n"
        f"{datetime.date.today()}, {platform.node()}, {args.cores} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the start; batch {args.batch} of 3x{args.size}x{args.size},"
        f" {args.channels} channels, float32, median of {args.steps} steps after {args.warmup}\n\n"
        f"`python benchmarks/oracle_model_parallel.py --np {','.join(map(str, args.np))} "
        f"--batch {args.batch} --size {args.size} --channels {args.channels} "
        f"--steps {args.steps}`\n\n"
    )
    text = head + "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
