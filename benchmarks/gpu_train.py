"""Training step on one CUDA GPU: commlayer's DistributedOptimizer vs PyTorch DDP (issue 25).

    python benchmarks/gpu_train.py [--np 1,2] [--models mlp,resnet] [--out F]
    python benchmarks/gpu_train.py --device cpu --steps 5 --warmup 2   # the driver, no GPU

1. The driver (this script without ``--worker``) launches one job per (system, rank count),
   every rank on the same GPU (``local rank % device count``), and prints a table of median
   step time and samples/s (batch per rank x ranks / step time) with the ratio to DDP at the
   same rank count in the same run. Systems: ``single`` (1 process, no communication: the
   floor); ``ddp`` (torchrun, NCCL: one rank per GPU, so 1 rank here) or ``ddp-gloo`` where
   ranks outnumber GPUs (NCCL refuses two ranks on one device; gloo allreduces CUDA tensors
   through host copies); ``commlayer-mpi`` (``mpiexec -n N``, commlayer over MPI) and
   ``commlayer-torchrun`` (the same worker under torchrun, commlayer over gloo).
2. Each job trains every model of ``--models`` in turn (train.py's MODELS and its step:
   zero_grad, forward, backward, step, SGD momentum), the step bracketed by
   ``torch.cuda.synchronize()`` before each reading of the clock; median over ``--steps``
   steps after ``--warmup``. It prints one RESULT line per model, so a job that dies in the
   second model still reports the first.
3. The physical limit: commlayer (and gloo) stage every gradient through pinned host memory,
   G bytes device to host, the host allreduce, G bytes back, per rank; with N ranks on one GPU
   N x G cross its one host link each way. The ``single`` job measures pinned D2H and H2D
   bandwidth on G bytes; "staging floor" is N x G / D2H + N x G / H2D, and commlayer's rows
   give their time in collectives per step (the host allreduce; see README.md for how it is
   counted). DDP over NCCL keeps the gradients on the device.
4. Bounded: every job has ``--timeout-s`` and all jobs together ``--budget-s``; a worker also
   exits by itself at its job's deadline (torchrun starts its workers in sessions of their
   own, out of the driver's reach). A job that fails, hangs or is not started is a row saying
   why; the tail of its output is printed before the final table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from train import MODELS, RESULT_PREFIX, _mpiexec, _timed_step

WORKERS = ("single", "ddp", "commlayer")
SYSTEMS = ("ddp", "commlayer-mpi", "commlayer-torchrun")  # at each rank count, after "single"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
_KILL_GRACE_S = 10.0  # a launcher gets this long after SIGTERM to stop its ranks


# -- worker: one system, every model, one job ---------------------------------------------------
def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if torch.cuda.device_count() == 0:
        raise RuntimeError(
            f"--device cuda: no CUDA device visible to torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}); --device cpu runs the same on the CPU"
        )
    index = local_rank % torch.cuda.device_count()  # every rank on the one GPU here
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _start(args: argparse.Namespace) -> dict[str, Any]:
    """Start the system's communication: rank, size, device and backend of this process."""
    if args.worker == "single":
        return {"rank": 0, "size": 1, "device": _device(args.device, 0), "backend": "none"}
    if args.worker == "ddp":
        import torch.distributed as dist

        rank, size, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        device = _device(args.device, local)
        nccl = args.ddp_backend == "nccl"  # bound to the device at init (gloo takes none)
        dist.init_process_group(args.ddp_backend, device_id=device if nccl else None)
        return {"rank": rank, "size": size, "device": device, "backend": args.ddp_backend}
    import commlayer as cl

    cl.init()
    device = _device(args.device, cl.local_rank())
    return {"rank": cl.rank(), "size": cl.size(), "device": device, "backend": cl.backend_name()}


def _stop(args: argparse.Namespace) -> None:
    if args.worker == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
    elif args.worker == "commlayer":
        import commlayer as cl

        cl.shutdown()


def _pinned_gbps(nbytes: int, device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """Pinned device-to-host and host-to-device bandwidth (GB/s, median of ``repeats``) for
    one copy of ``nbytes``, this process alone on the device."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(repeats + 1):  # the first of each is a warm-up
        for way, dst, src in (("d2h", host, on_device), ("h2d", on_device, host)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates[way].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates["d2h"][1:]), statistics.median(rates["h2d"][1:])


def _train(args: argparse.Namespace, ctx: dict[str, Any], name: str) -> dict[str, Any]:
    """One model: warm-up and timed steps; the report rank 0 prints."""
    build, input_shape, classes = MODELS[name]
    device = ctx["device"]
    torch.manual_seed(0)
    model = build().to(device)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.worker == "ddp":
        ids = [device] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    elif args.worker == "commlayer":
        import commlayer as cl

        cl.broadcast_parameters(model.state_dict(), root_rank=0)
        # named by model: two optimizers in one engine must not share gradient names
        named = [(f"{name}.{n}", p) for n, p in model.named_parameters()]
        optimizer = cl.DistributedOptimizer(optimizer, named_parameters=named)
    inputs = torch.randn(args.batch, *input_shape, device=device)
    targets = torch.randint(0, classes, (args.batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times: list[float] = []
    comm_start: dict[str, float] = {}
    in_step: list[float] | None = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup and args.worker == "commlayer":
            comm_start = cl.communication_stats()
            in_step = [0.0]
        sync()  # nothing queued before the step is charged to it
        t0 = time.perf_counter()
        _timed_step(model, optimizer, inputs, targets, in_step)
        sync()  # the step's kernels and copies are done
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup :])
    result: dict[str, Any] = {
        "worker": args.worker,
        "model": name,
        "ranks": ctx["size"],
        "backend": ctx["backend"],
        "step_ms": step_s * 1e3,
        "samples_per_s": args.batch * ctx["size"] / step_s,
        "parameters": sum(p.numel() for p in model.parameters()),
        "grad_bytes": grad_bytes,
    }
    if args.worker == "commlayer":
        comm_s = cl.communication_stats()["collective_now_s"] - comm_start["collective_now_s"]
        result["collective_ms_per_step"] = comm_s / args.steps * 1e3
        assert in_step is not None
        result["overlap"] = max(0.0, 1.0 - in_step[0] / comm_s) if comm_s else 0.0
    if args.worker == "single" and device.type == "cuda":
        result["d2h_gbps"], result["h2d_gbps"] = _pinned_gbps(grad_bytes, device)
    return result


def _deadline(at: float, rank: int) -> None:
    """Exit this process at ``at`` (seconds since the epoch) whatever it is doing (a hung
    collective), saying so."""

    def expire() -> None:
        print(f"gpu_train: rank {rank} still running at the job's --timeout-s", file=sys.stderr)
        sys.stderr.flush()
        os._exit(124)

    timer = threading.Timer(max(at - time.time(), 0.0), expire)
    timer.daemon = True
    timer.start()


def worker(args: argparse.Namespace) -> None:
    _deadline(args.deadline_at, int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0"))))
    ctx = _start(args)
    info: dict[str, Any] = {"torch": torch.__version__}
    if ctx["device"].type == "cuda":
        props = torch.cuda.get_device_properties(ctx["device"])
        info |= {"gpu": props.name, "gpu_gib": props.total_memory / 2**30,
                 "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda}  # fmt: skip
    for name in args.models:
        result = _train(args, ctx, name) | info
        if ctx["rank"] == 0:
            print(RESULT_PREFIX + json.dumps(result), flush=True)
    _stop(args)


# -- driver --------------------------------------------------------------------------------------
@dataclass
class Job:
    system: str  # the table's label
    ranks: int
    ddp_backend: str = ""

    @property
    def worker(self) -> str:
        return self.system.split("-")[0]

    def command(self, args: argparse.Namespace, deadline_at: float) -> list[str]:
        script = [
            __file__, "--worker", self.worker, "--models", ",".join(args.models),
            "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--deadline-at", f"{deadline_at:.1f}",
        ]  # fmt: skip
        if self.ddp_backend:
            script += ["--ddp-backend", self.ddp_backend]
        if self.system == "single":
            return [sys.executable, *script]
        if self.system == "commlayer-mpi":
            return [_mpiexec(), "-n", str(self.ranks), sys.executable, *script]
        return [*TORCHRUN, str(self.ranks), *script]


def _env() -> dict[str, str]:
    # as train.py: one thread each for N ranks' CPU work, no oversubscription
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # commlayer hands MPI pinned host buffers only: MPICH's own GPU support (pointer queries on
    # every call, a CUDA context of its own) has nothing to do here
    env.setdefault("MPIR_CVAR_ENABLE_GPU", "0")
    # every rank is on this host: gloo (DDP's and commlayer's torchrun backend) over loopback,
    # whatever the host name resolves to on a machine without network
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _why(output: str) -> str:
    """The line of a failed job's output that says why: the last exception a rank raised
    (not torchrun's ChildFailedError summary), else the last line that mentions an error."""
    # (torchrun's ranks prefix what they print with "[rank0]: " once torch.distributed is up)
    lines = [re.sub(r"^\[rank\d+\]:", "", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    raised = [
        line for line in lines
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", line) and "ChildFailed" not in line
    ]  # fmt: skip
    ours = [line for line in lines if line.startswith("gpu_train: ")]  # a rank's deadline
    said = ours or raised or [line for line in lines if re.search(r"error|refus", line, re.I)]
    text = (said or lines or ["no output"])[-1]
    return text.replace("|", "/")[:200]


def _run(command: list[str], timeout_s: float) -> tuple[int | None, str]:
    """(exit code, None on timeout; stdout and stderr) of ``command`` in a session of its own,
    stopped at ``timeout_s``: SIGTERM (a launcher passes it to its ranks), then SIGKILL."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True,
    )  # fmt: skip
    try:
        output = proc.communicate(timeout=timeout_s)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        pass
    output = ""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            output = proc.communicate(timeout=_KILL_GRACE_S)[0]
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue  # (a rank outside the group may still hold the pipe: give up reading)
    return None, output or ""


def run_job(args: argparse.Namespace, job: Job, timeout_s: float) -> dict[str, Any]:
    """Results of one job, one per model; a model with no result is a failure saying why."""
    t0 = time.perf_counter()
    try:
        # the ranks' own deadline a little before the driver's: their exit is the clean stop
        deadline_at = time.time() + max(timeout_s - _KILL_GRACE_S / 2, 1)
        code, output = _run(job.command(args, deadline_at), timeout_s)
    except (OSError, SystemExit) as exc:  # no launcher (train._mpiexec exits naming it)
        code, output = -1, str(exc)
    wall_s = time.perf_counter() - t0
    results = {}
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line.removeprefix(RESULT_PREFIX))
            results[result["model"]] = result | {"system": job.system}
    why = f"timed out after {timeout_s:.0f} s: {_why(output)}" if code is None else _why(output)
    if code not in (0, None) and code != -1:
        why = f"exit {code}: {why}"
    for model in args.models:
        if model not in results:
            results[model] = {"system": job.system, "model": model, "ranks": job.ranks,
                              "backend": job.ddp_backend, "error": why}  # fmt: skip
    failed = code != 0 or any("error" in r for r in results.values())
    for r in results.values():
        if code != 0 and "error" not in r:
            r["note"] = f"the job then ended badly ({why})"
    return {"job": job, "wall_s": wall_s, "results": results, "output": output if failed else ""}


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(results: list[dict[str, Any]], bandwidth: dict[str, dict[str, float]]) -> list[str]:
    rows = [
        "| model | ranks | system | backend | step ms | samples/s | vs DDP | staging floor ms "
        "| commlayer in collectives ms/step (hidden) | note |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    ddp = {
        (r["model"], r["ranks"]): r
        for r in results
        if r["system"].startswith("ddp") and "error" not in r
    }
    for r in results:
        ok = "error" not in r
        base = ddp.get((r["model"], r["ranks"]))
        ratio = r["samples_per_s"] / base["samples_per_s"] if ok and base else None
        bw = bandwidth.get(r["model"])
        staged = r["system"].startswith("commlayer") or r["backend"] == "gloo"
        floor = (
            r["ranks"] * r["grad_bytes"] * (1 / bw["d2h"] + 1 / bw["h2d"]) / 1e6
            if ok and bw and staged
            else None
        )
        comm = (
            f"{r['collective_ms_per_step']:.1f} ({r['overlap']:.0%})"
            if "collective_ms_per_step" in r
            else ""
        )
        rows.append(
            f"| {r['model']} | {r['ranks']} | {r['system']} | {r['backend'] or '—'} "
            f"| {_cell(r.get('step_ms'), '.2f')} | {_cell(r.get('samples_per_s'), '.0f')} "
            f"| {_cell(ratio, '.2f')} | {_cell(floor, '.2f')} | {comm} "
            f"| {'failed: ' + r['error'] if not ok else r.get('note', '')} |"
        )
    return rows


def _plan(args: argparse.Namespace, gpus: int) -> list[Job]:
    jobs = []
    for ranks in args.np:
        # NCCL takes one rank per GPU ("Duplicate GPU detected" otherwise); on the CPU, gloo
        nccl = args.device == "cuda" and ranks <= gpus
        if "ddp" in args.systems:
            jobs.append(Job("ddp" if nccl else "ddp-gloo", ranks, "nccl" if nccl else "gloo"))
        jobs += [Job(system, ranks) for system in SYSTEMS[1:] if system in args.systems]
    return jobs


def _limits(results: list[dict[str, Any]], bandwidth: dict[str, dict[str, float]]) -> list[str]:
    """The physical limit, in words, per model and rank count, from the run's own numbers."""
    lines = []
    for r in results:
        if r["system"] != "commlayer-mpi" or "error" in r:
            continue
        moved_mb = r["ranks"] * r["grad_bytes"] / 1e6
        bw = bandwidth.get(r["model"])
        copies = (
            f"{moved_mb:.1f} MB of gradients cross the GPU's host link each way per step, "
            f">= {moved_mb * (1 / bw['d2h'] + 1 / bw['h2d']):.2f} ms at the pinned bandwidth "
            f"(D2H {bw['d2h']:.1f} GB/s, H2D {bw['h2d']:.1f} GB/s, one process alone)"
            if bw
            else f"{moved_mb:.1f} MB of gradients a step, no device copies measured"
        )
        lines.append(
            f"- {r['model']}, {r['ranks']} rank(s): {copies}; commlayer-mpi spends "
            f"{r['collective_ms_per_step']:.1f} ms a step in collectives (the host allreduce, "
            f"{r['overlap']:.0%} hidden behind backward) of its {r['step_ms']:.1f} ms step."
        )
    return lines


def driver(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    command = f"python {' '.join(sys.argv)}"
    print(f"# training step on one {args.device} device, `{command}`\n", flush=True)
    print("\n".join(table([], {})), flush=True)
    done: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    bandwidth: dict[str, dict[str, float]] = {}  # per model, from the single job

    def launch(job: Job) -> dict[str, Any]:
        left_s = args.budget_s - (time.perf_counter() - start)
        if left_s < 10:
            why = f"not run: the --budget-s of {args.budget_s:.0f} s was spent"
            ran = {m: {"system": job.system, "model": m, "ranks": job.ranks,
                       "backend": job.ddp_backend, "error": why} for m in args.models}  # fmt: skip
            outcome = {"job": job, "wall_s": 0.0, "results": ran, "output": ""}
        else:
            outcome = run_job(args, job, min(args.timeout_s, left_s))
        done.append(outcome)
        results.extend(outcome["results"].values())
        print("\n".join(table(results, bandwidth)[-len(outcome["results"]) :]), flush=True)
        return outcome

    single = launch(Job("single", 1))["results"] if "single" in args.systems else {}
    ok = [r for r in single.values() if "error" not in r]
    gpus = ok[0].get("gpus", 1) if ok else 1
    bandwidth.update(
        (r["model"], {"d2h": r["d2h_gbps"], "h2d": r["h2d_gbps"]}) for r in ok if "d2h_gbps" in r
    )
    for job in _plan(args, gpus):
        outcome = launch(job)
        if job.ddp_backend == "nccl" and any("error" in r for r in outcome["results"].values()):
            launch(Job("ddp-gloo", job.ranks, "gloo"))  # a DDP baseline all the same
    info = ok[0] if ok else {}
    machine = f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if "gpu" in info:
        machine += f" (workers: torch {info['torch']}, CUDA {info['cuda']}, {info['gpus']} x "
        machine += f"{info['gpu']}, {info['gpu_gib']:.0f} GiB)"
    header = [
        f"# training step on one {args.device} device: commlayer vs DDP, every rank on it; "
        f"median of {args.steps} steps after {args.warmup} warm-up, batch {args.batch} per rank",
        "",
        f"{datetime.date.today()}, {machine}, OMP_NUM_THREADS=1, `{command}`",
        "",
    ]
    models = {r["model"]: r for r in results if "error" not in r}
    notes = [
        "",
        "vs DDP: samples/s over DDP's at the same rank count in this run (`ddp`: NCCL; "
        "`ddp-gloo`: gloo, CUDA tensors through host copies, where ranks outnumber GPUs). "
        "staging floor: N x G bytes device to host and back over the GPU's one host link at "
        "the pinned bandwidth the `single` job measured (staged systems only).",
        *[
            f"{m}: {r['parameters'] / 1e6:.2f} M parameters, {r['grad_bytes'] / 1e6:.1f} MB of "
            "gradients per rank per step"
            for m, r in models.items()
        ],
        "",
        "Physical limit: copies between the GPU and pinned host memory, and the host allreduce:",
        *(_limits(results, bandwidth) or ["- (no commlayer-mpi result to compute it from)"]),
        "",
        "jobs (wall s, launch and CUDA start included): "
        + ", ".join(f"{o['job'].system}@{o['job'].ranks} {o['wall_s']:.1f}" for o in done)
        + f"; total {time.perf_counter() - start:.1f} s",
    ]
    for outcome in done:
        if outcome["output"]:
            tail = "\n".join(outcome["output"].splitlines()[-args.tail_lines :])
            job = outcome["job"]
            print(f"\n--- {job.system} at {job.ranks} rank(s) failed; output tail:\n{tail}")
    lines = [*header, *table(results, bandwidth), *notes, ""]
    print("\n" + "\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=["single", *SYSTEMS],
        help=f"only these of {['single', *SYSTEMS]} (ddp: NCCL or gloo as the ranks allow; "
        "single also measures the pinned bandwidth)",
    )
    parser.add_argument("--steps", type=int, default=40)
    # commlayer's auto tuning measures its candidates on the first calls of each bucket size
    # (train.py: ~40 steps with the MLP before its step levels out)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--timeout-s", type=float, default=60, help="per job")
    # a run on the GPU machine takes ~90 s (7 jobs); twice that, and the device is given back
    parser.add_argument("--budget-s", type=float, default=200, help="no job starts after it")
    parser.add_argument("--tail-lines", type=int, default=25, help="of a failed job's output")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-backend", default="gloo", help=argparse.SUPPRESS)
    parser.add_argument(
        "--deadline-at", type=float, default=time.time() + 600, help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    for option, given, allowed in (
        ("--models", args.models, list(MODELS)),
        ("--systems", args.systems, ["single", *SYSTEMS]),
    ):
        unknown = [name for name in given if name not in allowed]
        if unknown:
            parser.error(f"{option}: unknown {unknown!r}; choose from {allowed}")
    if args.worker:
        worker(args)
    else:
        driver(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
