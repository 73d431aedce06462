"""A newly registered algorithm, dense or sparse, is costed from its schedule and becomes a
candidate of ``auto`` with no table edited; the registries remove it again (``registered``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from schedule_check import simulate
from sparse_harness import allreduce_in_rounds
from waiting import wait_until

from commlayer import algorithms, costmodel
from commlayer.algorithms import sparse
from commlayer.algorithms.schedule import Schedule, compact, step
from commlayer.backends.loopback import LoopbackBackend, run_ranks
from commlayer.comm.sparse_reduction import engine_algorithm
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.core.selection import Allreducer
from commlayer.costmodel import Calibration
from commlayer.costmodel import sparse as cost

TOY = "toy_direct"


def direct(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
    """One step: the whole buffer to every other rank, and every other rank's reduced in."""
    others = [q for q in range(size) if q != rank]
    return compact([step([(q, 0, numel) for q in others], [(q, 0, numel) for q in others])])


# Every message costs 0.1 s whatever its size and local work is free: the toy's one step is the
# fewest of any schedule at 4 ranks; the natives' measured 1 s leave it a clear gain.
LATENCY_BOUND = Calibration(
    size=4,
    nodes=1,
    alpha_s=0.0,
    beta_s_per_byte=0.0,
    gamma_s_per_byte=0.0,
    copy_s_per_byte=0.0,
    native={name: [(1 << 10, 1.0), (1 << 26, 1.0)] for name in algorithms.NATIVE},
    exchange=[(1, 0.1), (1 << 30, 0.1)],
)


@pytest.fixture
def toy() -> Iterator[None]:
    with algorithms.registered(TOY, direct):
        yield
    assert TOY not in algorithms.available()


def test_the_toy_schedule_is_an_allreduce() -> None:
    size, n = 4, 10
    inputs = [torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(size)]
    out = simulate([direct(r, size, n, Topology.flat(size)) for r in range(size)], inputs,
                   ReduceOp.Sum)  # fmt: skip
    assert all(torch.equal(o, sum(inputs)) for o in out)


@pytest.mark.usefixtures("toy")
def test_a_registered_dense_algorithm_is_a_candidate_and_costed_from_its_schedule() -> None:
    assert TOY in costmodel.candidates(True) and TOY in costmodel.candidates(False)
    assert costmodel.predict(TOY, 1000, 4, LATENCY_BOUND) == pytest.approx(0.1)
    table = costmodel.table(4000, LATENCY_BOUND)
    assert table[0] == (TOY, pytest.approx(0.1))
    assert costmodel.choose(1000, 4, 4, 1, LATENCY_BOUND) == TOY
    assert TOY in costmodel.ranked(1000, 4, 4, 1, LATENCY_BOUND)


@pytest.mark.usefixtures("toy")
def test_auto_runs_the_registered_algorithm_when_it_is_predicted_fastest() -> None:
    def main(backend: LoopbackBackend) -> tuple[str, torch.Tensor]:
        allreducer = Allreducer(algorithms.AUTO, [LATENCY_BOUND])
        buf = torch.full((1000,), float(backend.rank + 1))
        request = allreducer(backend, None, buf, ReduceOp.Sum)
        wait_until(request.test, 10.0, f"rank {backend.rank}: {TOY} did not complete")
        return allreducer.choose(backend, buf.numel(), 4), buf

    for name, buf in run_ranks(4, main):
        assert name == TOY
        assert torch.equal(buf, torch.full((1000,), 10.0))


def test_registering_twice_or_removing_an_unknown_name_is_an_error() -> None:
    with algorithms.registered(TOY, direct):
        with pytest.raises(ValueError, match="already registered"):
            algorithms.register(TOY)(direct)
    with pytest.raises(ValueError, match="not a registered"):
        algorithms.unregister(TOY)
    with pytest.raises(ValueError, match="already registered"):
        algorithms.register("mpi")(direct)


SPARSE_TOY = "toy_sparse_direct"
# Messages dear, merging cheap: the toy's one step beats every other exact algorithm's two or
# more (the allgather's log2 p rounds included).
DEAR_MESSAGES = cost.Rates(alpha_s=1e-3, merge_s_per_pair=1e-12, scatter_s_per_entry=1e-12)


@pytest.fixture
def sparse_toy() -> Iterator[None]:
    with sparse.registered(SPARSE_TOY, sparse.Policy(switch=True), direct):
        yield
    assert SPARSE_TOY not in sparse.available()


@pytest.mark.usefixtures("sparse_toy")
def test_a_registered_sparse_algorithm_is_costed_from_its_schedule() -> None:
    n, nnz = 1 << 20, 1000
    assert SPARSE_TOY in sparse.exact()
    toy = cost.predict(SPARSE_TOY, 4, n, nnz, rates=DEAR_MESSAGES)
    assert toy.bytes_sent == pytest.approx(3 * nnz * 8)  # its vector to each of 3 others
    assert toy.seconds == pytest.approx(
        1e-3 + 3 * nnz * 8 * DEAR_MESSAGES.beta_s_per_byte, rel=1e-3
    )
    assert cost.choose(4, n, nnz, rates=DEAR_MESSAGES) == SPARSE_TOY
    # dense switch: at 50% on 4 ranks each stream is cheaper dense (n values) than as pairs
    assert cost.predict(SPARSE_TOY, 4, n, n // 2, rates=DEAR_MESSAGES).bytes_sent == 3 * n * 4


@pytest.mark.usefixtures("sparse_toy")
def test_sparse_auto_runs_the_registered_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "calibrated", lambda size: DEAR_MESSAGES)
    n = 97
    inputs = [(torch.arange(r, n, 7), torch.ones(len(range(r, n, 7)))) for r in range(4)]
    expected = torch.zeros(n)
    for idx, val in inputs:
        expected.index_add_(0, idx, val)

    # DistributedOptimizer's pick for auto (k = the largest nnz), then the rounds it runs
    name = engine_algorithm(sparse.AUTO, 4, n, max(idx.numel() for idx, _ in inputs))
    assert name == SPARSE_TOY
    for result, _, _ in allreduce_in_rounds(inputs, n, name):
        assert torch.equal(result.dense(), expected)


def test_unknown_sparse_names_still_have_no_cost_model() -> None:
    with pytest.raises(ValueError, match="no cost model"):
        cost.predict(SPARSE_TOY, 4, 100, 10)
    with sparse.registered(SPARSE_TOY, sparse.Policy(switch=False), direct):
        assert cost.predict(SPARSE_TOY, 4, 100, 10).seconds > 0
    with pytest.raises(ValueError, match="no cost model"):
        cost.predict(SPARSE_TOY, 4, 100, 10)
