"""Sparse allreduce algorithms (issue 6) through the engine, as DistributedOptimizer runs them
(comm/sparse_reduction.py): top-k gradients give what the allgather path gives, topo_sparse on
the job's topology, gtopk's dropped mass kept in the residual. The algorithms themselves, at 1-8
ranks against the dense sum, are tests/unit/test_sparse.py's."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import commlayer as cl
from commlayer.algorithms import sparse

_checks = itertools.count()


def gathered(result: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor as rows (same name on every rank: a shared counter)."""
    return cl.allgather(result.reshape(1, -1), name=f"sparse.check.{next(_checks)}")


@pytest.mark.parametrize("algorithm", [*sparse.exact()[1:], "auto"])
def test_distributed_optimizer_reduces_topk_sparse(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Top-k gradients through the engine's collectives (through_engine.py: alltoall +
    allgather for the split-allgather family, one alltoall per round for the point-to-point
    schedules) give what the allgather path gives: the simulated job of test_compression."""
    from test_compression import EXACT, SHAPES, _simulate, _train

    from commlayer.comm import communicator
    from commlayer.comm.sparse_reduction import SparseReduction
    from commlayer.common import config

    made: list[str] = []

    class Counted(SparseReduction):
        def __init__(self, name: str, *args: object, **kwargs: object) -> None:
            made.append(name)
            super().__init__(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(communicator, "SparseReduction", Counted)
    spec = "topk:ratio=0.05"
    with config.override(sparse_algorithm=algorithm):
        got, _ = _train(spec)
    want = _simulate(spec)
    for step, (g, w) in enumerate(zip(got, want)):
        for name in SHAPES:
            torch.testing.assert_close(g[name], w[name], msg=f"step {step} {name}", **EXACT)
    if algorithm != "auto":  # auto may pick allgather for these small tensors
        assert sorted(set(made)) == ["grad.v", "grad.w"]  # b is below the compression threshold


def test_topo_sparse_from_the_optimizer_runs_on_the_jobs_topology(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """topo_sparse through the optimizer gets the process set's topology (here
    COMMLAYER_TOPOLOGY's two nodes of two ranks), not a flat one, and still gives what the
    allgather path gives."""
    if cl.size() != 4:
        pytest.skip("two nodes of two ranks: 4 ranks")
    from restart import reinit
    from test_compression import EXACT, SHAPES, _simulate, _train

    from commlayer.comm import communicator
    from commlayer.comm.sparse_reduction import SparseReduction

    seen: list[tuple[int, ...]] = []

    class Seen(SparseReduction):
        def __init__(self, *args: object, topology: Any = None, **kwargs: object) -> None:
            seen.append(topology.node_of)
            super().__init__(*args, topology=topology, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(communicator, "SparseReduction", Seen)
    reinit(topology="nodes=2,local=2", sparse_algorithm="topo_sparse")
    try:
        got, _ = _train("topk:ratio=0.05")
    finally:
        reinit()
    want = _simulate("topk:ratio=0.05")
    for step, (g, w) in enumerate(zip(got, want)):
        for name in SHAPES:
            torch.testing.assert_close(g[name], w[name], msg=f"step {step} {name}", **EXACT)
    assert seen and set(seen) == {(0, 0, 1, 1)}, seen


def test_distributed_optimizer_gtopk_keeps_dropped_mass_in_the_residual() -> None:
    """gtopk from the optimizer (op=Sum, integer-valued gradients: every sum exact): at each
    step, sum over ranks of (gradient + residual before) = result + sum over ranks of the
    residual after, where the residual holds what top-k and gtopk's re-selection dropped; the
    result keeps at most k entries."""
    from commlayer import compression
    from commlayer.common import config

    numel, ratio = 1500, 0.02
    k = compression.base.kept(numel, ratio)
    w = torch.nn.Parameter(torch.zeros(numel, dtype=torch.float64))
    ef = compression.create(f"topk:ratio={ratio}")
    with config.override(sparse_algorithm="gtopk"):  # read when the optimizer is made
        opt = cl.DistributedOptimizer(
            torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)], compression=ef, op=cl.Sum
        )
    size = cl.size()
    residuals = torch.zeros(size, numel, dtype=torch.float64)
    for step in range(3):
        grads = torch.stack([
            torch.randint(-50, 51, (numel,), generator=torch.Generator().manual_seed(
                100 * step + r)).double() for r in range(size)
        ])  # fmt: skip
        (w * grads[cl.rank()]).sum().backward()
        opt.synchronize()
        assert w.grad is not None
        result = w.grad.clone()
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        after = gathered(ef.residuals["grad.w"])
        nnz = int((result != 0).sum())
        assert nnz <= k, f"rank {cl.rank()}: gtopk kept {nnz} > k = {k} at step {step}"
        torch.testing.assert_close(
            (grads + residuals).sum(0), result + after.sum(0), rtol=0, atol=0,
            msg=f"rank {cl.rank()}: mass lost at step {step}",
        )  # fmt: skip
        residuals = after
