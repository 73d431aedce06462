"""The in-window allreduce of a bucket that lives in the window (backends/shm.py's BucketWindow,
COMMLAYER_WINDOW_BUCKETS) against the regular window allreduce of the same bucket in process
memory (SharedMemoryAllreduce: copy in, reduce, copy out), without the engine, in one run:

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/window_buckets.py [--mib 25.6] [--reps 7]

Both reduce ``--mib`` MiB of float32 with Average, in turn (one of each per repetition, so a
drifting machine shifts both); each rank writes its "gradients" into the bucket first (as
backward would, not timed). A repetition's time is the slowest rank's; rank 0 prints the median
and spread of each, and their ratio, and the bytes each copies: the regular window copies
(size - 1) / size of the bucket in and all of it out, the in-window one (size - 1) / size (each
rank's reduced slice written into the others' buckets). Its physical limit, memory bandwidth,
is measured in the same run: every rank copying the bucket at once."""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time

import torch

from commlayer.backends.mpi import MPI, MPIWindow
from commlayer.backends.shm import CHUNK_BYTES, BucketWindow, FileWindow, SharedMemoryAllreduce
from commlayer.common.reduce_ops import ReduceOp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=25.6)  # the benchmark MLP's gradients
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    numel = int(args.mib * (1 << 20)) // 4
    token = comm.bcast(secrets.token_hex(6) if rank == 0 else None)

    def agree(ok: bool) -> bool:
        return bool(comm.allreduce(ok, op=MPI.LAND))

    housed = BucketWindow(
        rank, size, numel * 4, lambda s: FileWindow(rank, size, token, s, agree), token
    )
    regular = SharedMemoryAllreduce(rank, size, CHUNK_BYTES, lambda s: MPIWindow(comm, s))
    bucket = housed.memory[: numel * 4].view(torch.float32)
    plain = torch.empty(numel)
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    def drive(request: object) -> float:
        comm.Barrier()
        start = time.perf_counter()
        while not request.test():  # type: ignore[attr-defined]
            os.sched_yield()  # as the engine's wait does
        return float(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))

    times: dict[str, list[float]] = {"regular": [], "in_window": []}
    for rep in range(args.reps + 1):
        plain.copy_(grads)
        t_regular = drive(regular.iallreduce_pieces([plain], [plain], [1 / size], ReduceOp.Average))
        bucket.copy_(grads)
        t_window = drive(housed.iallreduce(0, numel, torch.float32, ReduceOp.Average, 1 / size))
        if rep:  # the first is a warm-up (page faults)
            times["regular"].append(t_regular)
            times["in_window"].append(t_window)
    assert torch.equal(plain, bucket), "the two ways differ"
    # The physical limit: memory bandwidth. Every rank copying the bucket at once (as the
    # window's copies are), the slowest rank's time: the in-window allreduce copies
    # (size - 1) / size of it a rank and reads size - 1 other slices to reduce its own.
    spare = torch.empty(numel)
    copy_s = []
    for _ in range(3):
        comm.Barrier()
        start = time.perf_counter()
        spare.copy_(grads)
        copy_s.append(float(comm.allreduce(time.perf_counter() - start, op=MPI.MAX)))
    if rank == 0:
        mib = numel * 4 / (1 << 20)
        print(f"{size} ranks, {mib:.1f} MiB float32, Average, {args.reps} repetitions")
        print("| way | median ms | min-max ms | copied a rank (MiB) |")
        print("| --- | ---: | --- | ---: |")
        copied = {"regular": mib * (2 * size - 1) / size, "in_window": mib * (size - 1) / size}
        for way, got in times.items():
            print(
                f"| {way} | {statistics.median(got) * 1e3:.1f} | "
                f"{min(got) * 1e3:.1f}-{max(got) * 1e3:.1f} | {copied[way]:.1f} |"
            )
        copy = min(copy_s)
        print(
            f"memory bandwidth, every rank copying {mib:.1f} MiB at once: {copy * 1e3:.1f} ms "
            f"({mib / 1024 / copy:.1f} GiB/s a rank); the in-window allreduce's copies alone "
            f"take {copy * (size - 1) / size * 1e3:.1f} ms at that rate"
        )
        ratios = [w / r for w, r in zip(times["in_window"], times["regular"])]
        print(
            f"in_window / regular, per repetition: median {statistics.median(ratios):.2f}, "
            f"{min(ratios):.2f}-{max(ratios):.2f}"
        )
    housed.close()
    regular.close()


if __name__ == "__main__":
    main()
