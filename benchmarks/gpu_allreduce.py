"""GPU allreduce benchmark (issue 25): commlayer's allreduce of CUDA float32 tensors, 4 KiB ..
256 MiB, against torch.distributed's NCCL (one process) or MPI by hand (several ranks sharing a
GPU), measured in the same run.

    python benchmarks/gpu_allreduce.py --out benchmarks/results/gpu_allreduce_np1.md
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/gpu_allreduce.py \\
        --out benchmarks/results/gpu_allreduce_np2.md            (also -n 4)
    [--device cpu] [--min-size 4KiB] [--max-size 256MiB] [--reps 5] [--target-s 0.1]

``--device cpu`` runs every path but the CUDA ones (no pinned memory, no NCCL: gloo), which is
how the script is tested without a GPU.

One process (``python``, or ``mpiexec -n 1``):
1. ``torch.distributed.init_process_group("nccl")`` at world size 1 (a file:// rendezvous),
   then ``commlayer.init()``: over an initialized torch.distributed commlayer's ``auto`` backend
   is its torch one (a gloo group of its own). With a GPU per rank that backend also makes an
   NCCL group and takes CUDA tensors directly (commlayer/core/device.py); ``COMMLAYER_NCCL=0``
   stages them through pinned host memory as before (the header names the path).
2. Per size, each call followed by ``torch.cuda.synchronize()``: NCCL's ``all_reduce``,
   commlayer's ``allreduce_``, ``allreduce_async_`` + ``synchronize``, and the pinned
   device-to-host + host-to-device copy of the tensor (what staging must at least move).
3. One GPU cannot measure bus bandwidth: at one rank an allreduce moves nothing between GPUs,
   and NCCL refuses two ranks on one device. The table gives per-call latency and commlayer's
   overhead per call over NCCL's.

Several ranks (``mpiexec -n N``, N >= 2; rank r on GPU r % count, so all on one here):
1. commlayer over MPI (``commlayer.init()``, torch.distributed left uninitialized), CUDA
   tensors staged by commlayer through pinned host buffers.
2. The naive user's baseline: ``t.cpu()``, ``Comm.Allreduce`` in place on its numpy view,
   ``t.copy_`` back; the lower bound: ``Comm.Allreduce`` of a host buffer of the same bytes, no
   GPU copies.
3. The physical limits, measured at each size by every rank at once (as during an allreduce):
   the pinned D2H + H2D copy bandwidth (the ranks share the host-device link) and host memcpy
   bandwidth; "floor" = host allreduce + D2H + H2D, a staged allreduce that does not overlap
   its copies with the reduction.
busbw = bytes / time * 2(n-1)/n (what each link carries in a bandwidth-optimal allreduce).

Timing: allreduce.py's ``measure`` (slowest rank's mean per call over a loop of about
``--target-s``, median of ``--reps`` loops) after ``--warmup`` calls. The first call is checked:
each rank fills the tensor with rank + 1 and expects n(n+1)/2 everywhere; then it holds zeros
(sums stay 0). A system that raises (commlayer refusing CUDA tensors, say) or sums wrong on any
rank is reported in its cells and not run again: the ranks agree on it over MPI, so every rank
runs the same calls and none is left waiting. Rank 0 prints each row as it comes and rewrites
``--out`` after each.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from allreduce import human, measure, parse_bytes, sizes

import commlayer as cl
from commlayer.backends.mpi import MPI, library_version

Call = Callable[[], object]


@dataclasses.dataclass
class System:
    """One thing timed per size: ``make(nbytes)`` returns the call and the float32 buffer it
    reduces (None for a copy, which has no sum to check)."""

    label: str
    make: Callable[[int], tuple[Call, torch.Tensor | None]]
    failure: str = ""  # set once, the same on every rank: skipped from then on


class Bench:
    """One run's device and world, and the call each system makes at a size (``make``)."""

    def __init__(self, args: argparse.Namespace, world: MPI.Comm, device: torch.device) -> None:
        self.args, self.world, self.device = args, world, device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def tensor(self, nbytes: int, where: str = "device") -> torch.Tensor:
        device = self.device if where == "device" else torch.device("cpu")
        pin = where == "pinned" and self.cuda
        return torch.zeros(nbytes // 4, dtype=torch.float32, device=device, pin_memory=pin)

    def synced(self, fn: Call) -> Call:
        def call() -> None:
            fn()
            self.sync()

        return call

    def commlayer(self, nbytes: int) -> tuple[Call, torch.Tensor]:
        t = self.tensor(nbytes)
        return self.synced(lambda: cl.allreduce_(t, op=cl.Sum, name=f"gpu.{nbytes}")), t

    def commlayer_async(self, nbytes: int) -> tuple[Call, torch.Tensor]:
        t = self.tensor(nbytes)
        name = f"gpu.async.{nbytes}"
        return self.synced(lambda: cl.synchronize(cl.allreduce_async_(t, op=cl.Sum, name=name))), t

    def torch_distributed(self, nbytes: int) -> tuple[Call, torch.Tensor]:
        t = self.tensor(nbytes)
        return self.synced(lambda: dist.all_reduce(t)), t

    def naive(self, nbytes: int) -> tuple[Call, torch.Tensor]:
        t = self.tensor(nbytes)

        def call() -> None:
            host = t.cpu()
            self.world.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
            t.copy_(host)

        return self.synced(call), t

    def host(self, nbytes: int) -> tuple[Call, torch.Tensor]:
        buf = self.tensor(nbytes, "cpu")
        array = buf.numpy()
        return lambda: self.world.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM), buf

    def staging_copy(self, nbytes: int) -> tuple[Call, None]:
        t, pinned = self.tensor(nbytes), self.tensor(nbytes, "pinned")

        def call() -> None:
            pinned.copy_(t, non_blocking=True)
            t.copy_(pinned, non_blocking=True)

        return self.synced(call), None

    def memcpy(self, nbytes: int) -> tuple[Call, None]:
        src, dst = self.tensor(nbytes, "cpu"), self.tensor(nbytes, "cpu")
        return lambda: dst.copy_(src), None

    def first_calls(self, system: System, nbytes: int) -> Call | None:
        """The system's call at this size after its checked first call and warm-up, or None
        (``system.failure`` set, on every rank alike) when a rank raised or summed wrong."""
        n, rank = self.world.size, self.world.rank
        call, problem = None, ""
        try:
            call, buf = system.make(nbytes)
            if buf is not None:
                buf.fill_(rank + 1)
                call()
                if not bool((buf == n * (n + 1) / 2).all()):
                    problem = f"wrong sum at {human(nbytes)} (rank {rank})"
                buf.zero_()
            for _ in range(self.args.warmup - (buf is not None)):
                call()
        except Exception as error:  # reported in the table (a refusal of CUDA tensors, say)
            text = (str(error).strip().splitlines() or [""])[0]
            problem = f"{type(error).__name__}: {text} (rank {rank})"
        problems = [p for p in self.world.allgather(problem) if p]
        if problems:
            system.failure = problems[0][:200].replace("|", r"\|")
            return None
        return call

    def times(self, systems: dict[str, System], nbytes: int) -> dict[str, float | str]:
        """Seconds per call of each system at this size, or why it has none ("" : as above)."""
        out: dict[str, float | str] = {}
        for key, system in systems.items():
            if system.failure:
                out[key] = ""
                continue
            call = self.first_calls(system, nbytes)
            out[key] = measure(call, self.args, self.world) if call else system.failure
        return out


def single_process_systems(bench: Bench, backend: str) -> dict[str, System]:
    return {
        "torch": System(f"torch.distributed {backend} `all_reduce`", bench.torch_distributed),
        "cl": System("commlayer `allreduce_`", bench.commlayer),
        "cl_async": System("commlayer `allreduce_async_` + `synchronize`", bench.commlayer_async),
        "copy": System("pinned D2H + H2D copy", bench.staging_copy),
    }


def multi_rank_systems(bench: Bench) -> dict[str, System]:
    return {
        "cl": System("commlayer `allreduce_`", bench.commlayer),
        "naive": System("naive: `t.cpu()`, `Allreduce`, `t.copy_`", bench.naive),
        "host": System("host `Allreduce` (no GPU copies)", bench.host),
        "copy": System("pinned D2H + H2D copy", bench.staging_copy),
        "memcpy": System("host memcpy", bench.memcpy),
    }


def us(t: float | str) -> str:
    return f"{t * 1e6:,.0f}" if isinstance(t, float) else (t or "as above")


def faster(a: float | str, b: float | str) -> str:
    """How many times faster the system that took ``a`` seconds is than the one that took ``b``
    (the table's "a / b": above 1, a is faster)."""
    return f"{b / a:.2f}" if isinstance(a, float) and isinstance(b, float) else "-"


def gbs(nbytes: float, t: float | str) -> str:
    return f"{nbytes / t / 1e9:,.2f}" if isinstance(t, float) else "-"


def single_process_rows(
    systems: dict[str, System], backend: str
) -> tuple[list[str], Callable[..., str]]:
    label = {k: s.label for k, s in systems.items()}
    head = [
        "| size | "
        + " | ".join(f"{label[k]} µs" for k in systems)
        + f" | `allreduce_` overhead µs/call | async overhead µs/call | {backend} / `allreduce_` |",
        "| ---: |" + " ---: |" * (len(systems) + 3),
    ]

    def row(nbytes: int, t: dict[str, float | str]) -> str:
        over = [
            f"{(t[k] - t['torch']) * 1e6:,.0f}"
            if isinstance(t[k], float) and isinstance(t["torch"], float)
            else "-"
            for k in ("cl", "cl_async")
        ]
        cells = [us(t[k]) for k in systems] + over + [faster(t["torch"], t["cl"])]
        return f"| {human(nbytes)} | " + " | ".join(cells) + " |"

    return head, row


def multi_rank_rows(systems: dict[str, System], n: int) -> tuple[list[str], Callable[..., str]]:
    factor = 2 * (n - 1) / n
    head = [
        "| size | commlayer µs | naive µs | host `Allreduce` µs | commlayer busbw GB/s | naive "
        "busbw GB/s | host busbw GB/s | commlayer / naive | commlayer / host (lower bound) | "
        "pinned D2H+H2D GB/s per rank | host memcpy GB/s per rank | floor µs (host + copies) | "
        "commlayer / floor |",
        "| ---: |" + " ---: |" * 12,
    ]

    def row(nbytes: int, t: dict[str, float | str]) -> str:
        floor: float | str = "-"
        if isinstance(t["host"], float) and isinstance(t["copy"], float):
            floor = t["host"] + t["copy"]
        cells = [us(t[k]) for k in ("cl", "naive", "host")]
        cells += [gbs(nbytes * factor, t[k]) for k in ("cl", "naive", "host")]
        cells += [faster(t["cl"], t["naive"]), faster(t["cl"], t["host"])]
        cells += [gbs(2 * nbytes, t["copy"]), gbs(2 * nbytes, t["memcpy"])]
        cells += [us(floor) if isinstance(floor, float) else "-", faster(t["cl"], floor)]
        return f"| {human(nbytes)} | " + " | ".join(cells) + " |"

    return head, row


def _staged(bench: Bench) -> bool:
    """Whether commlayer stages this run's tensors through the host (device.py decides)."""
    from commlayer.core import device, runtime

    backend = runtime.engine().backend(0)
    return bench.device.type != "cuda" or device.path(backend, bench.device, torch.float32) is None


def header(bench: Bench, backend: str) -> list[str]:
    world, device = bench.world, bench.device
    where = torch.cuda.get_device_name(device) if bench.cuda else platform.processor() or "CPU"
    nccl = ""
    if bench.cuda:
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int before
        nccl = f", NCCL {'.'.join(map(str, version)) if isinstance(version, tuple) else version}"
    command = ["mpiexec -n", str(world.size)] if world.size > 1 else []
    lines = [
        f"# commlayer allreduce of {device.type} float32 tensors, {world.size} rank(s)",
        "",
        f"`{' '.join([*command, 'python', *sys.argv])}`",
        "",
        f"{datetime.date.today()}, {platform.node()}, {where}, torch {torch.__version__}"
        f"{nccl}, {library_version()}, commlayer backend: {cl.backend_name()} (CUDA tensors "
        f"{'staged' if _staged(bench) else 'direct'}); per-call time "
        f"with the device synchronized after each call, slowest rank, median of "
        f"{bench.args.reps} loops of ~{bench.args.target_s:g} s after {bench.args.warmup} "
        "warm-up calls (the first checked: every rank's sum right)",
        "",
    ]
    if world.size == 1:
        lines.append(
            f"One rank: per-call latency and commlayer's overhead per call over {backend}'s; "
            "**one GPU cannot measure bus bandwidth** (at one rank an allreduce moves nothing "
            "between GPUs, and NCCL refuses two ranks on one device: no second GPU here). "
            "The pinned copy column is what commlayer's staging must move at least."
        )
    else:
        lines.append(
            f"{world.size} ranks sharing the GPU(s) (rank r on GPU r % count). Ratios are of "
            "speeds (above 1, commlayer is faster). Physical limits, measured at each size by "
            "every rank at once: the pinned D2H+H2D copy (2 x size bytes over the host-device "
            "link, which the ranks share) and host memcpy (read + written); floor = host "
            "`Allreduce` + the copies, a staged allreduce that does not overlap them."
        )
    return [*lines, ""]


def start(args: argparse.Namespace, world: MPI.Comm, folder: str) -> tuple[Bench, str]:
    """torch.distributed (one process only) and commlayer up; (the Bench, the torch.distributed
    backend or "")."""
    device = torch.device(args.device)
    if device.type == "cuda":
        local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = ""
    if world.size == 1:  # commlayer's auto backend then runs over torch.distributed
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{folder}/rendezvous", rank=0, world_size=1
        )
    cl.init()
    return Bench(args, world, device), backend


def report(lines: list[str], args: argparse.Namespace, world: MPI.Comm, new: str) -> None:
    """Rank 0 prints ``new`` and rewrites ``--out`` with every line so far (a run cut short
    keeps its rows)."""
    if world.rank != 0:
        return
    print(new, flush=True)
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to test the script")
    parser.add_argument("--min-size", type=parse_bytes, default=4 << 10)
    parser.add_argument("--max-size", type=parse_bytes, default=256 << 20)
    parser.add_argument("--reps", type=int, default=5, help="timed loops per size")
    parser.add_argument("--target-s", type=float, default=0.1, help="seconds per loop")
    parser.add_argument("--max-iters", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls, the first checked")
    parser.add_argument("--out", help="also write the table here (rank 0)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    with tempfile.TemporaryDirectory() as folder:
        bench, backend = start(args, world, folder)
        if world.size == 1:
            systems = single_process_systems(bench, backend)
            head, row = single_process_rows(systems, backend)
        else:
            systems = multi_rank_systems(bench)
            head, row = multi_rank_rows(systems, world.size)
        lines = [*header(bench, backend or "MPI"), *head]
        report(lines, args, world, "\n".join(lines))
        for nbytes in (s for s in sizes(args.max_size) if s >= args.min_size):
            lines.append(row(nbytes, bench.times(systems, nbytes)))
            report(lines, args, world, lines[-1])
        failures = [f"- {s.label}: {s.failure}" for s in systems.values() if s.failure]
        if failures:
            lines += ["", "Failed (not run again from the first size it failed at):", *failures]
            report(lines, args, world, "\n".join(lines[-len(failures) - 2 :]))
        cl.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
