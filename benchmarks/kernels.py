"""Kernel benchmark: every dispatched kernel under each CPU implementation (torch reference,
numba), at one size; which one ``COMMLAYER_KERNELS=auto`` should run on the CPU.

    OMP_NUM_THREADS=1 python benchmarks/kernels.py [--numel 4194304] [--reps 7]
        [--out benchmarks/results/kernels.md]

1. Inputs: ``--numel`` float32 elements (random normal); sparse lists at 1% density with
   random supports (merge, scatter-add); QSGD at 8 bits / 512-element buckets, 4 bits / 512
   and 16 bits (levels 1000); signs of the same tensor.
2. One untimed call first (numba compiles, or loads its cache, there); then the median of
   ``--reps`` calls, the implementations interleaved so drifts hit both alike.
3. GB/s: the bytes a kernel must read and write (inputs + outputs) over its time.
The faster implementation per kernel is what dispatch picks under ``auto`` (a kernel where
torch is at least as fast is listed in ``commlayer.kernels.TORCH_FASTER_ON_CPU``).
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

from commlayer import kernels


def cases(n: int) -> dict[str, tuple[Callable[[str], object], int]]:
    """name -> (call with a choice, bytes moved)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    nnz = n // 100
    a = torch.randperm(n, generator=g)[:nnz].sort().values.int()
    b = torch.randperm(n, generator=g)[:nnz].sort().values.int()
    va, vb = torch.randn(nnz, generator=g), torch.randn(nnz, generator=g)
    dense = torch.zeros(n)
    out: dict[str, tuple[Callable[[str], object], int]] = {
        "merge_sum (1% + 1%)": (lambda c: kernels.merge_sum(a, va, b, vb, c), 4 * 8 * nnz),
        "scatter_add_ (1%)": (lambda c: kernels.scatter_add_(dense, a, va, c), 3 * 8 * nnz),
        "threshold_select (|x| >= 2.5)": (lambda c: kernels.threshold_select(x, 2.5, c), 4 * n),
        "pack_signs": (lambda c: kernels.pack_signs(x, c), 4 * n + n // 8),
    }
    words = kernels.pack_signs(x, "torch")
    pos, neg = torch.tensor(0.5), torch.tensor(-0.5)
    out["decode_signs"] = (lambda c: kernels.decode_signs(words, n, pos, neg, c), 4 * n + n // 8)
    bucket = 512
    rows = x[: n // bucket * bucket].view(-1, bucket)
    norms = torch.linalg.vector_norm(rows, dim=1)
    rand = torch.rand(rows.shape, generator=g)
    for levels, bits in ((127, 8), (7, 4), (1000, 16)):
        scale = levels / norms
        moved = 8 * rows.numel() + rows.numel() * bits // 8

        def quantize(c: str, scale: torch.Tensor = scale, levels: int = levels,
                     bits: int = bits) -> object:  # fmt: skip
            return kernels.qsgd_quantize(rows, scale, rand, levels, bits, c)

        packed = kernels.qsgd_quantize(rows, scale, rand, levels, bits, "torch")
        step = norms / levels

        def dequantize(c: str, packed: torch.Tensor = packed, step: torch.Tensor = step,
                       levels: int = levels, bits: int = bits) -> object:  # fmt: skip
            return kernels.qsgd_dequantize(packed, step, levels, bits, bucket, c)

        out[f"qsgd_quantize ({bits} bits)"] = (quantize, moved)
        out[f"qsgd_dequantize ({bits} bits)"] = (dequantize, moved - 4 * rows.numel())
    return out


def measure(call: Callable[[str], object], choices: list[str], reps: int) -> list[float]:
    times: list[list[float]] = [[] for _ in choices]
    for rep in range(reps + 1):
        for choice, samples in zip(choices, times):
            start = time.perf_counter()
            call(choice)
            if rep:
                samples.append(time.perf_counter() - start)
    return [statistics.median(s) for s in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    choices = ["torch"] + (["numba"] if kernels.available()["numba"] else [])
    lines = [
        "# kernels on the CPU: torch reference vs numba",
        "",
        f"`OMP_NUM_THREADS={torch.get_num_threads()} python {' '.join(sys.argv)}`",
        "",
        f"{datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()}"
        f", torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"n = {args.numel:,} float32, median of {args.reps}",
        "",
        "| kernel | " + " | ".join(f"{c} ms | {c} GB/s" for c in choices) + " | numba speed-up |",
        "| --- | " + " | ".join("---: | ---:" for _ in choices) + " | ---: |",
    ]
    for name, (call, moved) in cases(args.numel).items():
        seconds = measure(call, choices, args.reps)
        cells = " | ".join(f"{s * 1e3:,.2f} | {moved / s / 1e9:,.2f}" for s in seconds)
        ratio = f"{seconds[0] / seconds[-1]:.2f}x" if len(seconds) > 1 else ""
        lines.append(f"| {name} | {cells} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
