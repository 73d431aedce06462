"""The in-window allreduce of a bucket that lives in the window (backends/shm.py's BucketWindow,
COMMLAYER_WINDOW_BUCKETS) against the regular window allreduce of the same bucket in process
memory (SharedMemoryAllreduce: copy in, reduce, copy out), without the engine, in one run:

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/window_buckets.py [--mib 25.6] [--reps 7]

Both reduce ``--mib`` MiB of float32 with Average, in turn (one of each per repetition, so a
drifting machine shifts both); each rank writes its "gradients" into the bucket first (as
backward would, not timed). A repetition's time is the slowest rank's; rank 0 prints the median
and spread of each, and their ratio, and the bytes each copies: the regular window copies
(size - 1) / size of the bucket in and all of it out, the in-window one (size - 1) / size (each
rank's reduced slice written into the others' buckets); and the least the other design, where
every rank's gradients would view one shared result, would cost (``shared_result``: each rank
reduces its slice in place and copies nothing). Its physical limit, memory bandwidth,
is measured in the same run: every rank copying the bucket at once.

``--nodes N``: the ranks posed as N nodes of size / N ranks (rank r on node r // (size / N)),
as COMMLAYER_TOPOLOGY poses them: the regular hierarchical window (SharedMemoryAllreduce with
its leg across nodes, then the Average's scaling as the engine applies it to a bucket) against
the in-window form across nodes (a BucketWindow per node, each slice allreduced across with
MPI's allreduce before it is written); "copied" then counts a node's window."""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import statistics
import time
from typing import Any

import torch

from commlayer.backends.mpi import MPI, MPIBackend, MPIWindow
from commlayer.backends.shm import (
    CHUNK_BYTES,
    BucketWindow,
    FileWindow,
    SharedMemoryAllreduce,
    _InWindow,
)
from commlayer.common.reduce_ops import ReduceOp, scale_into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=25.6)  # the benchmark MLP's gradients
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    size = world.size
    if args.nodes < 1 or size % args.nodes:
        raise SystemExit(f"--nodes {args.nodes} does not divide {size} ranks")
    local = size // args.nodes
    comm = world.Split(world.rank // local, world.rank)  # my node's ranks
    across = None
    if args.nodes > 1:
        cross = MPIBackend(world.Split(world.rank % local, world.rank))

        def across(part: torch.Tensor, op: ReduceOp) -> object:
            return cross.iallreduce(None, part, op)

    rank, node_size = comm.rank, comm.size
    numel = int(args.mib * (1 << 20)) // 4
    token = world.bcast(secrets.token_hex(6) if world.rank == 0 else None)
    name = f"{token}-n{world.rank // local}"

    def agree(ok: bool) -> bool:
        return bool(world.allreduce(ok, op=MPI.LAND))

    housed = BucketWindow(
        rank,
        node_size,
        numel * 4,
        lambda s: FileWindow(rank, node_size, name, s, agree),
        token,
        across,  # type: ignore[arg-type]
    )
    regular = SharedMemoryAllreduce(rank, node_size, CHUNK_BYTES, lambda s: MPIWindow(comm, s))

    def regular_request() -> object:
        if across is None:
            return regular.iallreduce_pieces([plain], [plain], [1 / size], ReduceOp.Average)
        if node_size == 1:  # alone on its node: MPIBackend's shortcut, the buffer across
            return _Scaled(across(plain, ReduceOp.Average), plain, size)
        inter = functools.partial(_across_op, across, ReduceOp.Average)
        return _Scaled(regular.iallreduce(None, plain, ReduceOp.Average, inter), plain, size)

    bucket = housed.memory[: numel * 4].view(torch.float32)
    plain = torch.empty(numel)
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(world.rank))

    def drive(request: object) -> float:
        world.Barrier()
        start = time.perf_counter()
        while not request.test():  # type: ignore[attr-defined]
            os.sched_yield()  # as the engine's wait does
        return float(world.allreduce(time.perf_counter() - start, op=MPI.MAX))

    times: dict[str, list[float]] = {"regular": [], "in_window": [], "shared_result": []}
    parts = [segment[: numel * 4].view(torch.float32) for segment in housed.segments]
    for rep in range(args.reps + 1):
        plain.copy_(grads)
        t_regular = drive(regular_request())
        bucket.copy_(grads)
        t_shared = drive(_SharedResult(housed, parts, ReduceOp.Average, 1 / size))
        bucket.copy_(grads)
        t_window = drive(housed.iallreduce(0, numel, torch.float32, ReduceOp.Average, 1 / size))
        if rep:  # the first is a warm-up (page faults)
            times["regular"].append(t_regular)
            times["in_window"].append(t_window)
            times["shared_result"].append(t_shared)
    assert torch.equal(plain, bucket), "the two ways differ"
    # The physical limit: memory bandwidth. Every rank copying the bucket at once (as the
    # window's copies are), the slowest rank's time: the in-window allreduce copies
    # (size - 1) / size of it a rank and reads size - 1 other slices to reduce its own.
    spare = torch.empty(numel)
    copy_s = []
    for _ in range(3):
        world.Barrier()
        start = time.perf_counter()
        spare.copy_(grads)
        copy_s.append(float(world.allreduce(time.perf_counter() - start, op=MPI.MAX)))
    if world.rank == 0:
        mib = numel * 4 / (1 << 20)
        print(
            f"{size} ranks ({args.nodes} node(s) of {local}), {mib:.1f} MiB float32, Average, "
            f"{args.reps} repetitions"
        )
        print("| way | median ms | min-max ms | copied a rank (MiB) |")
        print("| --- | ---: | --- | ---: |")
        g = node_size
        copied = {
            "regular": mib * (2 * g - 1) / g,
            "in_window": mib * (g - 1) / g,
            "shared_result": 0.0,
        }
        for way, got in times.items():
            print(
                f"| {way} | {statistics.median(got) * 1e3:.1f} | "
                f"{min(got) * 1e3:.1f}-{max(got) * 1e3:.1f} | {copied[way]:.1f} |"
            )
        copy = min(copy_s)
        print(
            f"memory bandwidth, every rank copying {mib:.1f} MiB at once: {copy * 1e3:.1f} ms "
            f"({mib / 1024 / copy:.1f} GiB/s a rank); the in-window allreduce's copies alone "
            f"take {copy * (g - 1) / g * 1e3:.1f} ms at that rate"
        )
        for way, base in (("in_window", "regular"), ("shared_result", "in_window")):
            ratios = [w / r for w, r in zip(times[way], times[base])]
            print(
                f"{way} / {base}, per repetition: median {statistics.median(ratios):.2f}, "
                f"{min(ratios):.2f}-{max(ratios):.2f}"
            )
    housed.close()
    regular.close()


class _SharedResult(_InWindow):
    """What the design of gradients that view one shared result would cost at the least: each
    rank reduces and scales its slice in place and copies nothing (the optimizers would read
    the slices where their owners left them; the third flag round such a design needs before
    the next backward, and pointing every ``.grad`` at the shared result and back, are not
    counted). Its buckets are left holding only the owner's slices reduced."""

    def _share(self, lo: int, hi: int) -> None:
        acc = self._parts[self._win.rank][lo:hi]
        if self._scale != 1.0:
            scale_into(acc, self._scale, acc)


def _across_op(across: Any, op: ReduceOp, part: torch.Tensor) -> object:
    return across(part, op)


class _Scaled:
    """The regular two-level request, then the Average's 1 / size over the bucket (the
    engine's postscale of a bucket reduced by hierarchical's window)."""

    def __init__(self, request: object, buf: torch.Tensor, size: int) -> None:
        self.request, self.buf, self.size, self.done = request, buf, size, False

    def test(self) -> bool:
        if not self.done and self.request.test():  # type: ignore[attr-defined]
            scale_into(self.buf, 1 / self.size, self.buf)
            self.done = True
        return self.done


if __name__ == "__main__":
    main()
