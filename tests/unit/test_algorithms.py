"""Allreduce schedules (issue #5): correctness at 1-16 ranks without communication (every rank's
schedule run together by ``simulate``), textbook step and traffic counts, the executor over
the loopback backend, and algorithm selection through the configuration."""

from __future__ import annotations

import importlib
import math
import time
from typing import Any

import pytest
import torch
from engine_harness import allreduce, run_engines, wait
from schedule_check import simulate, traffic
from waiting import Deadline, wait_until

from commlayer import algorithms
from commlayer.algorithms.schedule import Step, Transfer, blocks
from commlayer.backends.loopback import LoopbackBackend, run_ranks
from commlayer.common import config
from commlayer.common import topology as topology_module
from commlayer.common.errors import ConfigError
from commlayer.common.reduce_ops import ReduceOp, reduce_into
from commlayer.common.topology import Topology
from commlayer.core.engine import Engine
from commlayer.core.selection import Allreducer

# the module (``algorithms.schedule`` is the function of the same name)
schedule_module = importlib.import_module("commlayer.algorithms.schedule")

SCHEDULES = [
    "hierarchical",
    "rabenseifner",
    "recursive_doubling",
    "ring",
    "shd",
    "swing",
    "torus2d",
    "tree",
]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 13, 16]
OPS = [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]


def inputs(size: int, numel: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Small integers per rank: every op over 16 ranks is exact in every dtype."""
    out = []
    for rank in range(size):
        g = torch.Generator().manual_seed(1000 * seed + rank)
        if dtype == torch.bool:
            out.append(torch.randint(0, 2, (numel,), generator=g).bool())
        else:
            low = 0 if dtype == torch.uint8 or size > 4 else -1
            out.append(torch.randint(low, 2, (numel,), generator=g).to(dtype))
    return out


def reference(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        reduce_into(acc, t, op)
    return acc


def run_all(
    name: str,
    size: int,
    tensors: list[torch.Tensor],
    op: ReduceOp,
    topology: Topology | None = None,
) -> list[torch.Tensor]:
    numel = tensors[0].numel()
    schedules = [algorithms.schedule(name, r, size, numel, topology) for r in range(size)]
    return simulate(schedules, tensors, op)


def topologies(size: int) -> list[Topology]:
    """One node; every uniform node-major layout; a scattered (often uneven) one; a torus."""
    found = [Topology.flat(size)]
    found += [
        Topology(tuple(r // local for r in range(size)))
        for local in range(1, size)
        if size % local == 0
    ]
    found.append(Topology(tuple(r % 3 for r in range(size))))
    rows = max(d for d in range(1, size + 1) if size % d == 0 and d * d <= size)
    found.append(Topology((0,) * size, (rows, size // rows)))
    return found


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("size", SIZES)
def test_every_size_buffer_length_and_topology(name: str, size: int) -> None:
    for topology in topologies(size):
        for numel in sorted({0, 1, max(size - 1, 0), size, size + 1, 1000}):
            tensors = inputs(size, numel, torch.int64, seed=numel)
            expected = reference(tensors, ReduceOp.Sum)
            results = run_all(name, size, tensors, ReduceOp.Sum, topology)
            for rank, result in enumerate(results):
                assert torch.equal(result, expected), f"{name} n={numel} rank {rank} {topology}"


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
    ids=str,
)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_dtype_and_op_at_five_ranks(name: str, dtype: torch.dtype, op: ReduceOp) -> None:
    tensors = inputs(5, 37, dtype, seed=3)
    expected = reference(tensors, op)
    for result in run_all(name, 5, tensors, op):
        assert torch.equal(result, expected)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("size", [3, 4, 6])
def test_floats_are_bitwise_identical_on_every_rank(name: str, size: int) -> None:
    g = torch.Generator().manual_seed(size)
    tensors = [torch.randn(1001, generator=g) for _ in range(size)]
    results = run_all(name, size, tensors, ReduceOp.Sum)
    for result in results[1:]:
        assert torch.equal(result, results[0])  # the same bits, not merely close
    torch.testing.assert_close(results[0], torch.stack(tensors).sum(0), rtol=1e-5, atol=1e-5)


def test_one_million_and_three_elements() -> None:
    for name in SCHEDULES:
        tensors = inputs(3, (1 << 20) + 3, torch.int32, seed=7)
        expected = reference(tensors, ReduceOp.Sum)
        for result in run_all(name, 3, tensors, ReduceOp.Sum):
            assert torch.equal(result, expected), name


# -- textbook counts ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 16])
def test_ring_steps_and_traffic(size: int) -> None:
    n = size * 96
    for rank in range(size):
        schedule = algorithms.schedule("ring", rank, size, n)
        assert len(schedule) == 2 * (size - 1)
        assert traffic(schedule) == (2 * (size - 1) * n // size,) * 2


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_power_of_two_step_counts_and_traffic(size: int) -> None:
    n, log = size * 64, int(math.log2(size))
    for rank in range(size):
        rd = algorithms.schedule("recursive_doubling", rank, size, n)
        assert len(rd) == log and traffic(rd) == (log * n, log * n)
        rab = algorithms.schedule("rabenseifner", rank, size, n)
        assert len(rab) == 2 * log and traffic(rab) == (2 * (size - 1) * n // size,) * 2
    root = algorithms.schedule("tree", 0, size, n)
    assert len(root) == 2 * log and traffic(root) == (log * n, log * n)


@pytest.mark.parametrize("size", [3, 5, 6, 7])
def test_non_power_of_two_folds_the_extra_ranks(size: int) -> None:
    p2 = 1 << (size.bit_length() - 1)
    extra = size - p2
    for name in ("recursive_doubling", "rabenseifner"):
        folded = algorithms.schedule(name, 0, size, 64)  # rank 0 < 2*extra is folded in
        assert [len(s.sends) + len(s.recvs) for s in folded] == [1, 1]
        assert folded[0].sends == (Transfer(1, 0, 64),) and not folded[1].reduce
        kept = algorithms.schedule(name, 2 * extra, size, 64)  # a rank that is not folded
        assert len(kept) == int(math.log2(p2)) * (1 if name == "recursive_doubling" else 2)


def test_hierarchical_sends_only_a_block_per_rank_between_nodes() -> None:
    # 2 nodes x 4 ranks, 800 elements: the ring inside a node moves 2 * 3/4 * 800 per rank,
    # between nodes each rank sends its 200-element block once each way (ring of 2).
    topology = Topology(tuple(r // 4 for r in range(8)))
    for rank in range(8):
        schedule = algorithms.schedule("hierarchical", rank, 8, 800, topology)
        across = sum(
            t.numel
            for s in schedule
            for t in s.sends
            if topology.node_of[t.peer] != topology.node_of[rank]
        )
        assert across == 2 * (2 - 1) * 200 // 2
        assert traffic(schedule)[0] == 2 * 3 * 200 + across


def test_shd_exchanges_the_big_halves_inside_the_node() -> None:
    # 2 nodes x 2 ranks: SHD's first step (n/2) stays in the node, its network step carries
    # n/4; Rabenseifner's order sends n/2 over the network first.
    topology = Topology((0, 0, 1, 1))
    shd = algorithms.schedule("shd", 0, 4, 1000, topology)
    rab = algorithms.schedule("rabenseifner", 0, 4, 1000, topology)
    assert [(s.sends[0].peer, s.sends[0].numel) for s in shd[:2]] == [(1, 500), (2, 250)]
    assert [(s.sends[0].peer, s.sends[0].numel) for s in rab[:2]] == [(2, 500), (1, 250)]


def test_shd_orders_positions_node_by_node() -> None:
    # Ranks interleaved over 2 nodes (0 2 on node 0, 1 3 on node 1): the first partner is
    # still on the same node.
    topology = Topology((0, 1, 0, 1))
    assert topology.positions() == [0, 2, 1, 3]
    assert algorithms.schedule("shd", 0, 4, 1000, topology)[0].sends[0].peer == 2


def test_swing_partners_swing_back_and_forth() -> None:
    from commlayer.algorithms.swing import peer, rho

    assert [rho(s) for s in range(5)] == [1, -1, 3, -5, 11]
    assert [peer(0, s, 16) for s in range(4)] == [1, 15, 3, 11]
    assert [peer(1, s, 16) for s in range(4)] == [0, 2, 14, 6]


def test_torus2d_reduces_along_rows_then_columns() -> None:
    topology = Topology((0,) * 6, (2, 3))  # rows {0,1,2} {3,4,5}
    schedule = algorithms.schedule("torus2d", 4, 6, 600, topology)
    peers = [s.sends[0].peer for s in schedule]
    assert peers[:2] == [5, 5] and peers[2] == 1 and peers[-2:] == [5, 5]


@pytest.mark.parametrize(
    ("text", "size", "node_of", "torus"),
    [
        ("nodes=2,local=2", 4, (0, 0, 1, 1), None),
        ("local=3", 6, (0, 0, 0, 1, 1, 1), None),
        ("nodes=3", 3, (0, 1, 2), None),
        ("torus=2x3", 6, (0,) * 6, (2, 3)),
        (" nodes = 2 , local = 1 , torus = 1x2 ", 2, (0, 1), (1, 2)),
    ],
)
def test_topology_override(
    text: str, size: int, node_of: tuple[int, ...], torus: tuple[int, int] | None
) -> None:
    built = topology_module.build(text, size, [0] * size)
    assert built.node_of == node_of and built.torus == torus


@pytest.mark.parametrize(
    ("text", "size", "message"),
    [
        ("nodes=3,local=2", 4, "nodes=3 x local=2 is not the job's 4 ranks"),
        ("torus=2x2", 6, "torus=2x2 is not the job's 6 ranks"),
    ],
)
def test_topology_that_does_not_fit_the_job(text: str, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        topology_module.build(text, size, [0] * size)


def test_engine_refuses_a_topology_that_does_not_fit() -> None:
    def main(backend: LoopbackBackend) -> None:
        with pytest.raises(ConfigError, match="rank .*COMMLAYER_TOPOLOGY='nodes=3'"):
            Engine(backend, config.load(environ={}, topology="nodes=3"))

    run_ranks(2, main)


# -- chunked ring steps ----------------------------------------------------------------------------
@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(schedule_module, "RING_CHUNK_ELEMENTS", 7)
    return 7


@pytest.mark.parametrize("name", ["ring", "hierarchical", "torus2d"])
@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_chunked_ring_steps_are_correct_and_keep_the_textbook_counts(
    name: str, size: int, small_chunks: int
) -> None:
    topology = Topology(tuple(r // 2 for r in range(size))) if size % 2 == 0 else None
    for numel in (0, 1, size - 1, 100, 1001):
        tensors = inputs(size, numel, torch.int64, seed=numel)
        expected = reference(tensors, ReduceOp.Sum)
        for rank, result in enumerate(run_all(name, size, tensors, ReduceOp.Sum, topology)):
            assert torch.equal(result, expected), f"{name} n={numel} rank {rank}"
    n = size * 96  # 96-element blocks: 14 pieces of 6-7 elements each way per step
    for rank in range(size):
        schedule = algorithms.schedule("ring", rank, size, n)
        assert len(schedule) == 2 * (size - 1)
        assert traffic(schedule) == (2 * (size - 1) * n // size,) * 2
        for s in schedule:
            assert len(s.sends) == len(s.recvs) == 14 and s.early
            assert max(t.numel for t in s.sends + s.recvs) <= small_chunks


def test_unchunked_below_the_chunk_size() -> None:
    schedule = algorithms.schedule("ring", 0, 2, 2 * schedule_module.RING_CHUNK_ELEMENTS)
    assert all(len(s.sends) == len(s.recvs) == 1 for s in schedule)
    schedule = algorithms.schedule("ring", 0, 2, 2 * schedule_module.RING_CHUNK_ELEMENTS + 2)
    assert all(len(s.sends) == len(s.recvs) == 2 for s in schedule)


def test_a_step_whose_sends_overlap_its_receives_is_not_applied_early() -> None:
    assert Step(sends=(Transfer(1, 0, 4),), recvs=(Transfer(1, 4, 8),)).early
    assert not Step(sends=(Transfer(1, 0, 8),), recvs=(Transfer(1, 4, 8),)).early
    assert not algorithms.schedule("recursive_doubling", 0, 4, 100)[0].early  # full buffer


class _Held:
    """A loopback request that reports completion only once released (order of arrival)."""

    def __init__(self, inner: Any, gate: list[bool]) -> None:
        self.inner, self.gate = inner, gate

    def test(self) -> bool:
        return self.gate[0] and self.inner.test()


class _HoldingBackend:
    """Point-to-point calls of a loopback backend; every receive but the first is held (and
    every send, with ``sends``) until the gate opens."""

    def __init__(self, backend: LoopbackBackend, gate: list[bool], sends: bool = False) -> None:
        self.backend, self.gate, self.count, self.sends = backend, gate, 0, sends

    def isend(self, buf: torch.Tensor, peer: int) -> Any:
        request = self.backend.isend(buf, peer)
        return _Held(request, self.gate) if self.sends else request

    def irecv(self, buf: torch.Tensor, peer: int) -> Any:
        self.count += 1
        request = self.backend.irecv(buf, peer)
        return request if self.count == 1 else _Held(request, self.gate)


def test_executor_reduces_the_first_piece_before_the_others_arrive(small_chunks: int) -> None:
    """Rank 0's receives are held back except the first: after test() the first piece of the
    step is already reduced into the buffer while the step is still in flight."""
    from commlayer.algorithms.executor import BufferPool, ScheduleRequest

    def main(backend: LoopbackBackend) -> tuple[bool, bool, torch.Tensor]:
        buf = torch.full((28,), float(backend.rank + 1))
        schedule = algorithms.schedule("ring", backend.rank, 2, 28)  # 2 pieces of 7 per step
        gate = [backend.rank != 0]
        held = _HoldingBackend(backend, gate)
        request = ScheduleRequest(held, schedule, buf, ReduceOp.Sum, BufferPool())  # type: ignore[arg-type]
        start, stop = schedule[0].recvs[0].start, schedule[0].recvs[0].stop
        # past 5 s the gate opens anyway: a first piece never seen fails the check, not a hang
        give_up = Deadline(5.0)
        first_piece = False

        def done() -> bool:
            nonlocal first_piece
            if request.test():
                return True
            first_piece = first_piece or bool((buf[start:stop] == 3.0).all())
            gate[0] = gate[0] or first_piece or give_up.passed()
            return False

        wait_until(done, 10.0, f"rank {backend.rank}: the ring did not complete", poll_s=1e-4)
        return backend.rank != 0 or first_piece, True, buf

    for ok, _, buf in run_ranks(2, main):
        assert ok
        assert torch.equal(buf, torch.full((28,), 3.0))


def test_executor_waits_for_the_sends_of_a_step_that_overlap_its_receives() -> None:
    """Recursive doubling sends and receives the whole buffer in one step: a receive that
    arrived is not applied while the send reading the same range is still in flight."""
    from commlayer.algorithms.executor import BufferPool, ScheduleRequest

    def main(backend: LoopbackBackend) -> torch.Tensor:
        buf = torch.full((8,), float(backend.rank + 1))
        schedule = algorithms.schedule("recursive_doubling", backend.rank, 2, 8)
        gate = [backend.rank != 0]
        held = _HoldingBackend(backend, gate, sends=True)
        request = ScheduleRequest(held, schedule, buf, ReduceOp.Sum, BufferPool())  # type: ignore[arg-type]
        for _ in range(50):
            assert not request.test() or backend.rank != 0
            if backend.rank == 0:
                assert torch.equal(buf, torch.full((8,), 1.0)), "applied under a pending send"
            time.sleep(1e-3)
        gate[0] = True
        what = f"rank {backend.rank}: recursive doubling did not complete"
        wait_until(request.test, 10.0, what, poll_s=1e-4)
        return buf

    for buf in run_ranks(2, main):
        assert torch.equal(buf, torch.full((8,), 3.0))


def test_blocks_cover_the_buffer_evenly() -> None:
    assert blocks(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert blocks(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert blocks(0, 3) == [(0, 0)] * 3


# -- the simulator itself catches broken schedules ------------------------------------------------
def test_simulate_names_a_length_mismatch() -> None:
    broken = [[Step(sends=(Transfer(1, 0, 4),))], [Step(recvs=(Transfer(0, 0, 3),))]]
    with pytest.raises(ValueError, match="rank 1: step 0 receives 3 elements from rank 0"):
        simulate(broken, inputs(2, 4, torch.int64), ReduceOp.Sum)


def test_simulate_names_a_deadlock_and_an_unreceived_message() -> None:
    # Both ranks first receive, then send: each waits on the other forever.
    recv_first = [
        [Step(recvs=(Transfer(1 - r, 0, 2),)), Step(sends=(Transfer(1 - r, 0, 2),))]
        for r in range(2)
    ]
    with pytest.raises(ValueError, match="deadlock.*rank 0 at step 0, rank 1 at step 0"):
        simulate(recv_first, inputs(2, 2, torch.int64), ReduceOp.Sum)
    lonely = [[Step(sends=(Transfer(1, 0, 2),))], []]  # a send nobody receives never completes
    with pytest.raises(ValueError, match="deadlock: .* rank 0 at step 0$"):
        simulate(lonely, inputs(2, 2, torch.int64), ReduceOp.Sum)


# -- executor over the loopback backend ------------------------------------------------------------
def _run_request(backend: LoopbackBackend, allreducer: Allreducer, buf: torch.Tensor) -> None:
    request = allreducer(backend, None, buf, ReduceOp.Sum)
    what = f"rank {backend.rank}: allreduce did not complete"
    wait_until(request.test, 10.0, what, poll_s=1e-4)


@pytest.mark.parametrize("name", SCHEDULES + ["native", "mpi"])
@pytest.mark.parametrize("size", [1, 3, 4])
def test_executor_over_loopback(name: str, size: int) -> None:
    per_rank = inputs(size, 1003, torch.float64, seed=size)
    expected = reference(per_rank, ReduceOp.Sum)

    def main(backend: LoopbackBackend) -> torch.Tensor:
        allreducer = Allreducer(name)
        buf = per_rank[backend.rank].clone()
        _run_request(backend, allreducer, buf)
        small = torch.full((2,), float(backend.rank))  # a second call, fewer elements than ranks
        _run_request(backend, allreducer, small)
        assert torch.equal(small, torch.full((2,), float(sum(range(size)))))
        return buf

    for result in run_ranks(size, main):
        assert torch.equal(result, expected)


def test_shm_and_auto_fall_back_to_native_without_a_window() -> None:
    def main(backend: LoopbackBackend) -> list[str]:
        return [Allreducer(name).choose(backend, 1 << 20, 4) for name in ("auto", "shm")]

    for choices in run_ranks(2, main):
        assert choices == ["native", "native"]


def test_engine_runs_fused_buffers_with_the_configured_schedule() -> None:
    def fn(engine: Engine) -> list[torch.Tensor]:
        value = float(engine.rank + 1)
        handles = [
            engine.submit(allreduce(f"t{i}", torch.full((n,), value)))
            for i, n in enumerate([5, 1, 300])
        ]
        engine.start()
        return [wait(h) for h in handles]

    for results in run_engines(3, fn, start=False, allreduce_algorithm="ring"):
        for n, result in zip([5, 1, 300], results, strict=True):
            assert torch.equal(result, torch.full((n,), 6.0))


def test_engine_runs_hierarchical_on_an_overridden_topology() -> None:
    def fn(engine: Engine) -> torch.Tensor:
        assert engine._allreduce.topology(engine._global.backend).node_of == (0, 0, 1, 1)
        return wait(engine.submit(allreduce("t", torch.full((7,), float(engine.rank + 1)))))

    for result in run_engines(4, fn, allreduce_algorithm="hierarchical", topology="local=2"):
        assert torch.equal(result, torch.full((7,), 10.0))


def test_unknown_algorithm_is_refused_with_the_registered_names() -> None:
    with pytest.raises(ConfigError, match="COMMLAYER_ALLREDUCE_ALGORITHM='bogus'.*ring"):
        config.load(environ={"COMMLAYER_ALLREDUCE_ALGORITHM": "bogus"})
    with pytest.raises(ConfigError, match="allreduce_algorithm='nope'"):
        config.load(environ={}, allreduce_algorithm="nope")
    assert (
        config.load(environ={"COMMLAYER_ALLREDUCE_ALGORITHM": " Ring "}).allreduce_algorithm
        == "ring"
    )
    with pytest.raises(ValueError, match="already registered"):
        algorithms.register("ring")(lambda rank, size, numel: [])
