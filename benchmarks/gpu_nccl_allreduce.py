"""commlayer over NCCL against torch.distributed.all_reduce alone (issue 25's GPU target:
bus bandwidth >= 0.95 of NCCL's from 1 MiB), same run, one GPU per rank, under torchrun.

    torchrun --standalone --nproc_per_node N benchmarks/gpu_nccl_allreduce.py \\
        --out benchmarks/results/gpu_nccl_allreduce_npN.md
    [--device cpu] [--min-size 1MiB] [--max-size 256MiB] [--reps 5] [--target-s 0.2]

commlayer runs over its torch backend with ``COMMLAYER_NCCL=1``: CUDA tensors go to its NCCL
group as they are (commlayer/core/device.py, the direct path: no host staging; the engine thread's
stream waits on the caller's event, the future completes after an event recorded after the
NCCL work). The baseline is ``torch.distributed.all_reduce`` on the default NCCL group, on the
same tensor, called from the main thread. Both are timed per call with the device synchronized
after each call (commlayer's ``allreduce_`` returns once the result is usable; NCCL's call is
followed by ``torch.cuda.synchronize()``), as the slowest rank's mean over a loop of about
``--target-s``, median of ``--reps`` loops, the two systems alternating per repetition. The
first call of each is checked (rank r adds r + 1; every rank must see n(n+1)/2).
busbw = bytes / time * 2(n-1)/n. ``--device cpu`` runs the driver over gloo without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import commlayer as cl


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


class World:
    """Barrier and max over ranks on the default group (NCCL: a CUDA scalar)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.rank, self.size = device, dist.get_rank(), dist.get_world_size()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self) -> None:
        dist.barrier()
        self.sync()


def timed(call: Callable[[], object], iters: int, world: World) -> float:
    world.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return world.max((time.perf_counter() - t0) / iters)


def checked(call: Callable[[], object], buf: torch.Tensor, world: World, what: str) -> None:
    n = world.size
    buf.fill_(world.rank + 1)
    call()
    ok = bool((buf == n * (n + 1) / 2).all())
    if world.max(0.0 if ok else 1.0):
        raise SystemExit(f"{what}: wrong sum (rank {world.rank}: {'ok' if ok else 'wrong'})")
    buf.zero_()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to test the driver")
    parser.add_argument("--min-size", type=parse_bytes, default=1 << 20)
    parser.add_argument("--max-size", type=parse_bytes, default=256 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--target-s", type=float, default=0.2)
    parser.add_argument("--max-iters", type=int, default=500)
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if cuda:
        os.environ.setdefault("COMMLAYER_NCCL", "1")  # the point of the benchmark (read at init)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = World(device)
    cl.init()  # over the initialized torch.distributed: commlayer's torch backend
    from commlayer.core import device as seam
    from commlayer.core import runtime

    route = seam.path(runtime.engine().backend(0), device, torch.float32)
    if cuda and route is None:
        raise SystemExit("commlayer stages CUDA tensors here (no NCCL group?): nothing to compare")
    n = world.size
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "CPU"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
    base = "NCCL" if cuda else "gloo"  # --device cpu: the driver over gloo
    lines = [
        f"# commlayer over {base} vs torch.distributed.all_reduce, {n} rank(s), {device.type}",
        "",
        f"`torchrun --nproc_per_node {n} {' '.join(sys.argv)}`",
        "",
        f"{datetime.date.today()}, {platform.node()}, {n} x {name}, torch {torch.__version__}, "
        f"NCCL {nccl}; commlayer backend {cl.backend_name()}, path {route}; per call, device "
        f"synchronized after each, slowest rank, median of {args.reps} loops of "
        f"~{args.target_s:g} s, the systems alternating; first call of each checked"
        + ("" if n > 1 else "; one rank: busbw is bytes/time (nothing crosses a link)"),
        "",
        f"| size | {base} `all_reduce` µs | commlayer `allreduce_` µs | {base} busbw GB/s | "
        f"commlayer busbw GB/s | commlayer / {base} (target >= 0.95) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def report(new: str) -> None:
        if world.rank == 0:
            print(new, flush=True)
            if args.out:
                with open(args.out, "w") as out:
                    out.write("\n".join(lines) + "\n")

    report("\n".join(lines))
    nbytes = args.min_size
    while nbytes <= args.max_size:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        tag = f"nccl.bench.{nbytes}"

        def baseline(buf: torch.Tensor = buf) -> None:
            dist.all_reduce(buf)
            world.sync()

        def ours(buf: torch.Tensor = buf, tag: str = tag) -> None:
            cl.allreduce_(buf, op=cl.Sum, name=tag)

        checked(baseline, buf, world, "NCCL all_reduce")
        checked(ours, buf, world, "commlayer allreduce_")
        iters = max(1, min(args.max_iters, int(args.target_s / max(timed(ours, 2, world), 1e-6))))
        runs: dict[str, list[float]] = {"nccl": [], "cl": []}
        for _ in range(args.reps):
            runs["nccl"].append(timed(baseline, iters, world))
            runs["cl"].append(timed(ours, iters, world))
        t = {k: statistics.median(v) for k, v in runs.items()}
        bw = {k: nbytes * factor / v / 1e9 for k, v in t.items()}
        lines.append(
            f"| {human(nbytes)} | {t['nccl'] * 1e6:,.0f} | {t['cl'] * 1e6:,.0f} | "
            f"{bw['nccl']:,.2f} | {bw['cl']:,.2f} | {bw['cl'] / bw['nccl']:.3f} |"
        )
        report(lines[-1])
        del buf
        nbytes *= 4
    cl.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
