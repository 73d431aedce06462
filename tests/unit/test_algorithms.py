"""Allreduce schedules (issue #5): correctness at 1-16 ranks without communication (every rank's
schedule run together by ``simulate``), textbook step and traffic counts, the executor over
the loopback backend, and algorithm selection through the configuration."""

from __future__ import annotations

import math
import time

import pytest
import torch
from engine_harness import allreduce, run_engines, wait

from commlayer import algorithms, config
from commlayer.algorithms.executor import Allreducer
from commlayer.algorithms.schedule import Step, Transfer, blocks, simulate, traffic
from commlayer.backends.loopback import LoopbackBackend, run_ranks
from commlayer.engine import Engine
from commlayer.errors import ConfigError
from commlayer.reduce_ops import ReduceOp, reduce_into

SCHEDULES = ["rabenseifner", "recursive_doubling", "ring", "tree"]
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


def run_all(name: str, size: int, tensors: list[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
    numel = tensors[0].numel()
    return simulate([algorithms.schedule(name, r, size, numel) for r in range(size)], tensors, op)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("size", SIZES)
def test_every_size_and_buffer_length(name: str, size: int) -> None:
    for numel in sorted({0, 1, max(size - 1, 0), size, size + 1, 1000}):
        tensors = inputs(size, numel, torch.int64, seed=numel)
        expected = reference(tensors, ReduceOp.Sum)
        for rank, result in enumerate(run_all(name, size, tensors, ReduceOp.Sum)):
            assert torch.equal(result, expected), f"{name} p={size} n={numel} rank {rank}"


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
    deadline = time.monotonic() + 10.0
    while not request.test():
        assert time.monotonic() < deadline, f"rank {backend.rank}: allreduce did not complete"
        time.sleep(1e-4)


@pytest.mark.parametrize("name", SCHEDULES + ["mpi"])
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


def test_shm_and_auto_fall_back_to_mpi_without_a_window() -> None:
    def main(backend: LoopbackBackend) -> list[str]:
        return [Allreducer(name).choose(backend, 1 << 20, 4) for name in ("auto", "shm")]

    for choices in run_ranks(2, main):
        assert choices == ["mpi", "mpi"]


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
