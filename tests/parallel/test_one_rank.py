"""Reduction over one rank is the identity (issue 35, item 1), as in Horovod, whose
DistributedOptimizer registers no hooks when size() is 1 and whose step is then the wrapped
optimizer's: over a process set of one rank (the global one at size 1, else a set of this rank
alone, so every case runs at any size) no hook is registered and nothing is compressed, sent or
waited for, so training is plain PyTorch's, bit for bit, whatever the options (op=Adasum too, as
Horovod takes it at size 1); synchronize() and skip_synchronize() behave as Horovod's there.
``COMMLAYER_FORCE_FULL_PATH=1`` (which the rest of this suite sets, conftest.py 5.) takes the
whole path again. Collectives called directly still run through the engine. The DDP hook's
identity is in test_ddp_hook.py.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as cl
from commlayer.common import config

F64 = torch.float64


@pytest.fixture
def alone() -> Iterator[cl.ProcessSet]:
    """A process set of this rank alone (the global set at size 1), with the full path off."""
    sets = [cl.add_process_set([r]) for r in range(cl.size())] if cl.size() > 1 else []
    try:
        with config.override(force_full_path=0):
            yield sets[cl.rank()] if sets else cl.global_process_set
    finally:
        for ps in sets:
            cl.remove_process_set(ps)


def _model(sparse: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)]
    if sparse:
        layers.insert(0, nn.EmbeddingBag(20, 6, mode="sum", sparse=True))
    return nn.Sequential(*layers).to(F64)


def _batch(step: int, sparse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * cl.rank() + step)  # each rank its own data
    x = torch.randint(0, 20, (4, 3), generator=g) if sparse else torch.randn(4, 6, generator=g)
    return x, torch.randn(4, 3, generator=g, dtype=F64)


def _loop(model: nn.Module, opt: torch.optim.Optimizer, passes: int, sparse: bool) -> list[Any]:
    """Three steps of ``passes`` backward passes each; the gradients each step saw."""
    grads = []
    for step in range(3):
        for k in range(passes):
            x, y = _batch(10 * step + k, sparse)
            F.mse_loss(model(x if sparse else x.to(F64)), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return grads


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


OPTIONS: dict[str, dict[str, Any]] = {
    "average": {},
    "op_sum": {"op": cl.Sum},
    "op_adasum": {"op": cl.Adasum},  # refused over more ranks; Horovod's is plain at size 1
    "gradient_predivide_factor_4": {"gradient_predivide_factor": 4.0},
    "fp16": {"compression": "fp16"},
    "topk": {"compression": "topk:ratio=0.1"},
    "powersgd": {"compression": "powersgd:rank=1"},
    "backward_passes_per_step_2": {"backward_passes_per_step": 2},
    "sparse": {},
    "sparse_as_dense": {"sparse_as_dense": True},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_training_is_plain_pytorch_bit_for_bit(alone: cl.ProcessSet, option: str) -> None:
    """Gradients as backward made them (not cast, not scaled, sparse ones still sparse), the
    same steps as the plain optimizer, no hook, no operation through the engine."""
    kwargs = OPTIONS[option]
    sparse = option.startswith("sparse")
    passes = kwargs.get("backward_passes_per_step", 1)
    model = _model(sparse)
    ref = copy.deepcopy(model)
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        process_set=alone,
        **kwargs,
    )
    before = cl.communication_stats()["operations"]
    got = _loop(model, opt, passes, sparse)
    sent = cl.communication_stats()["operations"] - before
    want = _loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), passes, sparse)
    assert opt._commlayer.hooks == [] and sent == 0
    for step_got, step_want in zip(got, want):
        assert [g.is_sparse for g in step_got] == [g.is_sparse for g in step_want]
        assert all(torch.equal(_dense(a), _dense(b)) for a, b in zip(step_got, step_want))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_synchronize_and_skip_synchronize_as_horovod(alone: cl.ProcessSet) -> None:
    """synchronize() then step() in skip_synchronize() is quiet; step() straight after
    synchronize() warns, as Horovod's does at size 1 too; zero_grad() after backward is allowed
    and a second backward accumulates (Horovod has no handle to lose there)."""
    model = _model()
    opt = cl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=alone)
    x, y = _batch(0)
    F.mse_loss(model(x.to(F64)), y).backward()
    F.mse_loss(model(x.to(F64)), y).backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    opt.zero_grad()
    F.mse_loss(model(x.to(F64)), y).backward()
    opt.zero_grad()  # nothing in flight
    F.mse_loss(model(x.to(F64)), y).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


def test_the_switch_takes_the_full_path(alone: cl.ProcessSet) -> None:
    """COMMLAYER_FORCE_FULL_PATH=1: hooks, and the gradients go through the engine (benchmarks
    and tests measure that path); the result is the same average over one rank."""
    model = _model()
    ref = copy.deepcopy(model)
    with config.override(force_full_path=1):
        opt = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=[(f"full.{n}", p) for n, p in model.named_parameters()],
            process_set=alone,
        )
    before = cl.communication_stats()["operations"]
    _loop(model, opt, 1, False)
    sent = cl.communication_stats()["operations"] - before
    _loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 1, False)
    assert len(opt._commlayer.hooks) == 4 and sent > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_collectives_still_go_through_the_engine(alone: cl.ProcessSet) -> None:
    """As in Horovod, hvd.allreduce over one rank runs (and counts) as at any size."""
    before = cl.communication_stats()["operations"]
    out = cl.allreduce(torch.arange(5.0), op=cl.Sum, name="alone.allreduce", process_set=alone)
    assert torch.equal(out, torch.arange(5.0))
    assert cl.communication_stats()["operations"] > before
