"""Sparse allreduce algorithms (issue 6) under real MPI, each driven directly on a duplicate of
COMM_WORLD: exact ones against the dense sum of every rank's densified input (disjoint,
identical, overlapping supports, empty on some ranks, k = n), the same result on every rank;
gtopk: result + everyone's dropped entries = the sum; isend_any -> irecv_any. Every rank builds
every rank's input from a shared seed, so the reference is computed locally."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from launch import own_backend
from waiting import wait_until

import commlayer as cl
from commlayer.algorithms import sparse
from commlayer.algorithms.sparse.executor import SparseResult, sparse_allreduce
from commlayer.backends.base import Backend
from commlayer.core.topology import Topology

N = 1001
KINDS = ("disjoint", "identical", "overlapping", "empty_on_some", "k_equals_n")


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    own = own_backend()  # collective: every rank makes it here
    yield own
    own.close()


def inputs(kind: str, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    nnz = N // 20
    out = []
    for r in range(size):
        if kind == "disjoint":
            idx = torch.arange(r, N, size)[:nnz]
        elif kind == "identical":
            idx = torch.arange(0, N, 7)[:nnz]
        elif kind == "overlapping":
            idx = torch.randperm(N, generator=g)[: 4 * nnz]
        elif kind == "empty_on_some":
            idx = (
                torch.randperm(N, generator=g)[:nnz] if r % 2 else torch.empty(0, dtype=torch.int64)
            )
        else:
            idx = torch.randperm(N, generator=g)
        out.append((idx, torch.randint(-9, 10, (idx.numel(),), generator=g).float()))
    return out


def dense_sum(data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    total = torch.zeros(N)
    for idx, val in data:
        total.index_add_(0, idx, val)
    return total


def run(
    backend: Backend, name: str, data: list[tuple[torch.Tensor, torch.Tensor]], k: int = 0
) -> tuple[SparseResult, SparseResult | None]:
    size = backend.size
    topology = Topology(tuple(r // 2 for r in range(size))) if size == 4 else None
    req = sparse_allreduce(backend, *data[backend.rank], N, name, k=k, topology=topology)
    wait_until(req.test, 60.0, f"rank {backend.rank}: {name} did not complete")
    assert req.result is not None
    return req.result, req.dropped


_checks = itertools.count()


def gathered(result: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor as rows (same name on every rank: a shared counter)."""
    return cl.allgather(result.reshape(1, -1), name=f"sparse.check.{next(_checks)}")


@pytest.mark.parametrize("name", [*sparse.exact(), "auto"])
def test_exact_algorithms_equal_the_dense_sum(backend: Backend, name: str) -> None:
    failures = []
    for kind in KINDS:
        data = inputs(kind, backend.size, seed=len(kind))
        result, _ = run(backend, name, data)
        if not torch.equal(result.dense(), dense_sum(data)):
            failures.append(kind)
    assert not failures, f"rank {backend.rank}: {name} wrong for {failures}"


@pytest.mark.parametrize("name", sparse.exact())
def test_same_bits_on_every_rank(backend: Backend, name: str) -> None:
    g = torch.Generator().manual_seed(9)
    data = [
        (torch.randperm(N, generator=g)[:200], torch.randn(200, generator=g))
        for _ in range(backend.size)
    ]
    result, _ = run(backend, name, data)
    rows = gathered(result.dense())
    assert all(torch.equal(row, rows[0]) for row in rows)
    assert torch.allclose(rows[0], dense_sum(data), atol=1e-5)


def test_gtopk_result_plus_dropped_is_the_sum(backend: Backend) -> None:
    data = inputs("overlapping", backend.size, seed=4)
    result, dropped = run(backend, "gtopk", data, k=25)
    assert result.indices is not None and result.nnz <= 25
    assert dropped is not None
    rows = gathered(dropped.dense())
    assert all(torch.equal(row, result.dense()) for row in gathered(result.dense()))
    assert torch.equal(result.dense() + rows.sum(0), dense_sum(data))


def test_irecv_any_sizes_each_message(backend: Backend) -> None:
    rank, size = backend.rank, backend.size
    if size == 1:
        pytest.skip("needs a peer")
    right, left = (rank + 1) % size, (rank - 1) % size
    sends = [
        backend.isend_any(torch.full((n + rank,), float(rank)), right) for n in (0, 3, 1 << 16)
    ]
    recvs = [backend.irecv_any(torch.float32, left) for _ in range(3)]
    requests = [*sends, *recvs]
    what = f"rank {rank}: the sends and receives did not complete"
    wait_until(lambda: all([r.test() for r in requests]), 30.0, what)  # a list: test each one
    for n, recv in zip((0, 3, 1 << 16), recvs):
        assert recv.tensor is not None
        assert torch.equal(recv.tensor, torch.full((n + left,), float(left)))


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
    from commlayer.core import config

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
    from commlayer.core import config

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
