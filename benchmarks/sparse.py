"""Sparse allreduce benchmark: every sparse algorithm vs the dense allreduce and vs allgather,
with the cost model's prediction beside each measurement.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/sparse.py [--numel 25000000]
        [--densities 0.001,0.01,0.1] [--paper] [--out benchmarks/results/sparse_np4.md]

1. Every rank draws ``density x numel`` distinct random indices (its own seed) with random
   float32 values: independent supports, so the sum fills in toward 1 - (1 - d)^p.
2. Each sparse algorithm (commlayer.algorithms.sparse, kernels from COMMLAYER_KERNELS) runs on
   a communicator of its own, no engine; the dense baselines reduce the densified float32
   vector with commlayer's Allreducer (``auto``: the cost model's or the heuristic's pick;
   ``mpi``: MPI_Allreduce). A measurement is the median over ``--reps`` of the slowest rank's
   time, each after a barrier, all runs round-robin after one untimed warm-up round. Bytes:
   the most any rank sent (sparse: the streams it sent; dense: the ring's 2(p-1)/p n x 4, what
   a bandwidth-optimal allreduce sends).
3. ``topo_sparse`` runs twice at 4 ranks: on the real topology (one node: a sparse ring) and
   as 2 nodes x 2 ranks (the ring-ring schedule).
4. ``--paper`` adds Nguyen et al.'s micro-benchmark (IPCCC 2019): 32M elements at 0.78%.
Rank 0 prints markdown tables and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from commlayer import kernels
from commlayer.algorithms import sparse
from commlayer.algorithms.executor import Allreducer
from commlayer.algorithms.sparse import cost
from commlayer.algorithms.sparse.executor import sparse_allreduce
from commlayer.backends.mpi import MPI, MPIBackend, library_version
from commlayer.core.reduce_ops import ReduceOp
from commlayer.core.topology import Topology


def wait(request: object) -> None:
    while not request.test():  # type: ignore[attr-defined]
        time.sleep(0)


def measure(fns: list[Callable[[], object]], reps: int, world: MPI.Comm) -> list[float]:
    """Median over ``reps`` rounds of each fn's slowest-rank time. Round-robin, after one
    untimed warm-up round (numba compiles there): a fixed order made whichever ran first after
    the dense runs up to 1.9x slower (measured), and interleaving spreads such effects."""
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, samples in zip(fns, times):
            world.Barrier()
            start = time.perf_counter()
            fn()
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if rep:
                samples.append(elapsed)
    return [statistics.median(samples) for samples in times]


def inputs(numel: int, density: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    nnz = max(1, int(density * numel))
    idx = torch.randperm(numel, generator=g)[:nnz].sort().values.to(torch.int32)
    return idx, torch.randn(nnz, generator=g)


def table(numel: int, density: float, args: argparse.Namespace, world: MPI.Comm) -> list[str]:
    backend = MPIBackend()
    size, rank = backend.size, backend.rank
    idx, val = inputs(numel, density, rank)
    nnz = idx.numel()
    dense = kernels.densify(idx.long(), val, numel)
    fns: list[Callable[[], object]] = []
    for name in ("auto", "mpi"):
        allreducer, buf = Allreducer(name), dense.clone()

        def run_dense(allreducer: Allreducer = allreducer, buf: torch.Tensor = buf) -> None:
            buf.copy_(dense)
            wait(allreducer(backend, None, buf, ReduceOp.Sum))

        fns.append(run_dense)
    layouts: list[tuple[str, Topology | None]] = [(n, None) for n in sparse.available()[1:]]
    if size == 4:
        layouts.append(("topo_sparse", Topology((0, 0, 1, 1))))
    layouts.append((sparse.AUTO, None))
    last: list[Any] = [None] * len(layouts)
    for i, (name, topology) in enumerate(layouts):

        def run_sparse(i: int = i, name: str = name, topology: Topology | None = topology) -> None:
            req = sparse_allreduce(backend, idx, val, numel, name, k=nnz, topology=topology)
            wait(req)
            last[i] = req

        fns.append(run_sparse)
    seconds = measure(fns, args.reps, world)
    dense_bytes = 2 * (size - 1) / size * numel * 4
    rows: list[tuple[str, float, float, float | None, float | None, str]] = [
        (f"dense `{name}` ({Allreducer(name).choose(backend, numel, 4)})", t, dense_bytes,
         None, None, "dense")
        for name, t in zip(("auto", "mpi"), seconds)
    ]  # fmt: skip
    for (name, topology), req, t in zip(layouts, last, seconds[2:]):
        sent = world.allreduce(req.bytes_sent, op=MPI.MAX)
        result = req.result
        shape = "dense" if result.indices is None else f"{result.nnz / numel:.2%} sparse"
        label = f"`{name}`" + (" (2 nodes x 2)" if topology is not None else "")
        predicted = None
        if name == sparse.AUTO:
            label += f" -> {req.algorithm}"
        else:
            predicted = cost.predict(name, size, numel, nnz, topology)
        rows.append(
            (
                label,
                t,
                sent,
                None if predicted is None else predicted.seconds,
                None if predicted is None else predicted.bytes_sent,
                shape,
            )
        )
    backend.close()
    base = rows[0][1]
    lines = [
        f"### n = {numel:,} float32, density {density:.2%} ({nnz:,} per rank), {size} ranks",
        "",
        "| algorithm | time ms | vs dense auto | MB sent per rank | predicted ms | predicted MB "
        "| result |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, seconds, sent_bytes, p_s, p_b, shape in rows:
        lines.append(
            f"| {label} | {seconds * 1e3:,.1f} | {base / seconds:.2f}x | {sent_bytes / 1e6:,.2f} "
            f"| {'' if p_s is None else f'{p_s * 1e3:,.1f}'} "
            f"| {'' if p_b is None else f'{p_b / 1e6:,.2f}'} | {shape} |"
        )
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--densities", default="0.001,0.01,0.1")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--paper", action="store_true", help="add 32M elements at 0.78%%")
    parser.add_argument("--out", help="also write the tables here (rank 0)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    cases = [(args.numel, float(d)) for d in args.densities.split(",")]
    if args.paper:
        cases.append((32 * 1024 * 1024, 0.0078))
    lines = [
        f"# sparse allreduce, {world.size} ranks",
        "",
        f"`OMP_NUM_THREADS=1 mpiexec -n {world.size} python {' '.join(sys.argv)}`",
        "",
        f"{datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()}"
        f", torch {torch.__version__}, {library_version()}, kernels: "
        f"{kernels.configured()} (numba: {kernels.available()['numba']}). No GPU was available "
        "in this session: CPU only, the CUDA kernels were compiled but not run.",
        "",
    ]
    for numel, density in cases:
        lines += table(numel, density, args, world)
    if world.rank == 0:
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as out:
                out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
