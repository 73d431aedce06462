"""Compressors through DistributedOptimizer under real MPI (issue #4), at any number of ranks.

The yardstick: every rank can regenerate every rank's gradients (seeded by rank and step), so
each rank simulates the whole job locally with one compressor instance per simulated rank:
summable payloads are averaged as the allreduce does, round by round; gathered payloads are
each decompressed and averaged. With SGD at lr=1 the parameter change of a step is minus the
reduced gradient, which must equal the simulation's (float64, so only summation order differs).

Collectives first, asserts last, as in test_optimizer.py.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from restart import reinit
from torch import nn

import commlayer as cl
from commlayer.common.errors import PayloadError
from commlayer.compression import (
    Compressed,
    Compressor,
    ErrorFeedback,
    Policy,
    QSGDCompressor,
    TopKCompressor,
    register,
)

F64 = torch.float64
SHAPES = {"w": (48, 50), "v": (1500,), "b": (30,)}  # b: below the 1024-element threshold
STEPS = 3
EXACT = {"rtol": 1e-10, "atol": 1e-12}
# Deterministic given the gradients (qsgd's rounding is per-rank random: checked separately).
SPECS = [
    "none",
    "fp16",
    "bf16",
    "topk:ratio=0.05",
    "topk:ratio=0.05,mode=sampled",
    "topk:ratio=0.05,ef=0",
    "randomk:ratio=0.1",
    "efsignsgd",
    "onebit",
    "powersgd:rank=2",
]


class _Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SHAPES["w"], dtype=F64))
        self.v = nn.Parameter(torch.zeros(SHAPES["v"], dtype=F64))
        self.b = nn.Parameter(torch.zeros(SHAPES["b"], dtype=F64))


def _grad(name: str, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + len(name))
    return torch.randn(SHAPES[name], generator=gen, dtype=F64)


def _train(spec: str | Policy, steps: int = STEPS) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """Each step's reduced gradient per parameter (minus the change under SGD lr=1)."""
    model = _Params()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression=spec,
    )
    return _reduced(model, opt, steps), opt


def _reduced(model: nn.Module, opt: Any, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` steps of ``opt`` (SGD lr=1 over ``model``, a _Params), each rank its seeded
    gradients: each step's reduced gradient per parameter (minus the change)."""
    reduced = []
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        # d/dp of sum(p * g) is g exactly: each rank's gradient is its seeded tensor.
        loss = sum((p * _grad(n, cl.rank(), step)).sum() for n, p in model.named_parameters())
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        reduced.append({n: before[n] - p.detach() for n, p in model.named_parameters()})
    return reduced


def _simulate(spec: str, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """The same job on one process: one compressor per simulated rank."""
    size = cl.size()
    policies = [Policy(spec) for _ in range(size)]
    reduced = []
    for step in range(steps):
        result = {}
        for name in SHAPES:
            grads = [_grad(name, r, step) for r in range(size)]
            chosen = [pol.choose(name, g) for pol, g in zip(policies, grads)]
            result[name] = _reduce(chosen, grads, f"grad.{name}")
        reduced.append(result)
    return reduced


def _reduce(compressors: list[Compressor], grads: list[torch.Tensor], name: str) -> torch.Tensor:
    parts = [c.compress(g, name) for c, g in zip(compressors, grads)]
    if not compressors[0].summable:
        decoded = [compressors[0].decompress(Compressed(p.payload, parts[0].ctx)) for p in parts]
        return torch.stack(decoded).mean(dim=0)
    while True:
        mean = torch.stack([p.payload[0].to(F64) for p in parts]).mean(dim=0)
        for p in parts:
            p.payload[0].copy_(mean)  # the allreduce, in place
        if parts[0].final:
            return compressors[0].decompress(parts[0]).to(F64)
        parts = [c.next_round(p, name) for c, p in zip(compressors, parts)]  # type: ignore[attr-defined]


def _mean(name: str, step: int = 0) -> torch.Tensor:
    return torch.stack([_grad(name, r, step) for r in range(cl.size())]).mean(dim=0)


# Casts: the engine sums float16 (pre-divided) or bfloat16, the simulation averages in float64
# and rounds once; they differ by a few units in the last place of the wire dtype.
TOLERANCE = {"fp16": {"rtol": 4e-3, "atol": 4e-3}, "bf16": {"rtol": 3e-2, "atol": 3e-2}}


@pytest.mark.parametrize("spec", SPECS)
def test_reduced_gradient_equals_the_simulated_job(spec: str) -> None:
    got, _ = _train(spec)
    want = _simulate(spec)
    for step, (g, w) in enumerate(zip(got, want)):
        for name in SHAPES:
            tol = TOLERANCE.get(spec, EXACT)
            torch.testing.assert_close(g[name], w[name], msg=f"step {step} {name}", **tol)
    if spec != "none":  # the compressor did something: not the plain mean
        assert not torch.allclose(got[0]["w"], _mean("w"), **EXACT)
    if spec not in TOLERANCE:  # below 1024 elements: sent as is (casts cast everything)
        torch.testing.assert_close(got[0]["b"], _mean("b"), **EXACT)


_COMPRESSING_THREADS: set[str] = set()


@register("test_thread_topk")
class _ThreadTopK(TopKCompressor):
    """Top-k that notes the thread that compresses (compress_sum_: under error feedback)."""

    name = "test_thread_topk"

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        _COMPRESSING_THREADS.add(threading.current_thread().name)
        return super().compress(tensor, name)

    def compress_sum_(self, acc: torch.Tensor, tensor: torch.Tensor, name: str = "") -> Compressed:
        _COMPRESSING_THREADS.add(threading.current_thread().name)
        return super().compress_sum_(acc, tensor, name)


@register("test_raising")
class _Raising(TopKCompressor):
    name = "test_raising"

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        raise ValueError(f"test_raising cannot compress {name}")


def test_compression_runs_on_the_engine_thread_with_unchanged_results() -> None:
    """The gradient hooks hand compression to the engine's thread (communicator.py): the
    training thread never compresses, and the results are the simulated job's, where every
    compress runs on this thread."""
    _COMPRESSING_THREADS.clear()
    got, _ = _train("test_thread_topk:ratio=0.05,mode=sampled")
    assert _COMPRESSING_THREADS == {"commlayer-engine"}
    want = _simulate("topk:ratio=0.05,mode=sampled")
    for step, (g, w) in enumerate(zip(got, want)):
        for name in SHAPES:
            torch.testing.assert_close(g[name], w[name], msg=f"step {step} {name}", **EXACT)


def test_an_error_of_compress_on_the_engine_thread_reaches_step() -> None:
    model = _Params()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression="test_raising:ef=0",
    )
    for name, p in model.named_parameters():
        p.grad = _grad(name, cl.rank(), 0)
    with pytest.raises(ValueError, match="test_raising cannot compress grad.w"):
        opt.step()
    cl.barrier()  # the uncompressed bias went through on every rank; nothing is left in flight


def test_qsgd_reduced_gradient_is_the_mean_up_to_rounding() -> None:
    got, _ = _train("qsgd:levels=127,bucket=512", steps=1)
    gathered = cl.allgather(got[0]["w"][None])
    for name in SHAPES:
        error = (got[0][name] - _mean(name)).norm() / _mean(name).norm()
        # Lemma 3.1: a rank's relative error is at most sqrt(min(b/s^2, sqrt(b)/s)) = 0.18 in
        # root mean square (~0.07 on Gaussian data); averaging over ranks only shrinks it.
        assert 0 < error < 0.18 if name != "b" else error < 1e-12, f"{name}: {error:.3g}"
    assert all(torch.equal(gathered[r], gathered[0]) for r in range(cl.size()))


def test_op_sum_sums_compressed_gradients() -> None:
    model = _Params()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression="topk:ratio=0.05,ef=0",
        op=cl.Sum,
    )
    for name, p in model.named_parameters():
        p.grad = _grad(name, cl.rank(), 0)
    opt.step()
    want = _simulate("topk:ratio=0.05,ef=0", steps=1)[0]
    for name, p in model.named_parameters():
        torch.testing.assert_close(-p.detach(), want[name] * cl.size(), **EXACT)


def test_per_parameter_policy() -> None:
    policy = Policy("topk:ratio=0.01", per_parameter={"w": "none", "v": "onebit"})
    got, opt = _train(policy, steps=1)

    torch.testing.assert_close(got[0]["w"], _mean("w"), **EXACT)
    assert got[0]["v"].unique().numel() <= 2 ** cl.size()  # sums of the ranks' two levels
    assert set(opt.state_dict()["commlayer_compression"]["compressors"]) == {"default", "v"}


def test_compression_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMLAYER_COMPRESSION is read by init() (once): set when commlayer starts, it is the
    optimizer's default; set after, it changes nothing until the next init()."""
    monkeypatch.setenv("COMMLAYER_COMPRESSION", "topk:ratio=0.05")
    reinit()
    try:
        got, opt = _train(None, steps=1)  # type: ignore[arg-type]
        monkeypatch.setenv("COMMLAYER_COMPRESSION", "fp16")
        _, later = _train(None, steps=1)  # type: ignore[arg-type]
    finally:
        monkeypatch.delenv("COMMLAYER_COMPRESSION")
        reinit()
    want = _simulate("topk:ratio=0.05", steps=1)

    assert isinstance(opt._commlayer.policy.default, ErrorFeedback)  # type: ignore[attr-defined]
    torch.testing.assert_close(got[0]["w"], want[0]["w"], **EXACT)
    assert isinstance(later._commlayer.policy.default, ErrorFeedback)  # type: ignore[attr-defined]


def test_init_keywords_reach_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """init(compression="fp16", sparse_algorithm="dsar") is what the optimizer uses, over an
    environment that says otherwise (the optimizer used to re-read the environment: with
    init(compression="fp16") a step moved as many bytes as uncompressed). fp16 sends 2 bytes an
    element (the parameters here are float64) in every step after the first (whose end also
    broadcasts the bucket plan)."""
    monkeypatch.setenv("COMMLAYER_COMPRESSION", "none")
    monkeypatch.setenv("COMMLAYER_SPARSE_ALGORITHM", "allgather")
    reinit(compression="fp16", sparse_algorithm="dsar")
    try:
        _, opt = _train(None, steps=1)  # type: ignore[arg-type]
        before = cl.communication_stats()["payload_bytes"]
        model = _Params()
        later = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters()
        )
        for step in range(2):
            if step == 1:
                before = cl.communication_stats()["payload_bytes"]
            loss = sum((p * _grad(n, cl.rank(), step)).sum() for n, p in model.named_parameters())
            loss.backward()  # type: ignore[union-attr]
            later.step()
            later.zero_grad()
        moved = cl.communication_stats()["payload_bytes"] - before
    finally:
        reinit()
    assert opt._commlayer.policy.default.name == "fp16"  # type: ignore[attr-defined]
    assert opt._commlayer.comm.transport.sparse_algorithm == "dsar"  # type: ignore[attr-defined]
    elements = sum(p.numel() for p in model.parameters())
    assert moved == 2 * elements, f"{moved} bytes moved for {elements} gradient elements"


def test_bad_compression_arguments() -> None:
    model = _Params()

    def wrap(**kwargs: Any) -> None:
        cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            named_parameters=model.named_parameters(),
            **kwargs,
        )

    with pytest.raises(ValueError, match=r"ratio must be a number in \(0, 1\], got 0"):
        wrap(compression="topk:ratio=0")
    with pytest.raises(ValueError, match=r"per_parameter names \['nope'\] are not parameters"):
        wrap(compression=Policy("topk", per_parameter={"nope": "none"}))
    with pytest.raises(ValueError, match=r"needs op=Average or op=Sum, got Max"):
        wrap(compression="qsgd", op=cl.Max)


# -- error feedback state in state_dict --------------------------------------------------------
def test_residuals_survive_state_dict_round_trip() -> None:
    spec = "topk:ratio=0.02"
    _, opt = _train(spec, steps=2)
    saved = copy.deepcopy(opt.state_dict())
    model = _Params()
    resumed = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression=spec,
    )
    resumed.load_state_dict(copy.deepcopy(saved))
    foreign = copy.deepcopy(saved)
    foreign["commlayer_compression"]["rank"] = cl.rank() + 1  # another rank's checkpoint
    other = cl.DistributedOptimizer(
        torch.optim.SGD(_Params().parameters(), lr=1.0), compression=spec
    )
    other.load_state_dict(foreign)

    residuals = saved["commlayer_compression"]["compressors"]["default"]["residuals"]
    assert set(residuals) == {"grad.w", "grad.v"} and residuals["grad.w"].abs().sum() > 0
    loaded = resumed._commlayer.policy.default.residuals  # type: ignore[attr-defined]
    assert all(torch.equal(loaded[n], r) for n, r in residuals.items())
    assert other._commlayer.policy.default.residuals == {}  # type: ignore[attr-defined]


# -- malformed payloads from a peer --------------------------------------------------------------
@register("test_corrupt_topk")
class _CorruptTopK(TopKCompressor):
    """Top-k whose last rank sends an index past the end, or one value too few."""

    name = "test_corrupt_topk"

    def __init__(self, how: str = "index") -> None:
        super().__init__(0.05)
        self.how = how

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        compressed = super().compress(tensor, name)
        if cl.rank() == cl.size() - 1:
            values, indices = compressed.payload
            if self.how == "index":
                indices[0] = tensor.numel() + 5
            else:
                compressed.payload = [values[:-1], indices]
        return compressed


@register("test_nan_qsgd")
class _NanQSGD(QSGDCompressor):
    name = "test_nan_qsgd"

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        compressed = super().compress(tensor, name)
        if cl.rank() == cl.size() - 1:
            compressed.payload[1][0] = float("nan")
        return compressed


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "test_corrupt_topk:how=index,ef=0",
            r"test_corrupt_topk payload from rank {bad}: topk index 2405 out of",
        ),
        (
            "test_corrupt_topk:how=length,ef=0",
            r"test_corrupt_topk payload from rank {bad}: topk values has 119 ",
        ),
        ("test_nan_qsgd", r"test_nan_qsgd payload from rank {bad}: qsgd norm holds nan"),
    ],
    ids=["index_out_of_range", "wrong_length", "nan_norm"],
)
def test_malformed_payload_from_a_peer_names_tensor_and_rank(spec: str, message: str) -> None:
    model = _Params()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression=spec,
    )
    for name, p in model.named_parameters():
        p.grad = _grad(name, cl.rank(), 0)
    expected = f"rank {cl.rank()}: gradient 'grad.w': malformed " + message.format(
        bad=cl.size() - 1
    )
    with pytest.raises(PayloadError, match=expected):
        opt.step()
    assert not model.w.detach().any(), "the parameter was updated from a corrupt gradient"
    cl.barrier()  # every rank failed the same way and nothing is left in flight
