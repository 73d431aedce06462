"""Sparse allreduce algorithms at 1..8 ranks, their schedules run round by round as the engine
runs them (sparse_harness.py): exact ones against the dense sum of the densified inputs
(disjoint, identical, overlapping supports, empty on some ranks, k = n), the same bits on every
rank, the dense switch, gtopk against its definition, the cost model, input checks."""

from __future__ import annotations

import pytest
import torch
from sparse_harness import allreduce_in_rounds

from commlayer.algorithms import sparse
from commlayer.algorithms.sparse.executor import SparseResult, prepare
from commlayer.common.topology import Topology
from commlayer.costmodel import sparse as cost

N = 97
EXACT = sparse.exact()
SCHEDULED = [name for name in EXACT if name not in sparse.NATIVE]  # allgather: the communicator
Inputs = list[tuple[torch.Tensor, torch.Tensor]]


def supports(kind: str, size: int, n: int, seed: int) -> Inputs:
    """Each rank's (indices in random order, integer-valued float32 values)."""
    g = torch.Generator().manual_seed(seed)
    nnz = max(n // 10, 1)
    out = []
    for r in range(size):
        if kind == "disjoint":
            idx = torch.arange(r, n, size)[:nnz]
        elif kind == "identical":
            idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:nnz]
        elif kind == "overlapping":
            idx = torch.randperm(n, generator=g)[: 3 * nnz]
        elif kind == "empty_on_some":
            idx = (
                torch.randperm(n, generator=g)[:nnz] if r % 2 else torch.empty(0, dtype=torch.int64)
            )
        else:  # k = n
            idx = torch.randperm(n, generator=g)
        val = torch.randint(-9, 10, (idx.numel(),), generator=g).float()
        out.append((idx, val))
    return out


KINDS = ("disjoint", "identical", "overlapping", "empty_on_some", "k_equals_n")


def dense_sum(inputs: Inputs, n: int) -> torch.Tensor:
    total = torch.zeros(n, dtype=inputs[0][1].dtype if inputs else torch.float32)
    for idx, val in inputs:
        total.index_add_(0, idx.long(), val)
    return total


def run(
    size: int, inputs: Inputs, n: int, name: str, k: int = 0, topology: Topology | None = None
) -> list[tuple[SparseResult, SparseResult | None, int]]:
    """Every rank's (result, dropped, bytes sent)."""
    return allreduce_in_rounds(inputs, n, name, k=k, topology=topology)


def node_layout(size: int) -> Topology | None:
    return Topology(tuple(r // 2 for r in range(size))) if size % 2 == 0 and size > 2 else None


@pytest.mark.parametrize("name", SCHEDULED)
@pytest.mark.parametrize("size", range(1, 9))
def test_exact_algorithms_equal_the_dense_sum(name: str, size: int) -> None:
    for kind in KINDS:
        inputs = supports(kind, size, N, seed=size)
        expect = dense_sum(inputs, N)
        results = run(size, inputs, N, name, topology=node_layout(size))
        for r, (result, _, _) in enumerate(results):
            assert torch.equal(result.dense(), expect), f"{kind}: rank {r} of {size}"
            if result.indices is not None:
                assert bool((result.indices[1:] > result.indices[:-1]).all())


@pytest.mark.parametrize("name", SCHEDULED)
@pytest.mark.parametrize("size", (3, 4, 6))
def test_every_rank_gets_the_same_bits(name: str, size: int) -> None:
    g = torch.Generator().manual_seed(size)
    inputs = [
        (torch.randperm(N, generator=g)[:30], torch.randn(30, generator=g)) for _ in range(size)
    ]
    results = run(size, inputs, N, name, topology=node_layout(size))
    first = results[0][0].dense()
    assert all(torch.equal(res.dense(), first) for res, _, _ in results)
    assert torch.allclose(first, dense_sum(inputs, N), atol=1e-5)


@pytest.mark.parametrize("size", (4, 6, 8))
def test_topo_sparse_on_nodes_including_uneven(size: int) -> None:
    layouts = [
        Topology(tuple(r // 2 for r in range(size))),
        Topology(tuple(r % 2 for r in range(size))),
    ]
    layouts.append(Topology((0,) * (size - 1) + (1,)))  # uneven nodes: a flat sparse ring
    inputs = supports("overlapping", size, N, seed=11)
    for topology in layouts:
        for result, _, _ in run(size, inputs, N, "topo_sparse", topology=topology):
            assert torch.equal(result.dense(), dense_sum(inputs, N))


def test_dense_switch_at_fill_in() -> None:
    """30 of 97 entries on each of 4 ranks: the sum is ~75% dense; dsar and topo_sparse turn
    dense (sending at most the dense blocks), ssar stays sparse and sends more."""
    inputs = supports("overlapping", 4, N, seed=5)
    sent = {}
    for name in ("dsar", "ssar_split_allgather", "topo_sparse"):
        results = run(4, inputs, N, name)
        assert torch.equal(results[0][0].dense(), dense_sum(inputs, N))
        dense = name != "ssar_split_allgather"
        assert all((res.indices is None) == dense for res, _, _ in results), name

    def bytes_of(name: str) -> int:
        return max(sent for _, _, sent in run(4, inputs, N, name))

    sent = {name: bytes_of(name) for name in ("dsar", "ssar_split_allgather")}
    assert sent["dsar"] < sent["ssar_split_allgather"]
    blocks_each = -(-N // 4)
    assert sent["dsar"] <= 3 * 4 * blocks_each + 3 * 8 * 30  # dense allgather + own entries


def gtopk_reference(inputs: Inputs, k: int) -> tuple[dict[int, float], list[dict[int, float]]]:
    """gtopk by its definition on dicts: recursive doubling (extra ranks folded in without
    selection), each exchange keeps the k largest |value|; a rank's contribution at i is lost
    once i is dropped from a vector carrying it."""
    size = len(inputs)
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    own = [{int(i): float(v) for i, v in zip(idx, val)} for idx, val in inputs]
    real = [2 * v + 1 if v < rem else v + rem for v in range(p2)]
    vec = {v: dict(own[real[v]]) for v in range(p2)}
    members = {v: [real[v]] for v in range(p2)}
    for v in range(rem):
        for i, x in own[real[v] - 1].items():
            vec[v][i] = vec[v].get(i, 0.0) + x
        members[v].append(real[v] - 1)
    lost: list[set[int]] = [set() for _ in range(size)]
    mask = 1
    while mask < p2:
        merged = {}
        for v in range(p2):
            both = dict(vec[v])
            for i, x in vec[v ^ mask].items():
                both[i] = both.get(i, 0.0) + x
            keep = set(sorted(both, key=lambda i: -abs(both[i]))[:k])
            for r in members[v]:
                lost[r] |= set(both) - keep
            merged[v] = {i: x for i, x in both.items() if i in keep}
        members = {v: members[v] + members[v ^ mask] for v in range(p2)}
        vec, mask = merged, mask << 1
    dropped = [{i: x for i, x in own[r].items() if i in lost[r]} for r in range(size)]
    return vec[0], dropped


@pytest.mark.parametrize("size", range(1, 9))
def test_gtopk_follows_its_definition(size: int) -> None:
    """Values are distinct powers of two, so every sum is distinct and top-k has no ties."""
    n, k = 64, 4
    g = torch.Generator().manual_seed(size)
    powers = (2.0 ** torch.randperm(4 * size, generator=g)).double()
    inputs = [(torch.randperm(n, generator=g)[:4], powers[4 * r : 4 * r + 4]) for r in range(size)]
    expect, expect_dropped = gtopk_reference(inputs, k)
    results = run(size, inputs, n, "gtopk", k=k)
    for r, (result, dropped, _) in enumerate(results):
        assert result.indices is not None and result.nnz <= k
        got = dict(zip(result.indices.tolist(), result.values.tolist()))
        assert got == expect, f"rank {r}"
        assert dropped is not None and dropped.indices is not None
        assert dict(zip(dropped.indices.tolist(), dropped.values.tolist())) == expect_dropped[r]


@pytest.mark.parametrize("size", range(2, 9))  # one rank: nothing reduced, nothing selected
def test_gtopk_result_plus_dropped_is_the_sum(size: int) -> None:
    for kind in KINDS:
        inputs = supports(kind, size, N, seed=3 * size)
        k = 7
        results = run(size, inputs, N, "gtopk", k=k)
        total = results[0][0].dense().clone()
        for result, dropped, _ in results:
            assert torch.equal(result.dense(), results[0][0].dense())
            assert result.nnz <= max(k, 0) or result.indices is None
            assert dropped is not None
            total += dropped.dense()
        assert torch.equal(total, dense_sum(inputs, N)), kind


def test_cost_model_sees_fill_in() -> None:
    n = 25_000_000
    low = {name: cost.predict(name, 4, n, n // 1000) for name in EXACT}
    high = {name: cost.predict(name, 8, n, n // 10) for name in EXACT}
    assert low["allgather"].bytes_sent == pytest.approx(3 * (n // 1000) * 8)
    # at 10% on 8 ranks the sum is 57% dense: static SSAR sends more than DSAR's dense blocks
    assert high["ssar_split_allgather"].bytes_sent > high["dsar"].bytes_sent
    assert high["allgather"].bytes_sent > high["dsar"].bytes_sent
    assert cost.choose(4, n, n // 1000) in EXACT
    with pytest.raises(ValueError, match="no cost model"):
        cost.predict("ring", 4, n, 10)


def test_cost_model_counts_the_ranks_sharing_a_node_link() -> None:
    """16 ranks, 4 per node: DSAR's and the allgather's streams from the 4 GPUs of a node to
    the other nodes all leave through the node's one link. One rank per node (no topology)
    keeps every rank's own link, as before."""
    n, nnz = 1 << 24, (1 << 24) // 100
    rates = cost.Rates(1e-6, 1 / 12.5e9, 0.0, 0.0)
    nodes = Topology(tuple(r // 4 for r in range(16)))
    for name in ("dsar", "ssar_split_allgather", "allgather"):
        alone = cost.predict(name, 16, n, nnz, None, rates=rates)
        shared = cost.predict(name, 16, n, nnz, nodes, rates=rates)
        # of a rank's 15 peers 12 are on other nodes: its node link carries 4 x 12 streams
        assert shared.seconds > 2.5 * alone.seconds
        assert shared.bytes_sent == alone.bytes_sent  # what one rank sends does not change
    # the allgather by recursive doubling: 3 lists inside the node, then 4 x 12 across
    pair = 8 * nnz * rates.beta_s_per_byte
    allgather = cost.predict("allgather", 16, n, nnz, nodes, rates=rates).seconds
    assert allgather == pytest.approx(4 * rates.alpha_s + (3 + 4 * 12) * pair, rel=1e-9)
    # one node, or nodes of one rank: nothing shared
    one = cost.predict("dsar", 4, n, nnz, Topology((0, 0, 0, 0)), rates=rates)
    assert one.seconds == cost.predict("dsar", 4, n, nnz, None, rates=rates).seconds


def test_prepare_sorts_and_sums_repeats() -> None:
    idx, val = prepare(torch.tensor([5, 1, 5, 3]), torch.tensor([1.0, 2.0, 3.0, 4.0]), 6)
    assert idx.dtype == torch.int32
    assert idx.tolist() == [1, 3, 5] and val.tolist() == [2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match=r"must be in \[0, 6\)"):
        prepare(torch.tensor([6]), torch.tensor([1.0]), 6)
    with pytest.raises(ValueError, match="2 indices for 1 values"):
        prepare(torch.tensor([0, 1]), torch.tensor([1.0]), 6)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown sparse allreduce algorithm 'ring'"):
        sparse.check_name("ring")


@pytest.mark.parametrize("size", range(1, 9))
def test_sparse_schedules_are_valid_dense_schedules(size: int) -> None:
    """The schedules are data: run densely by simulate() (no communication), each one sums."""
    from schedule_check import simulate

    from commlayer.common.reduce_ops import ReduceOp

    g = torch.Generator().manual_seed(size)
    dense = [torch.randint(-9, 10, (N,), generator=g).float() for _ in range(size)]
    topology = node_layout(size)
    for name in sorted(set(sparse.available()) - {sparse.AUTO, *sparse.NATIVE}):
        schedules = [sparse.schedule(name, r, size, N, topology) for r in range(size)]
        for out in simulate(schedules, dense, ReduceOp.Sum):
            assert torch.equal(out, torch.stack(dense).sum(0)), name


@pytest.mark.parametrize("size", range(1, 9))
def test_rounds_pair_every_stream_with_its_receive(size: int) -> None:
    """Through the engine each round is one alltoall: a stream and its receive must share a
    round, and a rank's steps keep their order."""
    from collections import defaultdict

    from commlayer.algorithms.sparse.executor import with_residual_step
    from commlayer.comm.sparse_reduction import rounds

    for name in ("ssar_recursive_doubling", "gtopk", "topo_sparse"):
        at = rounds(name, size, N)
        policy = sparse.policy(name)
        sent: dict[tuple[int, int], list[int]] = defaultdict(list)
        got: dict[tuple[int, int], list[int]] = defaultdict(list)
        for r in range(size):
            steps = with_residual_step(sparse.schedule(name, r, size, N), policy, N)
            assert len(at[r]) == len(steps)
            assert list(at[r]) == sorted(set(at[r])), f"{name}: rank {r} steps out of order"
            for i, step in enumerate(steps):
                for t in step.sends:
                    sent[r, t.peer].append(at[r][i])
                for t in step.recvs:
                    got[t.peer, r].append(at[r][i])
        assert sent == got, name


def test_add_dropped_goes_into_the_residual() -> None:
    from commlayer import compression

    ef = compression.create("topk:ratio=0.25")
    x = torch.tensor([[4.0, -1.0], [0.5, 2.0]])
    ef.compress(x, "g")
    before = ef.residuals["g"].clone()
    ef.add_dropped("g", torch.tensor([0, 3], dtype=torch.int32), torch.tensor([4.0, 2.0]))
    assert torch.equal(ef.residuals["g"], before + torch.tensor([[4.0, 0.0], [0.0, 2.0]]))
    with pytest.raises(ValueError, match="add_dropped\\('h'\\): nothing was compressed"):
        ef.add_dropped("h", torch.tensor([0]), torch.tensor([1.0]))
