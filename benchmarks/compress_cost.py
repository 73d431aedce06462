"""What each compressor costs on the CPU, as a multiple of the memory-bandwidth limit (issue 39).

    OMP_NUM_THREADS=1 python benchmarks/compress_cost.py [--ranks 2] [--repeats 7] [--out F]

1. The gradients: one backward pass of benchmarks/train.py's MLP (6.69 M parameters, batch 32),
   every parameter's gradient (26.8 MB of float32 in 42 tensors).
2. The limit, measured in the same run: one **pass** = ``dst.copy_(src)`` of every gradient into
   a buffer of its own, i.e. every gradient byte read once and written once (what a cast or any
   one-loop kernel cannot beat). Its median time over the repeats is the unit.
3. Per compressor spec, as DistributedOptimizer runs it: the policy's choice per gradient
   (``compression.Policy``: tensors under 1024 elements stay uncompressed except for casts),
   error feedback where ``create`` adds it, then ``Communicator.reduce`` of each gradient (one
   gradient a bucket: every weight of this MLP is above the 1 MiB bucket size) over a loopback
   transport that completes at once: a summable payload is "reduced" as it is (one rank's sum),
   a gathered record is handed back ``--ranks`` times, so decoding and summing cost what they
   cost a rank of a ``--ranks``-rank job. Reported: ``compress`` (the ``compress`` calls alone,
   error feedback included) and ``total`` (the whole reduce: compress, packing, decompress,
   summing, writing back), each in ms and in passes, median and [min-max] over ``--repeats``
   (after one untimed call: numba's compile, first allocations). Each time is divided by a
   pass timed just before it, so a machine whose load changes during the run still gives
   in-run ratios. In training all of it runs on the engine thread, not the training thread
   (compression/communicator.py).

No communication happens: this is the CPU cost a step pays on top of the link's time.
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from commlayer.comm.communicator import Communicator  # noqa: E402
from commlayer.common.reduce_ops import ReduceOp  # noqa: E402
from commlayer.compression import Policy  # noqa: E402
from commlayer.core.future import Future  # noqa: E402

SPECS = [
    "none",
    "fp16",
    "bf16",
    "qsgd:levels=127",
    "qsgd:levels=7",
    "topk:ratio=0.01,mode=exact",
    "topk:ratio=0.01,mode=sampled",
    "randomk:ratio=0.01",
    "efsignsgd",
    "onebit",
    "powersgd:rank=4",
]


class _Loopback:
    """A transport that completes every call at once: ``ranks`` copies of each gathered record."""

    chains_rounds = True

    def __init__(self, ranks: int) -> None:
        self.rank, self.size = 0, ranks

    def _done(self, value: Any) -> Future:
        future = Future("loopback")
        future.set_result(value)
        return future

    def allreduce_(self, tensors: list[torch.Tensor], name: str, op: Any, prescale: float,
                   postscale: float) -> Future:  # fmt: skip
        return self._done(tensors)

    def allgather_bytes(self, record: torch.Tensor, name: str) -> Future:
        return self._done(record.repeat(self.size))

    def sparse(self, *args: Any) -> None:
        return None


def gradients() -> list[tuple[str, torch.Tensor]]:
    from train import mlp

    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(32, 768), torch.randint(0, 1000, (32,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    spec: str, grads: list[tuple[str, torch.Tensor]], ranks: int, repeats: int,
    one_pass: Callable[[], Any],
) -> dict[str, list[float]]:  # fmt: skip
    """Per repeat: seconds of the compress calls alone and of the whole reduce, and each as a
    ratio to one pass timed just before it (an in-run ratio: the load on the machine changes
    between repeats, much less between a pass and the call beside it)."""
    policy = Policy(spec, rank=0, seed=0)
    chosen = [(name, g, policy.choose(name, g)) for name, g in grads]
    comm = Communicator(_Loopback(ranks), ReduceOp.Average)
    work = [(name, g.clone(), c) for name, g, c in chosen]

    def compress_only() -> None:
        for name, g, c in work:
            if c.name != "none":
                c.compress(g, "grad." + name)

    def refill() -> None:
        for (_, g, _), (_, src, _) in zip(work, chosen):
            g.copy_(src)  # the gradient as backward left it (reduce writes in place)

    def total() -> None:
        for name, g, c in work:
            comm.reduce([g], c, "grad." + name).wait()

    refill()
    total()  # untimed: compile, first allocations
    compress_only()
    out: dict[str, list[float]] = {"compress": [], "total": [], "compress/pass": [],
                                   "total/pass": []}  # fmt: skip
    for _ in range(repeats):
        unit = _time(one_pass)
        seconds = _time(compress_only)
        out["compress"].append(seconds)
        out["compress/pass"].append(seconds / unit)
        refill()
        unit = _time(one_pass)
        seconds = _time(total)
        out["total"].append(seconds)
        out["total/pass"].append(seconds / unit)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="records each gathered call decodes")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--specs", type=lambda s: s.split(";"), default=SPECS,
                        help="';'-separated compressor specs")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    grads = gradients()
    nbytes = sum(g.numel() * g.element_size() for _, g in grads)
    dst = [torch.empty_like(g) for _, g in grads]

    def one_pass() -> None:
        for d, (_, g) in zip(dst, grads):
            d.copy_(g)

    one_pass()
    passes = [_time(one_pass) for _ in range(args.repeats)]
    unit = statistics.median(passes)
    lines = [
        f"# Compressor cost on the CPU ({datetime.date.today()}, {platform.node()}, "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)",
        "",
        f"Command: `OMP_NUM_THREADS=1 python benchmarks/compress_cost.py --ranks {args.ranks} "
        f"--repeats {args.repeats}`",
        "",
        f"Gradients of train.py's MLP: {nbytes / 1e6:.1f} MB in {len(grads)} tensors. "
        f"**1 pass** = `copy_` of every gradient into a buffer (each byte read once and written "
        f"once): {unit * 1e3:.2f} ms median [{min(passes) * 1e3:.2f}-{max(passes) * 1e3:.2f}] "
        f"= {nbytes * 2 / unit / 1e9:.1f} GB/s read+write; passes below are each call's time "
        f"over a pass timed just before it. Gathered payloads are decoded "
        f"{args.ranks} times (a rank of a {args.ranks}-rank job). Medians [min-max] over "
        f"{args.repeats} repeats.",
        "",
        "| spec | compress ms | compress passes | total ms | total passes |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    for spec in args.specs:
        got = measure(spec, grads, args.ranks, args.repeats, one_pass)

        def cell(ts: list[float], scale: float = 1.0, digits: int = 2) -> str:
            med, low, high = statistics.median(ts), min(ts), max(ts)
            return f"{med * scale:.{digits}f} [{low * scale:.{digits}f}-{high * scale:.{digits}f}]"

        row = (
            f"| `{spec}` | {cell(got['compress'], 1e3, 1)} | {cell(got['compress/pass'])} | "
            f"{cell(got['total'], 1e3, 1)} | {cell(got['total/pass'])} |"
        )
        lines.append(row)
        print(row, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
