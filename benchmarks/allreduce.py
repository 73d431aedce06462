"""Allreduce benchmark, osu_allreduce style: commlayer vs raw MPI vs torch.distributed (gloo).

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/allreduce.py [--max-bytes 256M]
        [--backends mpi,torch] [--out F]

1. Every system reduces the same float32 buffer in place with Sum, measured in the same run:
   commlayer's blocking ``allreduce_`` (engine thread, negotiation, MPI underneath; with
   ``--backends mpi,torch`` also over torch.distributed's gloo, commlayer restarted over each
   backend in turn at every size), mpi4py's
   ``Comm.Allreduce`` on the same memory (the MPI library itself, no engine), and gloo's
   ``dist.all_reduce`` (what DDP uses on CPU).
2. Each size runs ``--reps`` repetitions of a timed loop whose length targets ``--target-s``;
   a repetition's time is the slowest rank's mean per call, the table shows the median
   repetition. algbw = bytes / time, busbw = algbw * 2(n-1)/n (what each link carries in a
   bandwidth-optimal allreduce; comparable across rank counts).
3. First, the engine overhead for many small tensors: 100 tensors of 1 KiB submitted together,
   as 100 ``allreduce_async_`` then synchronize (each handed to the engine as it comes: one or
   a few cycles, fused), the same inside ``commlayer.batch()`` (handed over together) and as
   one ``grouped_allreduce_`` (one operation, packed with one cat), against 100 raw
   ``Comm.Allreduce`` calls and one raw call on a buffer holding all of them.
Rank 0 prints the tables (markdown) and writes them to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import init_gloo

import commlayer as cl
from commlayer.backends.mpi import MPI, library_version

SMALL_COUNT = 100
SMALL_BYTES = 1024


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sizes(max_bytes: int) -> list[int]:
    """4 B, then every power of 4 up to max_bytes."""
    out, n = [], 4
    while n <= max_bytes:
        out.append(n)
        n *= 4
    return out


def timed(fn: Callable[[], object], iters: int, world: MPI.Comm) -> float:
    """Slowest rank's mean seconds per call over ``iters`` calls, started together."""
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    mean = (time.perf_counter() - t0) / iters
    return float(world.allreduce(mean, op=MPI.MAX))


def measure(fn: Callable[[], object], args: argparse.Namespace, world: MPI.Comm) -> float:
    """Median over repetitions of the mean time per call; the loop length is chosen from a
    first calibration call so that one repetition takes about ``--target-s``."""
    first = timed(fn, 1, world)
    iters = max(1, min(args.max_iters, int(args.target_s / max(first, 1e-7))))
    return statistics.median(timed(fn, iters, world) for _ in range(args.reps))


def time_one_size(nbytes: int, args: argparse.Namespace, world: MPI.Comm) -> dict[str, float]:
    """Seconds per call of each system on one float32 buffer of ``nbytes`` (same memory);
    commlayer once per backend in ``--backends``, restarted over it (``init(backend=...)``)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    array = buf.numpy()
    name = f"bench.{nbytes}"
    times = {"mpi": measure(lambda: world.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM), args, world)}
    for backend in args.backends:
        cl.shutdown()
        cl.init(backend=backend)
        times[f"cl-{backend}"] = measure(
            lambda: cl.allreduce_(buf, op=cl.Sum, name=name), args, world
        )
    times["gloo"] = measure(lambda: dist.all_reduce(buf), args, world)
    return times


def size_table(args: argparse.Namespace, world: MPI.Comm) -> list[str]:
    n = world.size
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    systems = ["mpi", *(f"cl-{b}" for b in args.backends), "gloo"]
    label = {
        "mpi": "raw MPI",
        "gloo": "gloo",
        **{f"cl-{b}": f"commlayer/{b}" for b in args.backends},
    }
    ratios = [(f"cl-{b}", base) for b in args.backends for base in ("mpi", "gloo")]
    if {"mpi", "torch"} <= set(args.backends):
        ratios.append(("cl-torch", "cl-mpi"))
    rows = [
        "| bytes | "
        + " | ".join(f"{label[k]} µs" for k in systems)
        + " | "
        + " | ".join(f"{label[k]} busbw GB/s" for k in systems)
        + " | "
        + " | ".join(f"{label[a]} / {label[b]}" for a, b in ratios)
        + " |",
        "| ---: |" + " ---: |" * (2 * len(systems) + len(ratios)),
    ]
    if world.rank == 0:
        print("\n".join(rows), flush=True)
    for nbytes in sizes(args.max_bytes):
        times = time_one_size(nbytes, args, world)
        busbw = {k: nbytes / t * factor / 1e9 for k, t in times.items()}
        rows.append(
            f"| {human(nbytes)} | "
            + " | ".join(f"{times[k] * 1e6:,.0f}" for k in systems)
            + " | "
            + " | ".join(f"{busbw[k]:.2f}" for k in systems)
            + " | "
            # a ratio of speeds: above 1, the first is faster
            + " | ".join(f"{times[b] / times[a]:.2f}" for a, b in ratios)
            + " |"
        )
        if world.rank == 0:
            print(rows[-1], flush=True)
    return rows


def small_tensor_table(args: argparse.Namespace, world: MPI.Comm) -> list[str]:
    tensors = [torch.ones(SMALL_BYTES // 4) for _ in range(SMALL_COUNT)]
    arrays = [t.numpy() for t in tensors]
    fused = torch.ones(SMALL_COUNT * SMALL_BYTES // 4).numpy()
    names = [f"small.{i}" for i in range(SMALL_COUNT)]

    def commlayer_fused() -> None:
        handles = [cl.allreduce_async_(t, op=cl.Sum, name=n) for t, n in zip(tensors, names)]
        for handle in handles:
            cl.synchronize(handle)

    def commlayer_batched() -> None:
        with cl.batch():  # handed to the engine together when the block ends
            handles = [cl.allreduce_async_(t, op=cl.Sum, name=n) for t, n in zip(tensors, names)]
        for handle in handles:
            cl.synchronize(handle)

    def raw_calls() -> None:
        for array in arrays:
            world.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)

    def commlayer_grouped() -> None:
        cl.grouped_allreduce_(tensors, op=cl.Sum, name="small.group")

    t_cl = measure(commlayer_fused, args, world)
    t_batch = measure(commlayer_batched, args, world) if hasattr(cl, "batch") else None
    t_group = measure(commlayer_grouped, args, world)
    t_raw = measure(raw_calls, args, world)
    t_one = measure(lambda: world.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM), args, world)
    return [
        f"| {SMALL_COUNT} x {human(SMALL_BYTES)} | time µs | vs 100 raw calls |",
        "| --- | ---: | ---: |",
        f"| commlayer, 100 allreduce_async_ then synchronize (fused) | {t_cl * 1e6:,.0f} "
        f"| {t_raw / t_cl:.2f}x |",
        *(
            [
                f"| commlayer, the same inside commlayer.batch() | {t_batch * 1e6:,.0f} "
                f"| {t_raw / t_batch:.2f}x |"
            ]
            if t_batch is not None
            else []
        ),
        f"| commlayer, one grouped_allreduce_ of the 100 | {t_group * 1e6:,.0f} "
        f"| {t_raw / t_group:.2f}x |",
        f"| raw MPI, 100 Allreduce calls | {t_raw * 1e6:,.0f} | 1.00x |",
        f"| raw MPI, 1 call on one 100 KiB buffer (lower bound) | {t_one * 1e6:,.0f} "
        f"| {t_raw / t_one:.2f}x |",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per size")
    parser.add_argument("--target-s", type=float, default=0.2, help="seconds per repetition")
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument(
        "--backends",
        type=lambda text: text.split(","),
        default=["mpi"],
        help="commlayer's backends to measure, each in turn at every size: mpi, torch (gloo)",
    )
    parser.add_argument("--out", help="also write the tables here (rank 0)")
    args = parser.parse_args()

    cl.init()
    world = MPI.COMM_WORLD
    init_gloo(world)
    header = [
        f"# allreduce, {world.size} ranks, float32 Sum in place",
        "",
        f"{datetime.date.today()}, {platform.node()}, torch {torch.__version__}, "
        f"{library_version()}, `{' '.join(['mpiexec -n', str(world.size), *sys.argv])}`",
        "",
    ]
    if world.rank == 0:
        print("\n".join(header), flush=True)
    # Small tensors first: measured after the 256 MiB sweep the same burst took 7.0-7.4 ms
    # instead of 3.2 ms (raw MPI calls: 0.64 vs 0.46 ms), an after-effect of the sweep on this
    # machine that the order of two tables should not decide.
    small = small_tensor_table(args, world)
    if world.rank == 0:
        print("\n".join(small) + "\n", flush=True)
    rows = size_table(args, world)
    if world.rank == 0 and args.out:
        with open(args.out, "w") as out:
            out.write("\n".join([*header, *small, "", *rows, ""]))
    dist.destroy_process_group()
    cl.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
