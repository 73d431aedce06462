"""Every allreduce algorithm (issue #5) under real MPI, on a communicator of its own, against a
locally computed reference: sizes {0, 1, p-1, 1000, 1M+3} elements, every dtype and op.

The engine runs one configured algorithm; here each is driven directly (``Allreducer``) from the
test thread, on a duplicate of COMM_WORLD, so one session covers them all. Collectives first,
asserts last (see test_allreduce.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from collective_reference import (
    ALL_DTYPES,
    assert_reduced,
    assert_same_on_every_rank,
    dtype_id,
    every_rank_small_ints,
    gather_rows,
    random_floats,
    seed_of,
)
from launch import own_backend
from waiting import wait_until

import commlayer as cl
from commlayer import algorithms
from commlayer.algorithms import autotune
from commlayer.backends.base import Backend
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import runtime
from commlayer.core.selection import Allreducer

NAMES = [n for n in algorithms.available() if n != algorithms.AUTO]
OPS = (cl.Sum, cl.Min, cl.Max, cl.Product)


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    own = own_backend()  # collective: every rank makes it here
    yield own
    own.close()


def run(backend: Backend, name: str, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    return run_with(backend, Allreducer(name), tensor, op)


def run_with(
    backend: Backend, allreducer: Allreducer, tensor: torch.Tensor, op: ReduceOp
) -> torch.Tensor:
    buf = tensor.clone().reshape(-1)
    request = allreducer(backend, None, buf, op)
    what = f"rank {cl.rank()}: {allreducer.algorithm} did not complete"
    wait_until(request.test, 60.0, what)
    return buf.reshape(tensor.shape)


# numel -> (every rank's inputs of that length, a result checked against their reference)
_LENGTHS: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}


@pytest.mark.parametrize("name", NAMES)
def test_every_length(backend: Backend, name: str) -> None:
    # Every algorithm reduces the same inputs of each length, drawn once: the first result is
    # checked against the exact reference, and every later algorithm's must equal it bit for
    # bit (exact integer sums), instead of drawing and summing every rank's 1M elements anew
    # for each algorithm. A result that fails its check is never kept: the next algorithm is
    # then checked against the reference itself.
    runs = []
    for numel in (0, 1, max(cl.size() - 1, 1), 1000, (1 << 20) + 3):
        if numel in _LENGTHS:
            inputs = _LENGTHS[numel][0]
        else:
            inputs = every_rank_small_ints(seed_of(f"length.{numel}"), (numel,), torch.int32)
        runs.append((run(backend, name, inputs[cl.rank()], cl.Sum), inputs, numel))
    for result, inputs, numel in runs:
        if numel in _LENGTHS:
            checked = _LENGTHS[numel][1]
            assert result.dtype == checked.dtype and torch.equal(result, checked), numel
        else:
            assert_reduced(result, inputs, cl.Sum)
            _LENGTHS[numel] = (inputs, result)


def _dtype_op_params() -> Iterator[object]:
    for dtype in ALL_DTYPES:
        for op in OPS:
            yield pytest.param(dtype, op, id=f"{dtype_id(dtype)}-{op.name}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("dtype", "op"), list(_dtype_op_params()))
def test_every_dtype_and_op(backend: Backend, name: str, dtype: torch.dtype, op: ReduceOp) -> None:
    inputs = every_rank_small_ints(
        seed_of(f"{name}.{dtype}.{op.name}"), (257,), dtype, nonzero=True
    )
    result = run(backend, name, inputs[cl.rank()], op)
    assert_reduced(result, inputs, op)


@pytest.mark.parametrize("name", NAMES)
def test_float_results_are_the_same_bits_on_every_rank(backend: Backend, name: str) -> None:
    mine = random_floats(seed_of(name), cl.rank(), (4099,), torch.float32)
    result = run(backend, name, mine, cl.Sum)
    assert_same_on_every_rank(gather_rows(result, f"allreduce.{name}.same_bits"))


def _two_node_topologies() -> list[Topology]:
    """Pretend layouts for this job (same on every rank: they depend on the size only)."""
    size = cl.size()
    found = [Topology(tuple(r % 2 for r in range(size)))]  # interleaved, uneven when odd
    if size % 2 == 0:
        found.append(Topology(tuple(r // (size // 2) for r in range(size))))  # 2 nodes
    return found


@pytest.mark.parametrize("name", ["hierarchical", "shd", "torus2d", "swing"])
def test_topology_aware_algorithms_on_pretend_nodes(backend: Backend, name: str) -> None:
    runs = []
    for t, topology in enumerate(_two_node_topologies()):
        allreducer = Allreducer(name, topology=topology)
        for numel in (1, 1000, 4099):
            inputs = every_rank_small_ints(seed_of(f"{name}.{t}.{numel}"), (numel,), torch.int64)
            buf = inputs[cl.rank()].clone()
            request = allreducer(backend, None, buf, cl.Sum)
            wait_until(request.test, 60.0, f"rank {cl.rank()}: {name} did not complete")
            runs.append((buf, inputs))
    for result, inputs in runs:
        assert_reduced(result, inputs, cl.Sum)


def test_engine_uses_the_configured_algorithm() -> None:
    # The session's engine runs with the environment's setting (auto unless a job sets it).
    engine = runtime.engine()
    assert engine._allreduce.algorithm == engine.config.allreduce_algorithm


def test_auto_tuning_agrees_on_every_rank_and_stays_right(backend: Backend) -> None:
    # Online tuning (algorithms/autotune.py) measures up to 4 candidates per size class on the
    # first calls, then every rank must hold the same pick, and every call must be right.
    # One draw of every rank's inputs per size class, shifted by the call's number: each call
    # reduces different inputs (a stale or repeated result fails), and the exact reference is
    # summed once per class, not per call (drawing and summing every rank's 1M-element inputs
    # for each of the 26 calls was most of this test: 10 s of 4 ranks on 2 cores).
    allreducer = Allreducer(algorithms.AUTO, tuning=True)
    runs, picks = [], []
    for numel in (1000, (1 << 20) + 3):
        calls = autotune.round_calls(autotune.CANDIDATES, autotune.samples(4 * numel))
        base = every_rank_small_ints(seed_of(f"tuning.{numel}"), (numel,), torch.int32)
        total = sum(t.long() for t in base)  # the exact Sum of the unshifted inputs, as int64
        for step in range(calls + 2):
            result = run_with(backend, allreducer, base[cl.rank()] + step, cl.Sum)
            runs.append((result, total, step))
        picks.append(allreducer.choose(backend, numel, 4))
    everyone = cl.allgather_object(picks, name="tuning.picks")
    for result, total, step in runs:
        assert result.dtype == torch.int32 and result.shape == total.shape, result
        expected = total + cl.size() * step  # every rank added step to its input
        wrong = (result.long() != expected).nonzero()
        assert wrong.numel() == 0, f"{len(wrong)} wrong elements, first at {wrong[0].item()}"
    assert all(theirs == picks for theirs in everyone), everyone
    if cl.size() > 1:
        assert allreducer._tuner.rounds == 2


def test_auto_with_a_simulated_table_takes_its_pick(backend: Backend) -> None:
    # COMMLAYER_SIM_TABLE's table of one node of 2-4 ranks (tests/unit/sim_table_one_node.jsonl:
    # tree fastest at 1 MiB): auto runs the table's pick where the model's rule would say shm.
    from pathlib import Path

    from commlayer.costmodel import simulated

    table = Path(__file__).parents[1] / "unit" / "sim_table_one_node.jsonl"
    allreducer = Allreducer(algorithms.AUTO, simulated=simulated.load(str(table)))
    numel = (1 << 20) // 4
    inputs = every_rank_small_ints(seed_of("sim_table"), (numel,), torch.int32)
    result = run_with(backend, allreducer, inputs[cl.rank()], cl.Sum)
    pick = allreducer.choose(backend, numel, 4)
    everyone = cl.allgather_object(pick, name="sim_table.pick")
    assert_reduced(result, inputs, cl.Sum)
    assert all(theirs == pick for theirs in everyone), everyone
    if 2 <= cl.size() <= 4 and allreducer.topology(backend).nodes == 1:
        assert pick == "tree"
