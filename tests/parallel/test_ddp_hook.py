"""commlayer.integrations.ddp (issue #7): our DDP communication hook against torch's own hooks.

torch.distributed (gloo, CPU) is started once, with the TCP port picked by rank 0 and shared
through commlayer's ``broadcast_object``, and left up until the process exits (see ``_gloo``).
Every rank trains the same model on its own rows under DDP with two hooks and compares: lossless
hooks (none, fp16) must give torch's results, lossy ones (top-k with error feedback, PowerSGD) must
reach the accuracy of plain allreduce on the digits data. Every comparison is between values all
ranks share (DDP keeps parameters equal), so every rank reaches the same verdict; collectives
first, asserts last.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from launch import start_gloo
from restart import reinit
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import commlayer as cl
from commlayer.integrations import ddp

F64 = torch.float64
# One bucket per parameter (~1 KB here): several buckets, and a layout DDP's rebuild keeps.
TINY_BUCKET_MB = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _gloo() -> None:
    """gloo over commlayer's ranks, up until the process exits (launch.start_gloo)."""
    start_gloo()


def _mlp(seed: int, dtype: torch.dtype, sizes: tuple[int, ...] = (6, 16, 8, 3)) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def _train(
    model: nn.Module,
    state: Any,
    hook: Callable[..., Any] | None,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 0.1,
    bucket_cap_mb: float = TINY_BUCKET_MB,
) -> DDP:
    wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        wrapped.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    return wrapped


def _batches(
    steps: int, dtype: torch.dtype, rows: int = 5
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + cl.rank())  # each rank its own rows
    return [
        (torch.randn(rows, 6, generator=g, dtype=dtype), torch.randint(0, 3, (rows,), generator=g))
        for _ in range(steps)
    ]


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _both(state_ours: Any, hook_ours: Any, state_torch: Any, hook_torch: Any, dtype: torch.dtype
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    batches = _batches(6, dtype)
    ours = _params(_train(_mlp(0, dtype), state_ours, hook_ours, batches))
    theirs = _params(_train(_mlp(0, dtype), state_torch, hook_torch, batches))
    return ours, theirs


@pytest.mark.parametrize("dense_iters", [0, 2])
def test_none_equals_allreduce_hook(dense_iters: int) -> None:
    state = ddp.CommState(compression="none", dense_iters=dense_iters)
    ours, theirs = _both(state, ddp.hook, None, default_hooks.allreduce_hook, F64)
    # Same division, then a sum over the same ranks in the same gloo collective: bit-identical.
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert state.iteration == 6


def test_compress_wrapper_fp16_equals_fp16_compress_hook() -> None:
    state = ddp.CommState(compression="none", dense_iters=0)
    wrapped = ddp.compress_wrapper(ddp.hook, "fp16")
    ours, theirs = _both(state, wrapped, None, default_hooks.fp16_compress_hook, torch.float32)
    # Cast, divide in fp16, allreduce, cast back: the very operations torch's hook does.
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_fp16_compressor_close_to_fp16_compress_hook() -> None:
    state = ddp.CommState(compression="fp16", dense_iters=0)
    ours, theirs = _both(state, ddp.hook, None, default_hooks.fp16_compress_hook, torch.float32)
    # We divide before the cast, torch after it: fp16 rounding apart, nothing more.
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


def test_compress_wrapper_around_torch_hook() -> None:
    wrapped = ddp.compress_wrapper(default_hooks.allreduce_hook, "fp16")
    ours, theirs = _both(None, wrapped, None, default_hooks.fp16_compress_hook, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_bad_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*registered: auto, native, shm, .*ring"):
        ddp.CommState(algorithm="nope")
    other = "tree" if cl.allreduce_algorithm() != "tree" else "ring"
    with pytest.raises(ValueError, match=f"rank {cl.rank()}: .*initialised with allreduce_algo"):
        ddp.CommState(algorithm=other)
    with pytest.raises(ValueError, match="dense_iters"):
        ddp.CommState(dense_iters=-1)
    with pytest.raises(ValueError, match="unknown compressor"):
        ddp.CommState(compression="nope")
    with pytest.raises(ValueError, match="cast compressor"):
        ddp.compress_wrapper(ddp.hook, "topk")


def test_the_state_makes_its_communicator_once_for_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket of every step through one communicator, made at the first bucket (issue 49,
    item 5), with torch's allreduce hook's results bit for bit; made again over a new process
    group."""
    made: list[Any] = []
    real = ddp.Communicator

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ddp, "Communicator", counting)
    with cl.config.override(force_full_path=1):  # the whole path over one rank too
        state = ddp.CommState(compression="none", dense_iters=0)
    batches = _batches(6, F64)
    ours, theirs = _both(state, ddp.hook, None, default_hooks.allreduce_hook, F64)
    made_in_training = len(made)
    state.process_group = dist.new_group(list(range(cl.size())))  # every rank makes it
    _train(_mlp(0, F64), state, ddp.hook, batches[:2])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert made_in_training == 1, made  # 6 steps of a bucket per parameter
    assert len(made) == 2 and made[1].transport.group is state.process_group, made
    assert state.iteration == 8


# -- a named algorithm: the hook's collectives through commlayer ---------------------------------
@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner"])
def test_named_algorithm_runs_through_commlayer(algorithm: str) -> None:
    reinit(allreduce_algorithm=algorithm)
    stopped = False
    try:
        running = cl.allreduce_algorithm()
        before = cl.communication_stats()["operations"]
        runs = {}
        for spec, dense_iters in (("none", 1), ("topk:ratio=0.3", 0), ("powersgd:rank=1", 1)):
            named = ddp.CommState(compression=spec, algorithm=algorithm, dense_iters=dense_iters)
            auto = ddp.CommState(compression=spec, dense_iters=dense_iters)
            runs[spec] = _both(named, ddp.hook, auto, ddp.hook, F64)
        operations = cl.communication_stats()["operations"] - before
        cl.barrier()
        cl.shutdown()
        stopped = True
        with pytest.raises(cl.NotInitializedError, match=r"not initialised.*init\(allreduce_alg"):
            ddp.CommState(algorithm=algorithm)
    finally:
        if stopped:
            cl.init()
        else:
            reinit()
    assert running == algorithm
    # 3 runs of 6 steps went through commlayer (at least a fused collective per step each; 0
    # if the hook had used torch.distributed).
    assert operations >= 3 * 6, operations
    for spec, (ours, theirs) in runs.items():
        # Another reduction order than gloo's: float64 rounding apart.
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=spec)


# -- lossy compressors: convergence on the digits data -------------------------------------------
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    datasets = pytest.importorskip("sklearn.datasets")
    x, y = datasets.load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def _digits_accuracy(state: Any, hook: Any, steps: int = 60) -> float:
    x, y = _digits()
    shard = slice(cl.rank(), None, cl.size())
    xs, ys = x[shard], y[shard]
    g = torch.Generator().manual_seed(7 + cl.rank())
    batches = []
    for _ in range(steps):
        rows = torch.randint(0, xs.shape[0], (32,), generator=g)
        batches.append((xs[rows], ys[rows]))
    # DDP's default 25 MB buckets: torch's powerSGD_hook hung on gloo with one bucket per
    # parameter (its callbacks wait() on a second collective), and one bucket is the usual case.
    model = _train(_mlp(1, torch.float32, (64, 64, 10)), state, hook, batches, 0.05, 25.0)
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_lossy_hooks_converge_like_allreduce() -> None:
    plain = _digits_accuracy(None, default_hooks.allreduce_hook)
    topk = _digits_accuracy(ddp.CommState(compression="topk:ratio=0.05"), ddp.hook)
    ours_psgd = _digits_accuracy(ddp.CommState(compression="powersgd:rank=2"), ddp.hook)
    torch_psgd = _digits_accuracy(
        powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2),
        powerSGD_hook.powerSGD_hook,
    )
    print(f"digits accuracy: allreduce {plain:.3f} topk {topk:.3f} powersgd {ours_psgd:.3f} "
          f"torch powersgd {torch_psgd:.3f}")  # fmt: skip
    assert plain > 0.85, plain
    # Lossy, with error feedback: a few points of accuracy at most after 60 steps.
    for name, accuracy in {
        "topk": topk,
        "powersgd": ours_psgd,
    }.items():
        assert accuracy > plain - 0.08, (name, accuracy, plain)


# -- error-feedback state: checkpoint and restore ------------------------------------------------
def test_residuals_survive_checkpoint_restore() -> None:
    spec = "topk:ratio=0.1"
    batches = _batches(8, F64)
    state = ddp.CommState(compression=spec)
    model = _train(_mlp(2, F64), state, ddp.hook, batches[:4])
    checkpoint = copy.deepcopy({"model": model.module.state_dict(), "hook": state.state_dict()})
    # Reference: go on with the same DDP model and hook state.
    optimizer_free = _params(_train(model.module, state, ddp.hook, batches[4:], lr=0.1))

    def resumed(restore_hook: bool) -> list[torch.Tensor]:
        fresh = _mlp(2, F64)
        fresh.load_state_dict(checkpoint["model"])
        fresh_state = ddp.CommState(compression=spec)
        if restore_hook:
            fresh_state.load_state_dict(copy.deepcopy(checkpoint["hook"]))
        else:
            fresh_state.iteration = checkpoint["hook"]["iteration"]
        return _params(_train(fresh, fresh_state, ddp.hook, batches[4:], lr=0.1))

    restored, forgotten = resumed(True), resumed(False)
    residuals = checkpoint["hook"]["compressor"]["residuals"]
    assert residuals and all(key.startswith("bucket") for key in residuals)
    assert all(torch.equal(a, b) for a, b in zip(restored, optimizer_free))
    # Without the residuals the run differs: the test above would notice a lost state.
    assert not all(torch.equal(a, b) for a, b in zip(forgotten, optimizer_free))


# -- over one rank: the identity (issue 35, item 1) -----------------------------------------------
class _Bucket:
    """What the hook reads of a GradBucket."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return [self._buffer]


def test_over_one_rank_the_hook_returns_the_bucket_at_once() -> None:
    """A process group of this rank alone (each rank its own; made on every rank in the same
    order): the hook, and compress_wrapper around it, return the very bucket, undivided and not
    cast, in a completed future; COMMLAYER_FORCE_FULL_PATH=1 (read when the state is made) takes
    the whole path: an fp16 round trip. DDP over such a group trains as plain PyTorch."""
    groups = [dist.new_group([r], backend="gloo") for r in range(cl.size())]
    group = groups[cl.rank()]
    values = torch.full((5,), 1 / 3)  # not a float16 value
    with cl.config.override(force_full_path=0):
        state = ddp.CommState(group, compression="fp16", dense_iters=0)
        plain = ddp.CommState(group, dense_iters=0)
    with cl.config.override(force_full_path=1):
        full = ddp.CommState(group, compression="fp16", dense_iters=0)
    returned, buffers = {}, {}
    for name, hook, hook_state in (
        ("hook", ddp.hook, state),
        ("wrapped", ddp.compress_wrapper(ddp.hook, "fp16"), plain),
        ("full", ddp.hook, full),
    ):
        buffers[name] = values.clone()
        future = hook(hook_state, _Bucket(buffers[name]))  # type: ignore[arg-type]
        returned[name] = (future.done(), future.wait() is buffers[name])
    batches = _batches(3, F64)
    models = []
    for hooked in (True, False):
        model = _mlp(0, F64)
        if hooked:
            model = DDP(model, process_group=group, bucket_cap_mb=TINY_BUCKET_MB)
            model.register_comm_hook(plain, ddp.hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        models.append(_params(model))
    assert returned["hook"] == returned["wrapped"] == (True, True)
    assert torch.equal(buffers["hook"], values) and torch.equal(buffers["wrapped"], values)
    assert state.iteration == 1
    assert torch.equal(buffers["full"], values.half().float()), "not the whole path"
    assert all(torch.equal(a, b) for a, b in zip(*models))
