"""Kernel benchmark: every dispatched kernel under each implementation, on the CPU (torch
reference, numba) or on a CUDA device (torch reference, numba-cuda, CuPy against the device's
copy bandwidth); which one ``COMMLAYER_KERNELS=auto`` should run.

    OMP_NUM_THREADS=1 python benchmarks/kernels.py [--numel 4194304] [--reps 7]
        [--out benchmarks/results/kernels.md]
    python benchmarks/kernels.py --device cuda [--numel 67108864,4194304] [--reps 25]
        [--out benchmarks/results/kernels_cuda.md]

1. Inputs: ``--numel`` float32 elements (random normal); sparse lists at 1% density with
   random supports (merge, scatter-add); QSGD at 8 bits / 512-element buckets, 4 bits / 512
   and 16 bits (levels 1000); signs of the same tensor. Built on the CPU from one seeded
   generator, then moved to ``--device`` (the same numbers on both).
2. Warm-up calls first (numba compiles, or loads its cache; CuPy compiles with NVRTC): one on
   the CPU, ``CUDA_WARMUP`` on CUDA; then the median of ``--reps`` calls, the implementations
   interleaved so drifts hit all alike. On CUDA two ways, each timed by CUDA events: *queued*,
   ``QUEUE`` calls issued back to back between two events (per call: the span over QUEUE), the
   device kept busy as in a training step, so the time is the kernel's own wherever the host
   issues calls faster than the device runs them (the bandwidth columns and the target use
   it); and *from idle*, one call on an idle device, launch and Python overhead included (the
   latency a lone call sees). Host synchronisations a kernel makes count in both (counted per
   call with torch's sync debug mode).
3. GB/s: the bytes a kernel must read and write (inputs + outputs) over its time. On CUDA the
   baseline and physical limit is a device-to-device ``dst.copy_(src)`` of half those bytes
   (so it reads and writes as many), measured in the same run, interleaved with the kernels;
   "% copy" is a kernel's GB/s over the copy's (issue 25: >= 70% for the memory-bound kernels).
4. Each implementation's first output is compared with torch's (the tests' contract: equal);
   a cell says so where it differs, where an implementation has no such kernel (dispatch runs
   the reference) and, with the error's first line, where it raised.
The faster implementation per kernel is what dispatch picks under ``auto`` (a kernel where
torch is at least as fast on the CPU is listed in ``commlayer.kernels.TORCH_FASTER_ON_CPU``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

from commlayer import kernels

CUDA_WARMUP = 3  # calls: the first compiles; the next two let clocks and caches settle
QUEUE = 10  # calls issued back to back per queued sample
QUEUED_REPS = 9  # queued samples (of QUEUE calls each) per kernel; their median is reported
MEMORY_BOUND = ("scatter_add_", "threshold_select", "pack_signs", "decode_signs", "qsgd_")
TARGET_OF_COPY = 0.70  # issue 25: memory-bound kernels at >= 70% of the copy bandwidth
LABELS = {"cpu": {"numba": "numba"}, "cuda": {"numba": "numba-cuda", "cupy": "cupy"}}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call: ``call(choice)``, the bytes it must move, and the dispatch name and
    operand (``kernels.implementation(kernel, operand, choice)`` says what runs)."""

    call: Callable[[str], object]
    moved_bytes: int
    kernel: str
    operand: torch.Tensor


def cases(n: int, device: torch.device, choices: list[str]) -> dict[str, Case]:
    """name -> Case, inputs drawn on the CPU in a fixed order and then moved to ``device``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    nnz = n // 100
    a = torch.randperm(n, generator=g)[:nnz].sort().values.int()
    b = torch.randperm(n, generator=g)[:nnz].sort().values.int()
    va, vb = torch.randn(nnz, generator=g), torch.randn(nnz, generator=g)
    bucket = 512
    rand = torch.rand((n // bucket, bucket), generator=g)
    x, a, b, va, vb, rand = (t.to(device) for t in (x, a, b, va, vb, rand))
    dense = {c: torch.zeros(n, device=device) for c in choices}  # one each: outputs compared
    out = {
        "merge_sum (1% + 1%)": Case(
            lambda c: kernels.merge_sum(a, va, b, vb, c), 4 * 8 * nnz, "merge_sum", va
        ),
        "scatter_add_ (1%)": Case(
            lambda c: kernels.scatter_add_(dense[c], a, va, c), 3 * 8 * nnz, "scatter_add_", x
        ),
        r"threshold_select (\|x\| >= 2.5)": Case(
            lambda c: kernels.threshold_select(x, 2.5, c), 4 * n, "threshold_select", x
        ),
        "pack_signs": Case(lambda c: kernels.pack_signs(x, c), 4 * n + n // 8, "pack_signs", x),
    }
    words = kernels.pack_signs(x, "torch")
    pos, neg = torch.tensor(0.5, device=device), torch.tensor(-0.5, device=device)
    out["decode_signs"] = Case(
        lambda c: kernels.decode_signs(words, n, pos, neg, c), 4 * n + n // 8, "decode_signs", pos
    )
    rows = x[: n // bucket * bucket].view(-1, bucket)
    norms = torch.linalg.vector_norm(rows, dim=1)
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

        out[f"qsgd_quantize ({bits} bits)"] = Case(quantize, moved, "qsgd_quantize", rows)
        out[f"qsgd_dequantize ({bits} bits)"] = Case(
            dequantize, moved - 4 * rows.numel(), "qsgd_dequantize", step
        )
    return out


def timed_call(
    call: Callable[[], object], device: torch.device, queue: int = 1
) -> tuple[float, object]:
    """Seconds per call and the first call's result; on CUDA between events, from an idle
    device, ``queue`` calls issued back to back (the span over ``queue``)."""
    if device.type != "cuda":
        start = time.perf_counter()
        result = call()
        return time.perf_counter() - start, result
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    result = call()
    for _ in range(queue - 1):
        call()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / queue, result


def first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}"[:120].replace("|", r"\|")


def measure(
    calls: dict[str, Callable[[], object]],
    reps: int,
    warmup: int,
    device: torch.device,
    queue: int = 1,
) -> tuple[dict[str, float | str], dict[str, object]]:
    """Median seconds per call of each (or its error's first line), and each first result.
    The calls are interleaved; one that raises is dropped from the later rounds."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    errors: dict[str, str] = {}
    first: dict[str, object] = {}
    for rep in range(warmup + reps):
        for name, call in calls.items():
            if name in errors:
                continue
            try:
                seconds, result = timed_call(call, device, queue)
            except Exception as error:  # reported in the table: one kernel must not end the run
                errors[name] = first_line(error)
                continue
            first.setdefault(name, result)
            if rep >= warmup:
                samples[name].append(seconds)
    return {name: errors.get(name) or statistics.median(samples[name]) for name in calls}, first


def same(a: object, b: object) -> bool:
    """Equal results: tensors of one dtype and shape with equal elements, tuples of them."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def host_syncs(call: Callable[[], object]) -> int | str:
    """Synchronising CUDA operations torch sees in one call (``.item()``, ``nonzero``, ...;
    none made inside CuPy or numba is seen)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        except Exception:  # its error is in the row already
            return "?"
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen)


def fallback(case: Case, choice: str) -> bool:
    """Whether dispatch runs the torch reference for ``choice`` (no such kernel there)."""
    try:
        module = kernels.implementation(case.kernel, case.operand, choice)
    except ValueError:  # the library cannot be imported: its call raises, reported as such
        return False
    return choice != "torch" and module is kernels.reference


def cpu_row(name: str, case: Case, choices: list[str], reps: int) -> str:
    device = case.operand.device
    seconds, first = measure({c: lambda c=c: case.call(c) for c in choices}, reps, 1, device)
    cells = []
    for c in choices:
        s = seconds[c]
        if isinstance(s, str):
            cells.append(f"{s} | ")
            continue
        note = "" if c == "torch" or same(first[c], first["torch"]) else " (differs from torch)"
        cells.append(f"{s * 1e3:,.2f}{note} | {case.moved_bytes / s / 1e9:,.2f}")
    s0, s1 = seconds[choices[0]], seconds[choices[-1]]
    ratio = ""
    if len(choices) > 1 and isinstance(s0, float) and isinstance(s1, float):
        ratio = f"{s0 / s1:.2f}x"
    return f"| {name} | {' | '.join(cells)} | {ratio} |"


def cuda_row(name: str, case: Case, choices: list[str], reps: int) -> str:
    device = case.operand.device
    half = case.moved_bytes // 2
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    calls: dict[str, Callable[[], object]] = {"copy": lambda: dst.copy_(src)}
    calls.update({c: lambda c=c: case.call(c) for c in choices if not fallback(case, c)})
    idle, first = measure(calls, reps, CUDA_WARMUP, device)
    # compared before the queued rounds and host_syncs call again (scatter_add_ accumulates
    # into its output)
    differs = {c: c != "torch" and "torch" in first and not same(first[c], first["torch"])
               for c in first}  # fmt: skip
    queued, _ = measure({c: call for c, call in calls.items() if isinstance(idle[c], float)},
                        QUEUED_REPS, 1, device, QUEUE)  # fmt: skip
    copy = queued.get("copy", idle["copy"])
    copy_gbs = 2 * half / copy / 1e9 if isinstance(copy, float) else 0.0
    cells = [f"{case.moved_bytes / 1e6:,.1f}"]
    if copy_gbs:
        cells.append(f"{copy * 1e3:,.3f} | {copy_gbs:,.0f} | {idle['copy'] * 1e3:,.3f}")
    else:
        cells.append(f"{copy} | | ")
    syncs, met = [], []
    for c in choices:
        s = queued.get(c, idle.get(c))
        if not isinstance(s, float):
            missing = f"no {LABELS['cuda'][c]} kernel (torch runs)" if s is None else s
            cells.append(f"{missing} | | | ")
            syncs.append("-")
            continue
        gbs = case.moved_bytes / s / 1e9
        note = " (differs from torch)" if differs[c] else ""
        share = f"{gbs / copy_gbs:.0%}" if copy_gbs else ""
        cells.append(f"{s * 1e3:,.3f}{note} | {gbs:,.0f} | {share} | {idle[c] * 1e3:,.3f}")
        syncs.append(str(host_syncs(lambda c=c: case.call(c))))
        if copy_gbs and gbs >= TARGET_OF_COPY * copy_gbs and not differs[c]:
            met.append(LABELS["cuda"].get(c, c))
    verdict = (", ".join(met) or "none") if case.kernel.startswith(MEMORY_BOUND) else ""
    return f"| {name} | {' | '.join(cells)} | {' / '.join(syncs)} | {verdict} |"


def header(device: torch.device, choices: list[str], args: argparse.Namespace) -> list[str]:
    sizes = " and ".join(f"{n:,}" for n in args.numel)
    if device.type != "cuda":
        return [
            "# kernels on the CPU: torch reference vs numba",
            "",
            f"`OMP_NUM_THREADS={torch.get_num_threads()} python {' '.join(sys.argv)}`",
            "",
            f"{datetime.date.today()}, {platform.node()}, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s), n = {sizes} float32, median of {args.reps}",
        ]
    names = ", ".join(LABELS["cuda"].get(c, c) for c in choices)
    absent = [lib for lib in ("numba-cuda", "cupy") if not kernels.available()[lib]]
    names += f" ({', '.join(absent)}: not importable here)" if absent else ""
    return [
        f"# kernels on CUDA: {names}, against the device's copy bandwidth",
        "",
        f"`python {' '.join(sys.argv)}`",
        "",
        f"{datetime.date.today()}, {platform.node()}, {torch.cuda.get_device_name(device)}, "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {versions()}; "
        f"n = {sizes} float32; timed by CUDA events: *queued* (ms, GB/s, % copy) is the median "
        f"of {QUEUED_REPS} spans of {QUEUE} calls issued back to back, per call (the device kept "
        "busy: the kernel's own time where the host issues faster than the device runs); *idle "
        f"ms* is the median of {args.reps} lone calls after {CUDA_WARMUP} warm-up, each from an "
        "idle device (launch and Python overhead included)",
        "",
        "Baseline and physical limit: `dst.copy_(src)` device to device of half the kernel's "
        "bytes (reads and writes as many as the kernel must), timed the same ways and "
        "interleaved; GB/s counts bytes read + written. % copy = kernel GB/s / copy GB/s, both "
        f"queued. Last column: implementations at >= {TARGET_OF_COPY:.0%} of the copy for the "
        "memory-bound kernels (issue 25's target). Host syncs: synchronising operations torch saw "
        "in one call (`torch.cuda.set_sync_debug_mode`; any inside CuPy or numba is not seen); "
        "they are part of the kernel's cost (a queue drains at each): threshold_select and "
        "merge_sum read their output's size, qsgd_dequantize returns the largest level as a "
        "Python int, and numba-cuda's decode_signs reads `positive`/`negative` with `.item()` "
        "(CuPy's reads them on the device).",
    ]


def versions() -> str:
    found = []
    for dist in ("numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or "no numba-cuda, no CuPy"


def table_head(device: torch.device, choices: list[str]) -> list[str]:
    if device.type != "cuda":
        cells = " | ".join(f"{c} ms | {c} GB/s" for c in choices)
        return [
            f"| kernel | {cells} | numba speed-up |",
            "| --- | " + " | ".join("---: | ---:" for _ in choices) + " | ---: |",
        ]
    labels = [LABELS["cuda"].get(c, c) for c in choices]
    return [
        "| kernel | MB moved | copy ms | copy GB/s | copy idle ms | "
        + " | ".join(f"{c} ms | {c} GB/s | {c} % copy | {c} idle ms" for c in labels)
        + f" | host syncs ({' / '.join(labels)}) | >= {TARGET_OF_COPY:.0%} copy |",
        "| --- | ---: | ---: | ---: | ---: | "
        + " | ".join("---: | ---: | ---: | ---:" for _ in labels) + " | ---: | --- |",
    ]  # fmt: skip


def implementations(device: torch.device) -> list[str]:
    found = kernels.available()
    if device.type != "cuda":
        return ["torch"] + (["numba"] if found["numba"] else [])
    return ["torch"] + [c for c, lib in (("numba", "numba-cuda"), ("cupy", "cupy")) if found[lib]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument(
        "--numel",
        type=lambda text: [int(n) for n in text.split(",")],
        help="elements, comma-separated for several tables (default: 4194304 on the CPU, "
        "67108864,4194304 on CUDA: launches must not dominate)",
    )
    parser.add_argument("--reps", type=int, help="timed calls (default 7 on the CPU, 25 on CUDA)")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.numel = args.numel or ([1 << 26, 1 << 22] if cuda else [1 << 22])
    args.reps = args.reps or (25 if cuda else 7)
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)  # fmt: skip
        torch.cuda.set_device(device)
    choices = implementations(device)
    lines = [*header(device, choices, args), ""]
    print("\n".join(lines), flush=True)
    row = cuda_row if cuda else cpu_row
    for n in args.numel:
        head = [f"## n = {n:,}", ""] if len(args.numel) > 1 else []
        lines += [*head, *table_head(device, choices)]
        print("\n".join([*head, *table_head(device, choices)]), flush=True)
        for name, case in cases(n, device, choices).items():
            lines.append(row(name, case, choices, args.reps))
            print(lines[-1], flush=True)
        lines.append("")
        print(flush=True)
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
