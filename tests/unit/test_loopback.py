"""Loopback backend: every operation at 1-5 ranks against a reference computed locally."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from commlayer.backends.loopback import LoopbackBackend, LoopbackRequest, LoopbackWorld, run_ranks
from commlayer.common.errors import ShutdownError
from commlayer.common.reduce_ops import Average, Max, Min, Product, ReduceOp, Sum

SIZES = [1, 2, 3, 4, 5]
DTYPES = [
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.bfloat16,
]
OPS = [Sum, Min, Max, Product]
T = TypeVar("T")
REFERENCE_OPS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    Sum: torch.add,
    Min: torch.minimum,
    Max: torch.maximum,
    Product: torch.mul,
}


def data(rank: int, numel: int, dtype: torch.dtype, op: ReduceOp = Sum) -> torch.Tensor:
    """Rank-specific values; products stay small so no dtype overflows (3**5 < 256)."""
    g = torch.Generator().manual_seed(7919 * rank + numel)
    if dtype.is_floating_point:
        x = (
            torch.rand(numel, generator=g) + 0.5
            if op == Product
            else torch.randn(numel, generator=g)
        )
        return x.to(dtype)
    low, high = (1, 4) if op == Product else (0 if dtype == torch.uint8 else -50, 50)
    return torch.randint(low, high, (numel,), generator=g, dtype=dtype)


def reference(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduction in rank order, as the backend promises."""
    acc = tensors[0]
    for t in tensors[1:]:
        acc = REFERENCE_OPS[op](acc, t)
    return acc


def uneven(size: int) -> list[int]:
    """Uneven element counts with a zero from 2 ranks on: 2, 0, 3, 1, 4."""
    return [(3 * r + 2) % 5 for r in range(size)]


def done(req: LoopbackRequest) -> None:
    assert req.wait(timeout_s=5.0), "request did not complete"


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_allreduce(size: int, dtype: torch.dtype, op: ReduceOp) -> None:
    def fn(b: LoopbackBackend) -> torch.Tensor:
        recv = torch.empty(13, dtype=dtype)
        if b.rank % 2:  # odd ranks reduce in place, even ranks from a separate send buffer
            recv.copy_(data(b.rank, 13, dtype, op))
            done(b.iallreduce(None, recv, op))
        else:
            done(b.iallreduce(data(b.rank, 13, dtype, op), recv, op))
        return recv

    results = run_ranks(size, fn)
    expected = reference([data(r, 13, dtype, op) for r in range(size)], op)
    for out in results:
        assert torch.equal(out, expected)  # bitwise identical on every rank


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter(size: int, dtype: torch.dtype, op: ReduceOp) -> None:
    counts = uneven(size)

    def fn(b: LoopbackBackend) -> torch.Tensor:
        recv = torch.empty(counts[b.rank], dtype=dtype)
        done(b.ireduce_scatter(data(b.rank, sum(counts), dtype, op), recv, counts, op))
        return recv

    expected = reference([data(r, sum(counts), dtype, op) for r in range(size)], op)
    for out, block in zip(run_ranks(size, fn), expected.split(counts)):
        assert torch.equal(out, block)


def test_average_reduces_as_sum() -> None:
    def fn(b: LoopbackBackend) -> torch.Tensor:
        recv = torch.full((4,), float(b.rank + 1))
        done(b.iallreduce(None, recv, Average))
        return recv

    assert all(torch.equal(out, torch.full((4,), 6.0)) for out in run_ranks(3, fn))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_allgatherv(size: int, dtype: torch.dtype) -> None:
    counts = uneven(size)

    def fn(b: LoopbackBackend) -> torch.Tensor:
        recv = torch.empty(sum(counts), dtype=dtype)
        done(b.iallgatherv(data(b.rank, counts[b.rank], dtype), recv, counts))
        return recv

    expected = torch.cat([data(r, counts[r], dtype) for r in range(size)])
    assert all(torch.equal(out, expected) for out in run_ranks(size, fn))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_bcast_from_every_root(size: int, dtype: torch.dtype) -> None:
    def fn(b: LoopbackBackend) -> list[torch.Tensor]:
        bufs = [data(b.rank, 9, dtype) for _ in range(size)]
        reqs = [b.ibcast(buf, root) for root, buf in enumerate(bufs)]  # all in flight at once
        for req in reqs:
            done(req)
        return bufs

    for bufs in run_ranks(size, fn):
        for root, buf in enumerate(bufs):
            assert torch.equal(buf, data(root, 9, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_alltoallv_uneven_with_zeros(size: int, dtype: torch.dtype) -> None:
    def count(src: int, dst: int) -> int:
        return (src + 2 * dst) % 3  # 0, 1 or 2 elements

    def fn(b: LoopbackBackend) -> torch.Tensor:
        send_counts = [count(b.rank, q) for q in range(size)]
        recv_counts = [count(q, b.rank) for q in range(size)]
        recv = torch.empty(sum(recv_counts), dtype=dtype)
        send = data(b.rank, sum(send_counts), dtype)
        done(b.ialltoallv(send, send_counts, recv, recv_counts))
        return recv

    blocks = [data(r, sum(count(r, q) for q in range(size)), dtype) for r in range(size)]
    blocks_by_dst = [b.split([count(r, q) for q in range(size)]) for r, b in enumerate(blocks)]
    for q, out in enumerate(run_ranks(size, fn)):
        assert torch.equal(out, torch.cat([blocks_by_dst[r][q] for r in range(size)]))


@pytest.mark.parametrize("size", SIZES)
def test_barrier_completes_only_when_all_entered(size: int) -> None:
    world = LoopbackWorld(size)
    reqs = [world.backend(r).ibarrier() for r in range(size - 1)]
    assert not any(req.test() for req in reqs)
    reqs.append(world.backend(size - 1).ibarrier())
    assert all(req.test() for req in reqs)


@pytest.mark.parametrize("size", SIZES)
def test_control_is_bitwise_and(size: int) -> None:
    rng = np.random.default_rng(size)
    words = [rng.integers(0, 2**64, size=3, dtype=np.uint64) for _ in range(size)]

    def fn(b: LoopbackBackend) -> np.ndarray:
        mine = words[b.rank].copy()
        done(b.icontrol(mine))
        return mine

    expected = functools.reduce(np.bitwise_and, words)
    assert all(np.array_equal(out, expected) for out in run_ranks(size, fn))


@pytest.mark.parametrize("size", SIZES)
def test_allgather_bytes(size: int) -> None:
    world = LoopbackWorld(size)
    posted = [world.backend(r).iallgather_bytes(b"r%d" % r * r) for r in range(size)]
    expected = [b"r%d" % r * r for r in range(size)]
    assert all(req.test() and out == expected for req, out in posted)


def test_allgather_bytes_list_filled_only_at_completion() -> None:
    world = LoopbackWorld(2)
    req, out = world.backend(0).iallgather_bytes(b"a")
    assert not req.test() and out == []
    world.backend(1).iallgather_bytes(b"bc")
    assert req.test() and out == [b"a", b"bc"]


def test_many_collectives_in_flight_match_by_sequence() -> None:
    def fn(b: LoopbackBackend) -> list[torch.Tensor]:
        bufs = [torch.full((3,), float(b.rank * i)) for i in range(20)]
        reqs = [b.iallreduce(None, buf, Sum) for buf in bufs]
        for req in reversed(reqs):
            done(req)
        return bufs

    for bufs in run_ranks(4, fn):
        assert [buf[0].item() for buf in bufs] == [6.0 * i for i in range(20)]


def test_split_into_subgroups() -> None:
    def fn(b: LoopbackBackend) -> tuple[int, int, list[int], float, int | None]:
        evens, odds = b.split([0, 2, 4]), b.split([1, 3])
        sub = evens if b.rank % 2 == 0 else odds
        assert sub is not None and (evens is None) == (b.rank % 2 == 1)
        buf = torch.tensor([float(b.rank)])
        done(sub.iallreduce(None, buf, Sum))
        nested = sub.split([sub.size - 1])  # the last rank of each subgroup alone
        return sub.rank, sub.size, sub.nodes(), buf.item(), nested.size if nested else None

    out = run_ranks(5, fn, nodes=[0, 0, 1, 1, 2])
    assert [o[:2] for o in out] == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    assert [o[2] for o in out] == [[0, 1, 2], [0, 1], [0, 1, 2], [0, 1], [0, 1, 2]]
    assert [o[3] for o in out] == [6.0, 4.0, 6.0, 4.0, 6.0]
    assert [o[4] for o in out] == [None, None, None, 1, 1]


def test_nodes_numbered_by_lowest_rank() -> None:
    assert run_ranks(2, lambda b: b.nodes()) == [[0, 0], [0, 0]]
    world = LoopbackWorld(4, nodes=[5, 5, 2, 2])
    assert world.backend(3).nodes() == [0, 0, 1, 1]


def test_mismatched_kinds_raise_on_every_rank() -> None:
    world = LoopbackWorld(2)
    req = world.backend(0).iallreduce(None, torch.zeros(2), Sum)
    with pytest.raises(RuntimeError, match="rank 0 called iallreduce but rank 1 called ibcast"):
        world.backend(1).ibcast(torch.zeros(2), 0)
    with pytest.raises(RuntimeError, match="mismatch"):
        req.test()


def test_mismatched_kinds_raise_through_run_ranks() -> None:
    def fn(b: LoopbackBackend) -> None:
        done(b.ibarrier() if b.rank == 0 else b.icontrol(np.zeros(1, dtype=np.uint64)))

    with pytest.raises(RuntimeError, match="called ibarrier but rank 1 called icontrol"):
        run_ranks(2, fn)


@pytest.mark.parametrize(
    "other",
    [
        lambda b: b.iallreduce(None, torch.zeros(2, dtype=torch.float64), Sum),  # dtype
        lambda b: b.iallreduce(None, torch.zeros(2), Max),  # op
        lambda b: b.iallreduce(None, torch.zeros(3), Sum),  # count
    ],
    ids=["dtype", "op", "count"],
)
def test_mismatched_signature_raises(other: Callable[[LoopbackBackend], object]) -> None:
    world = LoopbackWorld(2)
    world.backend(0).iallreduce(None, torch.zeros(2), Sum)
    with pytest.raises(RuntimeError, match="iallreduce: rank 0 passed"):
        other(world.backend(1))


def test_alltoallv_counts_must_agree_across_ranks() -> None:
    world = LoopbackWorld(2)
    req = world.backend(0).ialltoallv(torch.zeros(2), [1, 1], torch.zeros(2), [1, 1])
    with pytest.raises(RuntimeError, match="rank 1 sends 2 elements to rank 0, which expects 1"):
        world.backend(1).ialltoallv(torch.zeros(2), [2, 0], torch.zeros(2), [1, 1])
    with pytest.raises(RuntimeError):
        req.test()


def test_bad_counts_raise_value_error_naming_rank() -> None:
    b = LoopbackWorld(3).backend(1)
    with pytest.raises(ValueError, match=r"rank 1: send has 4 elements, expected 2"):
        b.iallgatherv(torch.zeros(4), torch.zeros(6), [2, 2, 2])
    with pytest.raises(ValueError, match=r"rank 1: counts \(2, 2\) must be 3"):
        b.ireduce_scatter(torch.zeros(4), torch.zeros(2), [2, 2], Sum)
    with pytest.raises(ValueError, match="rank 1: send has 2 elements, expected 3"):
        b.iallreduce(torch.zeros(2), torch.zeros(3), Sum)
    with pytest.raises(ValueError, match="rank 1: split ranks"):
        b.split([2, 0])


def test_kill_reports_dead_peer_and_blocks_its_collectives() -> None:
    world = LoopbackWorld(3)
    sub = run_ranks_on(world, lambda b: b.split([1, 2]))
    world.kill(2)
    reqs = [world.backend(r).ibarrier() for r in (0, 1)]
    assert not any(req.test() for req in reqs)
    assert not reqs[0].wait(timeout_s=0.01)
    assert [world.backend(r).dead_peers() for r in range(3)] == [[2]] * 3
    assert sub[1] is not None and sub[1].dead_peers() == [1]
    with pytest.raises(ShutdownError, match="rank 2 was killed"):
        world.backend(2).ibarrier()


def run_ranks_on(world: LoopbackWorld, fn: Callable[[LoopbackBackend], T]) -> list[T]:
    """fn on every rank of an existing world, one thread per rank (split blocks)."""
    results: list[Any] = [None] * world.size

    def main(r: int) -> None:
        results[r] = fn(world.backend(r))

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    return results


def test_run_ranks_returns_results_in_rank_order() -> None:
    assert run_ranks(4, lambda b: (b.rank, b.size)) == [(r, 4) for r in range(4)]


def test_run_ranks_reraises_first_error_with_rank() -> None:
    def fn(b: LoopbackBackend) -> None:
        if b.rank == 2:
            raise ValueError("boom")
        done(b.ibarrier())  # the others are released by the abort, not left hanging

    with pytest.raises(ValueError, match="rank 2: boom"):
        run_ranks(3, fn)


def test_run_ranks_timeout_names_running_ranks() -> None:
    def fn(b: LoopbackBackend) -> None:
        if b.rank == 1:
            b.split([0, 1])  # rank 0 never joins

    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 still running"):
        run_ranks(2, fn, timeout_s=0.2)
