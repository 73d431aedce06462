"""Allreduce algorithms benchmark: busbw of every algorithm vs the MPI library's own, and the
cost model's prediction vs the measurement.

    OMP_NUM_THREADS=1 mpiexec -bind-to core -n 2 python benchmarks/algorithms.py [--out F]

1. ``commlayer calibrate`` runs first (in this job, same ranks), so the model predicts from
   numbers of this machine and this moment; it is saved to ``--calibration`` (default: a file
   beside ``--out``, never the user's cache, so a benchmark does not change ``auto``).
2. Every algorithm reduces the same float32 buffer in place with Sum, one after the other, on a
   communicator of its own (no engine: this measures the algorithms, benchmarks/allreduce.py
   measures the engine). A measurement is the median over ``--reps`` repetitions of the slowest
   rank's mean time per call over a loop targeting ``--target-s``.
3. busbw = bytes / time * 2(n-1)/n; "vs mpi" is mpi's time / the algorithm's time (> 1 is
   faster). The accuracy of a prediction is 1 - |pred - meas| / meas.
4. ``auto``'s pick per size is compared with the best measured algorithm ("vs best": the
   pick's own column against the fastest column of the same row), twice: the cost model's pick
   alone (``COMMLAYER_AUTO_TUNING=off``), and the pick of online tuning (the default:
   algorithms/autotune.py), after its first round of measurements at that size (24-104 calls,
   untimed). The tuned auto is also timed as a dispatcher of its own, a separate measurement
   that shows the run-to-run spread, and in turn with the row's two fastest algorithms
   (``auto_in_turn``), which compares them at the same moment.
5. Paired (one node only): ``mpi`` and ``shm`` at ``--paired-bytes``, one measurement of each in
   turn, ``--pairs`` times; the ratio of neighbouring measurements is steady where the
   machine's speed is not (this VM switches between two states for tens of seconds to minutes
   at a time: ``shm`` at 64 MiB takes ~10 ms in one and ~30 ms in the other, MPICH ~30 ms in
   both; see benchmarks/results/algorithms_np2.md).
6. More ranks than cores (4 on this machine's 2): bind them, ``mpiexec -bind-to core`` (Hydra;
   Open MPI: ``--bind-to core --oversubscribe``); the header says whether they were. Unbound, the
   kernel moves the ranks between the cores, and the same exchange (every rank with a partner
   at once, 1 MiB) took 311-1,318 us from one job to the next, 4x, and differed 4x between
   partners within one job; bound, 308-319 us for every partner in two jobs (the drift of item
   5 remains).
7. With ``COMMLAYER_TOPOLOGY`` (e.g. ``nodes=2,local=2``) the topology-aware algorithms run on
   those pretend nodes (``hierarchical``: its shared-memory form on equal nodes); ``auto`` keeps
   the detected nodes, which its calibration is for.
Rank 0 prints markdown tables and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from commlayer import algorithms, costmodel
from commlayer.algorithms import autotune
from commlayer.backends.mpi import MPI, MPIBackend, library_version
from commlayer.common import config, topology
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core.selection import Allreducer
from commlayer.launch import calibrate as costmodel_measure


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def timed(fn: Callable[[], object], iters: int, world: MPI.Comm) -> float:
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return float(world.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX))


def loop_iters(seconds_per_call: float, args: argparse.Namespace) -> int:
    """Calls in a timed loop of about ``--target-s``, at most ``--max-iters``."""
    return max(1, min(args.max_iters, int(args.target_s / max(seconds_per_call, 1e-7))))


def measure(fn: Callable[[], object], args: argparse.Namespace, world: MPI.Comm) -> float:
    iters = loop_iters(timed(fn, 1, world), args)
    return statistics.median(timed(fn, iters, world) for _ in range(args.reps))


def blocking(allreducer: Allreducer, backend: MPIBackend, buf: torch.Tensor) -> Callable[[], None]:
    """One in-place Sum allreduce of buf by allreducer, waited for with yields."""

    def run() -> None:
        request = allreducer(backend, None, buf, ReduceOp.Sum)
        while not request.test():
            os.sched_yield()

    return run


def auto_in_turn(
    run_auto: Callable[[], None],
    times: dict[str, float],
    names: list[str],
    backend: MPIBackend,
    buf: torch.Tensor,
    args: argparse.Namespace,
    world: MPI.Comm,
    nodes: topology.Topology,
) -> float:
    """The tuned auto against the row's two fastest algorithms, measured in turn (auto, then
    each of them, ``IN_TURN_ROUNDS`` times; the same loop length for all): the faster one's
    median over the rounds / auto's median. Unlike the columns, measured seconds or a minute
    apart, this compares them at the same moment of a machine whose speed drifts. Medians per
    algorithm, not the per-round minimum of the two: the smaller of two noisy times is biased
    low (at 4 ranks, 64 KiB, auto running mpi came out at 0.82x of the two, mpi among them)."""
    fastest = sorted(names, key=lambda name: times[name])[:2]
    runs = [blocking(Allreducer(name, topology=nodes), backend, buf) for name in fastest]
    iters = loop_iters(times[fastest[0]], args)
    mine: list[float] = []
    theirs: list[list[float]] = [[] for _ in runs]
    for _ in range(IN_TURN_ROUNDS):
        mine.append(timed(run_auto, iters, world))
        for run, seconds in zip(runs, theirs, strict=True):
            seconds.append(timed(run, iters, world))
    return min(statistics.median(seconds) for seconds in theirs) / statistics.median(mine)


IN_TURN_ROUNDS = 5


def affinity(world: MPI.Comm) -> str:
    """Each rank's allowed CPUs, for the header: binding changes what 4 ranks on 2 cores
    measure (see the module docstring)."""
    cpus = world.allgather(sorted(os.sched_getaffinity(0)))
    if world.size > 1 and all(c == cpus[0] for c in cpus):  # a container may allow fewer CPUs
        return f"ranks not bound to cores (each may run on CPUs {','.join(map(str, cpus[0]))})"
    return "ranks bound: " + ", ".join(
        f"{r}->{{{','.join(map(str, c))}}}" for r, c in enumerate(cpus)
    )


def paired(backend: MPIBackend, args: argparse.Namespace, world: MPI.Comm) -> list[str]:
    """shm vs mpi at --paired-bytes, measured in turn: the lines of the paired section."""
    buf = torch.ones(args.paired_bytes // 4)
    times: dict[str, list[float]] = {"mpi": [], "shm": []}
    for _ in range(args.pairs):
        for name in times:
            run = blocking(Allreducer(name), backend, buf)
            run()
            first = timed(run, 1, world)
            times[name].append(timed(run, max(1, int(args.target_s / max(first, 1e-7))), world))
    ratios = [m / s for m, s in zip(times["mpi"], times["shm"], strict=True)]
    lines = [
        f"Paired, {human(args.paired_bytes)}: mpi and shm measured in turn, {args.pairs} times "
        "(ms per call, and mpi's time / shm's per pair):",
        "",
        "| pair | " + " | ".join(str(i + 1) for i in range(args.pairs)) + " |",
        "| --- | " + " | ".join("---:" for _ in ratios) + " |",
        "| mpi ms | " + " | ".join(f"{t * 1e3:.1f}" for t in times["mpi"]) + " |",
        "| shm ms | " + " | ".join(f"{t * 1e3:.1f}" for t in times["shm"]) + " |",
        "| shm vs mpi | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |",
        "",
        f"Median {statistics.median(ratios):.2f}x; {sum(r >= 3 for r in ratios)} of "
        f"{len(ratios)} pairs >= 3x.",
        "",
    ]
    if world.rank == 0:
        print("\n".join(lines), flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_bytes, default=1 << 10)
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size-factor", type=int, default=4, help="from one size to the next")
    parser.add_argument("--target-s", type=float, default=0.2)
    parser.add_argument("--max-iters", type=int, default=500)
    parser.add_argument("--calibration", help="where to save this run's calibration")
    parser.add_argument("--out", help="also write the tables here (rank 0)")
    parser.add_argument(
        "--json", help="also write the measurements here (rank 0): seconds per call by size"
    )
    parser.add_argument("--paired-bytes", type=parse_bytes, default=64 << 20)
    parser.add_argument("--pairs", type=int, default=12, help="0 skips the paired section")
    args = parser.parse_args()
    if args.size_factor < 2:
        parser.error(f"--size-factor {args.size_factor}: must be at least 2")

    world = MPI.COMM_WORLD
    backend = MPIBackend()
    cal = costmodel_measure.calibrate(backend)
    target = args.calibration or (
        str(Path(args.out).with_suffix(".calibration.json")) if args.out else None
    )
    if world.rank == 0 and target:
        costmodel.save(cal, Path(target))
    names = costmodel.candidates(cal.nodes == 1)
    pretend = config.load().topology
    nodes = topology.build(pretend, world.size, backend.nodes())
    model = Allreducer(algorithms.AUTO, [cal])
    auto = Allreducer(algorithms.AUTO, [cal], tuning=True)
    sizes = []
    n = args.min_bytes
    while n <= args.max_bytes:
        sizes.append(n)
        n *= args.size_factor
    factor = 2 * (world.size - 1) / world.size
    lines = [
        f"# allreduce algorithms, {world.size} ranks, float32 Sum in place",
        "",
        f"{datetime.date.today()}, {platform.node()}, torch {torch.__version__}, "
        f"{library_version()}, `{' '.join(['mpiexec -n', str(world.size), *sys.argv])}`"
        + (f", COMMLAYER_TOPOLOGY={pretend}" if pretend else "")
        + f", {affinity(world)}",
        "",
        f"Calibration (this run): alpha {cal.alpha_s * 1e6:.1f} us, beta "
        f"{1 / cal.beta_s_per_byte / 1e9:.2f} GB/s, reduce {1 / cal.gamma_s_per_byte / 1e9:.2f} "
        f"GB/s, copy {1 / cal.copy_s_per_byte / 1e9:.2f} GB/s.",
        "",
        "| bytes | "
        + " | ".join(f"{name} µs (busbw GB/s, vs native)" for name in names)
        + " | model picks | vs best | tuned auto picks | vs best | tuned auto µs (own run) "
        "| own run vs best | tuned auto vs best two, in turn |",
        "| ---: | "
        + " | ".join("---:" for _ in names)
        + " | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    accuracy_rows = [
        "| bytes | "
        + " | ".join(f"{name} predicted / measured µs (accuracy)" for name in names)
        + " |",
        "| ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    if world.rank == 0:
        print("\n".join(lines), flush=True)
    measured: list[dict[str, object]] = []  # --json
    accuracies: dict[str, list[float]] = {name: [] for name in names}
    native = algorithms.NATIVE_ALLREDUCE  # the backend's own (MPI_Allreduce here)
    relative: dict[str, list[float]] = {name: [] for name in names if name != native}
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4)
        times: dict[str, float] = {}
        for name in names:
            allreducer = Allreducer(name, topology=nodes)
            times[name] = measure(blocking(allreducer, backend, buf), args, world)
        run_auto = blocking(auto, backend, buf)
        runs = autotune.samples(nbytes)
        for _ in range(autotune.round_calls(autotune.CANDIDATES, runs)):  # first round, untimed
            run_auto()
        times[algorithms.AUTO] = measure(run_auto, args, world)
        best = min(times[name] for name in names)
        in_turn = auto_in_turn(run_auto, times, names, backend, buf, args, world, nodes)
        cells, acc_cells = [], []
        mpi_predicted = costmodel.predict(native, nbytes // 4, 4, cal)
        for name in names:
            t = times[name]
            cells.append(
                f"{t * 1e6:,.0f} ({nbytes / t * factor / 1e9:.2f}, {times[native] / t:.2f}x)"
            )
            predicted = costmodel.predict(name, nbytes // 4, 4, cal)
            assert predicted is not None
            accuracy = 1 - abs(predicted - t) / t
            if nbytes >= 64 << 10:
                accuracies[name].append(accuracy)
                if name != native and mpi_predicted:
                    ratio = t / times[native]
                    relative[name].append(1 - abs(predicted / mpi_predicted - ratio) / ratio)
            acc_cells.append(f"{predicted * 1e6:,.0f} / {t * 1e6:,.0f} ({accuracy:.0%})")
        first = model.choose(backend, nbytes // 4, 4)
        pick = auto.choose(backend, nbytes // 4, 4)
        measured.append(
            {
                "bytes": nbytes,
                "seconds": dict(times),
                "model_pick": first,
                "tuned_pick": pick,
                "auto_in_turn": in_turn,
            }
        )
        lines.append(
            f"| {human(nbytes)} | "
            + " | ".join(cells)
            + f" | {first} | {best / times[first]:.2f}x | {pick} | {best / times[pick]:.2f}x"
            + f" | {times['auto'] * 1e6:,.0f} | {best / times['auto']:.2f}x | {in_turn:.2f}x |"
        )
        accuracy_rows.append(f"| {human(nbytes)} | " + " | ".join(acc_cells) + " |")
        if world.rank == 0:
            print(lines[-1], flush=True)
    summary = [
        "",
        "Cost model: predicted vs measured time (accuracy = 1 - |pred - meas| / meas).",
        "",
        *accuracy_rows,
        "",
        "Mean accuracy at >= 64 KiB: "
        + ", ".join(f"{name} {statistics.mean(acc):.0%}" for name, acc in accuracies.items() if acc)
        + ".",
        "",
        "mpi and shm are predicted from their own times measured by the calibration (interpolated "
        "between 1 KiB and 64 MiB, 4x apart), so their accuracy is mostly how far this machine "
        "drifted between the calibration and the measurement a few seconds later. Relative to "
        "mpi (predicted time / mpi's predicted vs measured time / mpi's measured: what ranks "
        "the algorithms for auto, and what a machine-wide drift does not change), mean accuracy "
        "at >= 64 KiB: "
        + ", ".join(f"{name} {statistics.mean(acc):.0%}" for name, acc in relative.items() if acc)
        + ".",
        "",
    ]
    if world.rank == 0:
        print("\n".join(summary), flush=True)
    if "shm" in names and args.pairs > 0:
        summary += paired(backend, args, world)
    if world.rank == 0 and args.out:
        Path(args.out).write_text("\n".join([*lines, *summary]))
    hosts = world.allgather(platform.node()) if args.json else []
    if world.rank == 0 and args.json:
        record = {
            "ranks": world.size,
            "nodes": backend.nodes(),
            "hosts": hosts,
            "mpi": library_version(),
            "command": sys.argv,
            "sizes": measured,
        }
        Path(args.json).write_text(json.dumps(record, indent=1))
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
