"""Training-step benchmark: commlayer's DistributedOptimizer vs PyTorch DDP (gloo) vs Horovod.

    OMP_NUM_THREADS=1 python benchmarks/train.py [--np 2,4] [--models mlp,resnet] [--out F]

1. The driver (this script without ``--worker``) launches one ``mpiexec -n N`` job per
   (rank count, model, system), all in this one run (``commlayer-torchrun``: the commlayer
   worker under ``torchrun``, its engine over torch.distributed's gloo), and prints a table of
   median step time and samples/s (batch per rank x ranks / step time) with the ratio to DDP
   measured in the same run, plus a 1-process run of the plain model as the scaling
   reference. Then, per (rank count, model), one paired job (``paired_worker``) trains a DDP
   copy and a commlayer copy step by step in turn: its ratio is the one to quote on a machine
   whose speed drifts. ``--systems commlayer-torchrun`` pairs them under torchrun
   (``paired-torchrun``: commlayer's engine over gloo, DDP on the default group) with a third
   copy, the gloo yardstick (``_DirectGloo``: hooks posting gloo allreduces in bucket order,
   in place, no engine): what a data path over gloo can do at best, the limit of the torchrun
   comparison on a machine where gloo's transfers take the cores the ranks compute on. Every
   paired job also trains a copy with nothing communicated (plain SGD on each rank's batch):
   its ratio to DDP is the bound, the most any data-parallel library could gain over DDP on
   this machine (a ratio target above it cannot be met by communication alone).
2. Models with many mid-sized gradient tensors, as in benchmarks/README.md's yardsticks: ``mlp`` is
   10 x [Linear(768, 768), LayerNorm(768), GELU()] + Linear(768, 1000) (6.69 M parameters in
   62 tensors), ``resnet`` a small CIFAR-style ResNet (3 stages of 2 basic blocks); ``tiny``
   (``--models tiny --batch 8``, issue 49) is dispatch-bound: 161 gradients of at most 256
   elements, where per-tensor host work, not bytes, sets the step.
3. Every system trains the same model from the same seed with SGD momentum 0.9 on random
   inputs; a step is zero_grad, forward, backward, step. Median over ``--steps`` steps after
   ``--warmup``. For commlayer the worker also reports the overlap achieved: the fraction of
   the engine's time in collectives that passed outside step() (hidden behind backward).
4. ``--one-rank`` (issue 35, item 1): one process, three copies of the model trained in turn,
   one step of each (the order rotates): the plain optimizer, commlayer's DistributedOptimizer
   as a user gets it at one rank (the identity, as Horovod's at size 1) and the same with
   ``COMMLAYER_FORCE_FULL_PATH=1`` (hooks, buckets, the engine). Median step and its spread
   (quartiles, min-max), and the median over steps of each one's ratio to the plain step next
   to it.
Horovod is measured when ``horovod.torch`` is importable (``scripts/install-horovod.sh`` builds
it), in separate runs only: its background thread negotiates every cycle (1 ms) even when idle,
so in a paired job it would slow the others' steps (tried: DDP's MLP step at 4 ranks went from
~120 to 314 ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from commlayer.core import fusion, malloc

SYSTEMS = ("commlayer", "ddp", "horovod")
# commlayer launched by torchrun (its engine over torch.distributed's gloo) instead of mpiexec
TORCHRUN = "commlayer-torchrun"
# the paired job (DDP and commlayer in one job, in turn) launched by torchrun: commlayer's engine
# over gloo, DDP on torch.distributed's default group
PAIRED_TORCHRUN = "paired-torchrun"
RESULT_PREFIX = "RESULT "


# -- models --------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(10):
        layers += [nn.Linear(768, 768), nn.LayerNorm(768), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(768, 1000))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet() -> nn.Module:
    blocks: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    cin = 32
    for cout, stride in ((32, 1), (64, 2), (128, 2)):
        blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def tiny() -> nn.Module:
    """Dispatch-bound (issue 49): 161 tiny gradients, 80 x Linear(16, 16) and a head without
    bias; the step's time is per-tensor host work (hooks, submissions, kernel launches), not
    bytes. Run it with a small batch (``--models tiny --batch 8``)."""
    layers: list[nn.Module] = []
    for _ in range(80):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 10, bias=False))


MODELS = {
    "mlp": (mlp, (768,), 1000),
    "resnet": (resnet, (3, 32, 32), 10),
    "tiny": (tiny, (16,), 10),
}
DEFAULT_MODELS = ["mlp", "resnet"]  # tiny on request: its batch is not the others'


# -- worker: one system, one model, under mpiexec ---------------------------------------------
def _rank_size() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def _setup(system: str, model: nn.Module) -> tuple[nn.Module, Any, dict[str, Any]]:
    """(model to call, optimizer, context for the report) for one system."""
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if system == "single":
        return model, optimizer, {"rank": 0, "size": 1}
    if system == "ddp":
        from common import init_gloo
        from mpi4py import MPI

        init_gloo(MPI.COMM_WORLD)
        rank, size = _rank_size()
        return nn.parallel.DistributedDataParallel(model), optimizer, {"rank": rank, "size": size}
    if system == "horovod":
        import horovod.torch as hvd

        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters())
        return model, optimizer, {"rank": hvd.rank(), "size": hvd.size()}
    import commlayer as cl

    cl.init()
    cl.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = cl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return model, optimizer, {"rank": cl.rank(), "size": cl.size()}


def _timed_step(
    model: nn.Module,
    optimizer: Any,
    inputs: torch.Tensor,
    targets: Any,
    in_step: list[float] | None = None,
) -> float:
    """One step's seconds; ``in_step``: commlayer's collective time that passed inside step()
    is added to its one element (what backward did not hide)."""
    t0 = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    if in_step is None:
        optimizer.step()
    else:
        import commlayer as cl

        before = cl.communication_stats()["collective_now_s"]
        optimizer.step()
        in_step[0] += cl.communication_stats()["collective_now_s"] - before
    return time.perf_counter() - t0


class _HookTimer:
    """Seconds spent inside post-accumulate-grad hooks (the per-gradient path of the optimizer):
    every hook registered while installed is wrapped with a timer, whatever its owner calls it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._register = torch.Tensor.register_post_accumulate_grad_hook

    def __enter__(self) -> _HookTimer:
        timer, register = self, self._register

        def timed_register(tensor: torch.Tensor, hook: Any) -> Any:
            def timed(param: torch.Tensor) -> None:
                t0 = time.perf_counter()
                hook(param)
                timer.seconds += time.perf_counter() - t0
                timer.calls += 1

            return register(tensor, timed)

        torch.Tensor.register_post_accumulate_grad_hook = timed_register  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.register_post_accumulate_grad_hook = self._register  # type: ignore[method-assign]


def _engine_cpu_s() -> float:
    """CPU seconds of commlayer's engine thread so far (communication_stats()'s)."""
    import commlayer

    return commlayer.communication_stats()["engine_cpu_s"]


class _DirectGloo:
    """The yardstick of the paired job under torchrun (issue 35): what a data path over gloo
    can do without commlayer's engine, as DDP would with gradients where they lie. Hooks post
    gloo allreduces from the backward thread, in buckets of ``bucket_bytes`` in the order
    backward produced the first step's gradients (reverse registration order here), each
    bucket once all of it is ready and every earlier one is posted (the same order on every
    rank: nothing to negotiate); large gradients in place, the small ones of a bucket packed
    together; ``step()`` waits, averages and steps. No error handling, join or compression:
    a measuring stick, not a product."""

    def __init__(self, model: nn.Module, group: Any, bucket_bytes: int = 1 << 20) -> None:
        import torch.distributed as dist

        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self._group, self._size = group, dist.get_world_size(group)
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.SUM
        params = [p for p in model.parameters() if p.requires_grad]
        self._buckets: list[list[torch.Tensor]] = [[]]
        used = 0
        for p in reversed(params):
            if used >= bucket_bytes:
                self._buckets.append([])
                used = 0
            self._buckets[-1].append(p)
            used += p.numel() * p.element_size()
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b}
        self._ready = [0] * len(self._buckets)
        self._next = 0
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor] | None]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_ready)

    def _on_ready(self, p: torch.Tensor) -> None:
        self._ready[self._bucket_of[id(p)]] += 1
        while self._next < len(self._buckets) and self._ready[self._next] == len(
            self._buckets[self._next]
        ):
            self._post(self._buckets[self._next])
            self._next += 1

    def _post(self, bucket: list[torch.Tensor]) -> None:
        small = [p for p in bucket if p.numel() < fusion.ONE_PASS_NUMEL]
        if small:
            flat = torch.cat([p.grad.reshape(-1) for p in small])  # type: ignore[union-attr]
            self._works.append((self._group.allreduce([flat], self._options), flat, small))
        for p in bucket:
            if p.numel() >= fusion.ONE_PASS_NUMEL:
                grad = p.grad
                assert grad is not None
                self._works.append((self._group.allreduce([grad], self._options), grad, None))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        for work, tensor, small in self._works:
            while not work.is_completed():
                time.sleep(50e-6)
            work.wait()
            tensor.mul_(1.0 / self._size)
            if small is not None:
                grads = [p.grad.view(-1) for p in small]  # type: ignore[union-attr]
                torch.split_with_sizes_copy(tensor, [p.numel() for p in small], out=grads)
        self._works.clear()
        self._ready = [0] * len(self._buckets)
        self._next = 0
        self.optimizer.step()


def paired_worker(args: argparse.Namespace) -> None:
    """DDP and commlayer in one job, one step of each in turn (which goes first alternates):
    on a VM whose speed drifts within a minute, both see the same machine, so the ratio of
    their paired step times is steadier than the ratio of two separate runs. A step of one
    leaves the other idle: gloo's threads block on sockets, commlayer's engine sleeps between
    heartbeats (its idle cost is charged to DDP's steps here, against commlayer)."""
    build, input_shape, classes = MODELS[args.model]
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if under_torchrun:
        # commlayer's init() starts torch.distributed from torchrun's variables; its engine
        # runs on a gloo group of its own, DDP on the default group (both gloo)
        torch.manual_seed(0)
        with _HookTimer() as hooks:
            cl_model, cl_opt, ctx = _setup("commlayer", build())
        torch.manual_seed(0)
        ddp_model: Any = nn.parallel.DistributedDataParallel(build())
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
        import torch.distributed as dist

        torch.manual_seed(0)
        direct_model = build()
        direct_opt: _DirectGloo | None = _DirectGloo(direct_model, dist.new_group(backend="gloo"))
    else:
        direct_opt = None
        torch.manual_seed(0)
        ddp_model, ddp_opt, ctx = _setup("ddp", build())
        torch.manual_seed(0)
        with _HookTimer() as hooks:
            cl_model, cl_opt, _ = _setup("commlayer", build())
    # the bound: the same model and optimizer with nothing communicated (no library can do
    # better on this machine: its ratio to DDP is the most a data-parallel step can gain)
    torch.manual_seed(0)
    local_model = build()
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1)
    inputs = torch.randn(args.batch, *input_shape)
    targets = torch.randint(0, classes, (args.batch,))
    ddp_t: list[float] = []
    cl_t: list[float] = []
    direct_t: list[float] = []
    local_t: list[float] = []
    systems = ["ddp", "commlayer", "local"] + (["direct"] if direct_opt is not None else [])
    hook_s = engine_s = engine_end_s = 0.0
    calls = 0
    import commlayer as cl

    counts = counts_end = cl.communication_stats()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            hook_s, calls, engine_s = hooks.seconds, hooks.calls, _engine_cpu_s()
            counts = cl.communication_stats()
        if step == args.warmup + args.steps - 1:
            # read before the last step, not after the loop: a peer that finished may shut
            # down, and this rank's engine thread ends with it (its CPU clock then reads 0)
            engine_end_s = _engine_cpu_s()
            counts_end = cl.communication_stats()
        turn = step % len(systems)  # which goes first rotates
        for system in systems[turn:] + systems[:turn]:
            if system == "ddp":
                ddp_t.append(_timed_step(ddp_model, ddp_opt, inputs, targets))
            elif system == "commlayer":
                cl_t.append(_timed_step(cl_model, cl_opt, inputs, targets))
            elif system == "local":
                local_t.append(_timed_step(local_model, local_opt, inputs, targets))
            else:
                direct_t.append(_timed_step(direct_model, direct_opt, inputs, targets))
    ddp_t, cl_t, local_t = ddp_t[args.warmup :], cl_t[args.warmup :], local_t[args.warmup :]
    result = {
        "system": "paired",
        "launch": "torchrun" if under_torchrun else "mpiexec",
        "model": args.model,
        "ranks": ctx["size"],
        "ddp_step_ms": statistics.median(ddp_t) * 1e3,
        "commlayer_step_ms": statistics.median(cl_t) * 1e3,
        # throughput ratio commlayer / DDP, per pair of neighbouring steps
        "ratio": statistics.median(d / c for d, c in zip(ddp_t, cl_t, strict=True)),
        # commlayer's cost on the user's thread during backward, and its engine thread's CPU
        "hook_ms_per_step": (hooks.seconds - hook_s) / args.steps * 1e3,
        "hook_us_per_call": (hooks.seconds - hook_s) / max(hooks.calls - calls, 1) * 1e6,
        "engine_cpu_ms_per_step": (engine_end_s - engine_s) / max(args.steps - 1, 1) * 1e3,
        "local_step_ms": statistics.median(local_t) * 1e3,
        "local_ratio": statistics.median(d / n for d, n in zip(ddp_t, local_t, strict=True)),
        # the engine's negotiation cycles and operations a step (heartbeats included)
        "cycles_per_step": (counts_end["cycles"] - counts["cycles"]) / max(args.steps - 1, 1),
        "operations_per_step": (counts_end["operations"] - counts["operations"])
        / max(args.steps - 1, 1),
        # commlayer trains as DDP does: the largest parameter difference after the run
        "max_diff_vs_ddp": max(
            (a - b).abs().max().item()
            for a, b in zip(cl_model.parameters(), ddp_model.parameters(), strict=True)
        ),
    }
    if direct_t:
        # the yardstick must train as DDP does (same seed, same data, averaged gradients)
        for mine, ddp_param in zip(direct_model.parameters(), ddp_model.parameters()):
            if not torch.allclose(mine, ddp_param, rtol=1e-4, atol=1e-5):
                raise RuntimeError("the gloo yardstick's parameters differ from DDP's")
        direct_t = direct_t[args.warmup :]
        result["direct_step_ms"] = statistics.median(direct_t) * 1e3
        result["direct_ratio"] = statistics.median(
            d / g for d, g in zip(ddp_t, direct_t, strict=True)
        )
    from commlayer.core import runtime

    result["wait"] = "passive" if runtime.engine().passive else "active"

    cl.shutdown()
    if ctx["rank"] == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


ONE_RANK = ("plain", "identity", "full path")  # --one-rank's systems (module docstring, 4.)


def one_rank_worker(args: argparse.Namespace) -> None:
    """The three of ``ONE_RANK`` in one process, a step of each in turn (module docstring, 4.):
    the engine runs for all three (its idle heartbeat is charged to every one's steps)."""
    import commlayer as cl
    from commlayer.common import config

    cl.init()
    build, input_shape, classes = MODELS[args.model]
    models, optimizers = [], []
    for name in ONE_RANK:
        torch.manual_seed(0)
        model = build()
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name != "plain":
            with config.override(force_full_path=int(name == "full path")):  # read here, once
                opt = cl.DistributedOptimizer(
                    opt, named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()]
                )
        models.append(model)
        optimizers.append(opt)
    torch.manual_seed(1)
    inputs = torch.randn(args.batch, *input_shape)
    targets = torch.randint(0, classes, (args.batch,))
    times: list[list[float]] = [[] for _ in ONE_RANK]
    for step in range(args.warmup + args.steps):
        for k in range(len(ONE_RANK)):
            i = (step + k) % len(ONE_RANK)
            times[i].append(_timed_step(models[i], optimizers[i], inputs, targets))
    result: dict[str, Any] = {"system": "one-rank", "model": args.model, "ranks": cl.size()}
    plain = times[0][args.warmup :]
    for name, series in zip(ONE_RANK, times, strict=True):
        kept = sorted(series[args.warmup :])
        quartiles = statistics.quantiles(kept, n=4)
        result[name] = {
            "median_ms": statistics.median(kept) * 1e3,
            "q1_ms": quartiles[0] * 1e3,
            "q3_ms": quartiles[2] * 1e3,
            "min_ms": kept[0] * 1e3,
            "max_ms": kept[-1] * 1e3,
            # throughput relative to the plain step taken next to it
            "vs_plain": statistics.median(
                p / t for p, t in zip(plain, series[args.warmup :], strict=True)
            ),
        }
    cl.shutdown()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def one_rank_table(results: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| model | system | median step ms | quartiles ms | min-max ms | samples/s vs plain |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        for name in ONE_RANK:
            t = r[name]
            rows.append(
                f"| {r['model']} | {name} | {t['median_ms']:.1f} | {t['q1_ms']:.1f}-"
                f"{t['q3_ms']:.1f} | {t['min_ms']:.1f}-{t['max_ms']:.1f} | {t['vs_plain']:.2f} |"
            )
    return rows


def one_rank_driver(args: argparse.Namespace) -> None:
    """``--one-rank``: one job per model (module docstring, 4.)."""
    header = [
        f"# one rank: no wrapping vs DistributedOptimizer (identity) vs its full path, median "
        f"of {args.steps} steps of each after {args.warmup} warm-up, batch {args.batch}",
        "",
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, OMP_NUM_THREADS=1, `python {' '.join(sys.argv)}`",
        "",
        "One process (`mpiexec -n 1`), the three models trained in turn, one step each (the order",
        "rotates); `full path`: COMMLAYER_FORCE_FULL_PATH=1. Last column: median over steps of",
        "the plain step's time over this one's, taken next to each other.",
        "",
    ]
    print("\n".join(header), flush=True)
    results = [run_one(args, "one-rank", model, 1) for model in args.models]
    lines = [*header, *one_rank_table(results), ""]
    print("\n".join(one_rank_table(results)))
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines))


def worker(args: argparse.Namespace) -> None:
    if args.worker == "paired":
        paired_worker(args)
        return
    if args.worker == "one-rank":
        one_rank_worker(args)
        return
    torch.manual_seed(0)
    build, input_shape, classes = MODELS[args.model]
    model, optimizer, ctx = _setup(args.worker, build())
    inputs = torch.randn(args.batch, *input_shape)
    targets = torch.randint(0, classes, (args.batch,))
    times: list[float] = []
    comm_start: dict[str, float] = {}
    in_step: list[float] | None = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup and args.worker == "commlayer":
            import commlayer as cl

            comm_start = cl.communication_stats()
            optimizer.synchronize_wait_s = 0.0
            in_step = [0.0]
        times.append(_timed_step(model, optimizer, inputs, targets, in_step))
    result: dict[str, Any] = {
        "system": args.worker,
        "model": args.model,
        "ranks": ctx["size"],
        "step_ms": statistics.median(times[args.warmup :]) * 1e3,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()),
    }
    result["samples_per_s"] = args.batch * ctx["size"] / (result["step_ms"] / 1e3)
    if args.worker == "commlayer":
        import commlayer as cl

        stats = cl.communication_stats()
        comm_s = stats["collective_now_s"] - comm_start["collective_now_s"]
        result["collective_ms_per_step"] = comm_s / args.steps * 1e3
        result["waited_ms_per_step"] = optimizer.synchronize_wait_s / args.steps * 1e3
        # hidden: collective time that passed outside step(), i.e. behind forward and backward
        assert in_step is not None
        result["overlap"] = max(0.0, 1.0 - in_step[0] / comm_s) if comm_s else 0
        for key in ("cycles", "operations"):
            result[f"{key}_per_step"] = (stats[key] - comm_start[key]) / args.steps
        cl.shutdown()
    if ctx["rank"] == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


# -- driver --------------------------------------------------------------------------------------
def _mpiexec() -> str:
    beside = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if found is None:
        sys.exit("mpiexec not found: pip install mpich (or put a system MPI on PATH)")
    return found


def _horovod_importable() -> bool:
    probe = [sys.executable, "-c", "import horovod.torch"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


# commlayer.init() sets these glibc thresholds in its process (commlayer/core/malloc.py); a DDP or
# Horovod run labelled "+malloc" gets them through glibc's own variables, so the table shows how
# much of a lead over them is the allocator's and how much the communication's.
MALLOC_CONTROL = "+malloc"
_GLIBC_THRESHOLDS = {
    "MALLOC_MMAP_THRESHOLD_": str(malloc.MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(malloc.TRIM_THRESHOLD_BYTES),
}


def run_one(
    args: argparse.Namespace, system: str, model: str, ranks: int, hosts: str | None = None
) -> dict[str, Any]:
    """One job's RESULT; ``hosts`` (``node1:2,node2:2``): commlayer across the namespace
    cluster's hosts, started by ``commlayerrun -H`` as on real machines."""
    worker = system.removesuffix(MALLOC_CONTROL)
    command = [
        sys.executable, __file__, "--worker", worker, "--model", model,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
    ]  # fmt: skip
    if system in (TORCHRUN, PAIRED_TORCHRUN):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(ranks), *command[1:]]  # fmt: skip
        command[command.index("--worker") + 1] = "commlayer" if system == TORCHRUN else "paired"
    elif hosts is not None:
        launcher = os.path.join(sysconfig.get_path("scripts"), "commlayerrun")
        command = [launcher, "-np", str(ranks), "-H", hosts, *command]
    elif system != "single":
        command = [_mpiexec(), "-n", str(ranks), *command]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if system.endswith(MALLOC_CONTROL):
        env.update(_GLIBC_THRESHOLDS)
    # a session of its own: at the timeout the launcher and every rank it started are stopped
    # (torchrun's workers outlive a killed torchrun and would load the next runs)
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{' '.join(command)} ran past {args.timeout_s} s: stopped") from None
    done = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = dict(json.loads(line.removeprefix(RESULT_PREFIX)))
            if system != worker or system in (TORCHRUN, PAIRED_TORCHRUN):
                result["system"] = system
            return result
    raise RuntimeError(
        f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    )


def table(results: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| model | ranks | system | step ms | samples/s | vs DDP | overlap (commlayer) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    ddp = {(r["model"], r["ranks"]): r for r in results if r["system"] == "ddp"}
    for r in results:
        base = ddp.get((r["model"], r["ranks"]))
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}" if base else "—"
        overlap = (
            f"{r['overlap']:.0%} of {r['collective_ms_per_step']:.1f} ms hidden"
            if "overlap" in r
            else ""
        )
        rows.append(
            f"| {r['model']} | {r['ranks']} | {r['system']} | {r['step_ms']:.1f} "
            f"| {r['samples_per_s']:.0f} | {ratio} | {overlap} |"
        )
    return rows


def paired_table(results: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| model | ranks | launch | DDP step ms | commlayer step ms | commlayer / DDP samples/s "
        "| commlayer wait | hooks ms/step (us/call) | engine CPU ms/step | engine cycles/step "
        "| gloo yardstick / DDP samples/s | no communication / DDP (the bound) |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        direct = (
            f"{r['direct_ratio']:.2f} ({r['direct_step_ms']:.1f} ms)"
            if "direct_ratio" in r
            else "—"
        )
        bound = (
            f"{r['local_ratio']:.2f} ({r['local_step_ms']:.1f} ms)" if "local_ratio" in r else "—"
        )
        rows.append(
            f"| {r['model']} | {r['ranks']} | {r.get('launch', 'mpiexec')} "
            f"| {r['ddp_step_ms']:.1f} "
            f"| {r['commlayer_step_ms']:.1f} | {r['ratio']:.2f} | {r['wait']} "
            f"| {r['hook_ms_per_step']:.2f} ({r['hook_us_per_call']:.0f}) "
            f"| {r['engine_cpu_ms_per_step']:.1f} | {r.get('cycles_per_step', float('nan')):.2f} "
            f"| {direct} | {bound} |"
        )
    return rows


def driver(args: argparse.Namespace) -> None:
    systems = ["ddp", "commlayer", TORCHRUN]
    notes = [
        f"`{TORCHRUN}`: the commlayer script launched by `torchrun --standalone` instead of "
        "mpiexec: its engine runs over torch.distributed's gloo (COMMLAYER_BACKEND=auto)."
    ]
    wanted = args.systems or [*systems, "horovod"]
    systems = [s for s in systems if s in wanted]
    # paired jobs: under mpiexec when commlayer is wanted, under torchrun when its launch is
    paired_jobs = [
        job for job, system in (("paired", "commlayer"), (PAIRED_TORCHRUN, TORCHRUN))
        if system in wanted
    ] or ["paired"]  # fmt: skip
    if "horovod" not in wanted:
        pass  # not asked for
    elif _horovod_importable():
        systems.append("horovod")
    else:
        notes.append("Horovod: not importable here (`import horovod.torch` failed), not measured.")
    if args.malloc_controls:
        systems += [s + MALLOC_CONTROL for s in systems if not s.startswith("commlayer")]
        notes.append(
            f"`{MALLOC_CONTROL}`: the same system with glibc's mmap threshold at 32 MiB and trim "
            "threshold at 64 MiB (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), what "
            "commlayer.init() sets in its own process (COMMLAYER_MALLOC_TUNING); its ratio is "
            "still to plain DDP."
        )
    header = [
        "# training step, median of "
        f"{args.steps} steps after {args.warmup} warm-up, batch {args.batch} per rank",
        "",
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, OMP_NUM_THREADS=1, `python {' '.join(sys.argv)}`",
        "",
    ]
    print("\n".join(header), flush=True)
    results = []
    paired = []
    for model in args.models:
        if args.paired_only:
            for ranks in args.np:
                for job in paired_jobs:
                    paired.append(run_one(args, job, model, ranks))
                    print(paired_table(paired)[-1], flush=True)
            continue
        results.append(run_one(args, "single", model, 1))
        print(table(results)[-1], flush=True)
        for ranks in args.np:
            for system in systems:
                results.append(run_one(args, system, model, ranks))
                print(table(results)[-1], flush=True)
            for job in paired_jobs:
                paired.append(run_one(args, job, model, ranks))
                print(paired_table(paired)[-1], flush=True)
    shapes = {r["model"]: (r["parameters"], r["tensors"]) for r in results}
    models = [f"{m}: {p / 1e6:.2f} M parameters in {t} tensors" for m, (p, t) in shapes.items()]
    pairs = [
        "",
        "Paired: DDP and commlayer in one job, one step of each in turn, median over the run of",
        "the ratio of neighbouring steps (steadier than two separate runs on a drifting VM):",
        "",
        *paired_table(paired),
    ]
    lines = [*header, *table(results), *pairs, "", *notes, *models, ""]
    print("\n" + "\n".join(table(results) + pairs + [""] + notes + models))
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--models", type=lambda s: s.split(","), default=DEFAULT_MODELS)
    parser.add_argument("--steps", type=int, default=40)
    # commlayer's auto tuning measures its candidates on the first calls of each bucket size
    # (algorithms/autotune.py): with the MLP at 2 ranks its steps were ~20% slower for the
    # first ~40 steps, then level with tuning off. The table is about the steady state.
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument(
        "--malloc-controls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run DDP (and Horovod) with commlayer's glibc malloc thresholds",
    )
    parser.add_argument(
        "--paired-only",
        action="store_true",
        help="only the paired DDP/commlayer jobs (a before/after check of a change)",
    )
    parser.add_argument(
        "--one-rank",
        action="store_true",
        help="only one process: no wrapping vs DistributedOptimizer (the identity there) vs "
        "its full path (COMMLAYER_FORCE_FULL_PATH=1), in turn",
    )
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument(
        "--worker", choices=("single", "paired", "one-rank", *SYSTEMS), help=argparse.SUPPRESS
    )
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--systems",
        type=lambda text: text.split(","),
        help=f"only these (of ddp, commlayer, {TORCHRUN}, horovod; +malloc controls follow)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.one_rank:
        one_rank_driver(args)
    else:
        driver(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
