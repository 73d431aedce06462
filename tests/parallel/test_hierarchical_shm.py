"""``hierarchical`` with the shared-memory window as its node-local leg (backends/shm.py), under
real MPI on pretend nodes (a ``Topology`` or ``COMMLAYER_TOPOLOGY``: every rank of this job
shares one machine, so every pretend node really shares memory).

Equal nodes run the two-level form (window in each node, ``hierarchical.INTER`` across); unequal
nodes, or one node, run the schedule. Both must give the locally computed reference, exactly
for integers, and the same bits on every rank. Layouts depend on the job's size only, so every
rank skips the same tests. Collectives first, asserts last (see test_allreduce.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
from launch import mpi_only
from restart import reinit
from waiting import wait_until

import commlayer as cl
from commlayer.backends.mpi import MPIBackend
from commlayer.backends.shm import CHUNK_BYTES
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import runtime
from commlayer.core.selection import Allreducer

pytestmark = mpi_only

OPS = (cl.Sum, cl.Min, cl.Max, cl.Product)  # the backend's; Average is the engine's (below)
EXACT_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)  # small ints: exact
UNIFORM = ("nodes=2", "local=1", "interleaved")  # the two-level form
UNEVEN = ("uneven", "one-node")  # the schedule


def layout(kind: str, size: int) -> tuple[int, ...] | None:
    """The node of every rank under a named layout, or None where it does not exist at this
    size (same on every rank)."""
    if kind == "nodes=2":  # node-major, 2 nodes: (0, 1) at 2 ranks, (0, 0, 1, 1) at 4
        return tuple(r // (size // 2) for r in range(size)) if size % 2 == 0 else None
    if kind == "local=1":  # a node per rank
        return tuple(range(size)) if size > 1 else None
    if kind == "interleaved":  # (0, 1, 0, 1): a node's ranks are not neighbours
        return tuple(r % 2 for r in range(size)) if size >= 4 and size % 2 == 0 else None
    if kind == "uneven":  # (0, 0, 1), (0, 0, 0, 1)
        return (0,) * (size - 1) + (1,) if size >= 3 else None
    assert kind == "one-node"
    return (0,) * size if size > 1 else None


def layouts(kinds: tuple[str, ...]) -> list[tuple[int, ...]]:
    found = [layout(kind, cl.size()) for kind in kinds]
    return list(dict.fromkeys(node_of for node_of in found if node_of is not None))


def several_chunks(dtype: torch.dtype) -> int:
    """Elements spanning 2.5 of the window's chunks at any node size, and not aligned."""
    return (5 * CHUNK_BYTES // 2) // dtype.itemsize + 7


@pytest.fixture(scope="module")
def backend() -> Iterator[MPIBackend]:
    own = MPIBackend()  # a duplicate of COMM_WORLD: collective, every rank makes it here
    yield own
    own.close()


def run(
    backend: MPIBackend, node_of: tuple[int, ...], tensor: torch.Tensor, op: ReduceOp
) -> torch.Tensor:
    buf = tensor.clone().reshape(-1)
    request = Allreducer("hierarchical", topology=Topology(node_of))(backend, None, buf, op)
    wait_until(request.test, 60.0, f"rank {cl.rank()}: {node_of} did not complete")
    return buf.reshape(tensor.shape)


@pytest.mark.parametrize("kind", UNIFORM + UNEVEN)
def test_the_form_follows_the_nodes(backend: MPIBackend, kind: str) -> None:
    node_of = layout(kind, cl.size())
    if node_of is None:
        pytest.skip(f"no {kind} layout at {cl.size()} rank(s)")
    result = run(backend, node_of, torch.ones(1000, dtype=torch.int64), cl.Sum)
    two_level = kind in UNIFORM
    _, _, decided = Allreducer("hierarchical", topology=Topology(node_of))._backend_facts(backend)
    assert decided == two_level
    assert (node_of in backend._levels) == two_level, f"rank {cl.rank()}: {list(backend._levels)}"
    if two_level:
        node, cross = backend._levels[node_of]
        assert node.size == node_of.count(node_of[cl.rank()]) and cross.size == len(set(node_of))
        assert (node._shm is not None) == (node.size > 1)  # the window did the local leg
    assert torch.equal(result, torch.full((1000,), cl.size(), dtype=torch.int64))


def test_the_backend_refuses_unequal_nodes_on_every_rank(backend: MPIBackend) -> None:
    node_of = layout("uneven", cl.size())
    if node_of is None:
        pytest.skip(f"no unequal nodes at {cl.size()} rank(s)")
    with pytest.raises(ValueError, match=r"rank \d+: node_of=.*same number of ranks"):
        backend.shm_hierarchical_iallreduce(None, torch.ones(8), cl.Sum, node_of)


@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=dtype_id)
def test_every_length(backend: MPIBackend, dtype: torch.dtype) -> None:
    # One draw of every rank's inputs per length, reduced under every layout: the sums are exact
    # (small integers, in any of these dtypes), so each layout's result must equal the first
    # one's bit for bit, and that one the reference (drawing and summing every rank's inputs
    # again for each of up to 5 layouts was most of this test's time).
    runs = []
    size = cl.size()
    for numel in (0, 1, max(size - 1, 1), 1000, (1 << 20) + 3, several_chunks(dtype)):
        inputs = every_rank_small_ints(seed_of(f"{numel}"), (numel,), dtype)
        for node_of in layouts(UNIFORM + UNEVEN):
            runs.append((run(backend, node_of, inputs[cl.rank()], cl.Sum), inputs, node_of))
    checked: dict[int, torch.Tensor] = {}  # id(inputs) -> the result checked against them
    for result, inputs, node_of in runs:
        if id(inputs) not in checked:
            assert_reduced(result, inputs, cl.Sum)
            checked[id(inputs)] = result
        assert result.dtype == dtype and torch.equal(result, checked[id(inputs)]), node_of


def _dtype_op_params() -> Iterator[Any]:
    for dtype in ALL_DTYPES:
        for op in OPS:
            yield pytest.param(dtype, op, id=f"{dtype_id(dtype)}-{op.name}")


@pytest.mark.parametrize(("dtype", "op"), list(_dtype_op_params()))
def test_every_dtype_and_op(backend: MPIBackend, dtype: torch.dtype, op: ReduceOp) -> None:
    runs = []
    for node_of in layouts(UNIFORM + UNEVEN):
        inputs = every_rank_small_ints(seed_of(f"{node_of}.{dtype}.{op.name}"), (4099,), dtype)
        runs.append((run(backend, node_of, inputs[cl.rank()], op), inputs))
    for result, inputs in runs:
        assert_reduced(result, inputs, op)


@pytest.mark.parametrize("op", [cl.Max, cl.Product], ids=lambda op: op.name)
def test_several_chunks_with_other_ops(backend: MPIBackend, op: ReduceOp) -> None:
    runs = []
    for node_of in layouts(UNIFORM):
        for dtype in (torch.int64, torch.float32):
            numel = several_chunks(dtype)
            inputs = every_rank_small_ints(seed_of(f"{node_of}.{op.name}"), (numel,), dtype)
            runs.append((run(backend, node_of, inputs[cl.rank()], op), inputs))
    for result, inputs in runs:
        assert_reduced(result, inputs, op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=dtype_id)
def test_float_results_are_the_same_bits_on_every_rank(
    backend: MPIBackend, dtype: torch.dtype
) -> None:
    rows = []
    for node_of in layouts(UNIFORM):
        mine = random_floats(
            seed_of(f"{node_of}.{dtype}"), cl.rank(), (several_chunks(dtype),), dtype
        )
        result = run(backend, node_of, mine, cl.Sum)
        rows.append(gather_rows(result, f"hierarchical_shm.{node_of}.{dtype}"))
    for gathered in rows:
        assert_same_on_every_rank(gathered)


# -- through the engine: COMMLAYER_ALLREDUCE_ALGORITHM=hierarchical + COMMLAYER_TOPOLOGY ----------
def test_through_the_engine() -> None:
    size = cl.size()
    if size == 1:
        pytest.skip("one rank: no nodes to pretend")
    local = 2 if size == 4 else 1
    reinit(allreduce_algorithm="hierarchical", topology=f"nodes={size // local},local={local}")
    try:
        small = [
            every_rank_small_ints(seed_of(f"engine.{k}"), (k + 1,), torch.int32) for k in range(9)
        ]
        handles = [
            cl.allreduce_async(inputs[cl.rank()], op=cl.Sum, name=f"hier.small.{k}")
            for k, inputs in enumerate(small)
        ]
        small_results = [cl.synchronize(h) for h in handles]
        big = every_rank_small_ints(
            seed_of("engine.big"), (several_chunks(torch.float64),), torch.float64
        )
        big_sum = cl.allreduce(big[cl.rank()], op=cl.Sum, name="hier.big.sum")
        big_average = cl.allreduce(big[cl.rank()], op=cl.Average, name="hier.big.average")
        floats = random_floats(
            seed_of("engine.floats"), cl.rank(), (several_chunks(torch.float32),), torch.float32
        )
        same = gather_rows(cl.allreduce(floats, op=cl.Sum, name="hier.floats"), "hier.floats.rows")
        backend = runtime.engine()._global.backend
        assert isinstance(backend, MPIBackend)
        used = list(backend._levels)
        algorithm = cl.allreduce_algorithm()
    finally:
        reinit()
    assert algorithm == "hierarchical"
    assert used == [tuple(r // local for r in range(size))], used
    for result, inputs in zip(small_results, small):
        assert_reduced(result, inputs, cl.Sum)
    assert_reduced(big_sum, big, cl.Sum)
    assert_reduced(big_average, big, cl.Average)
    assert_same_on_every_rank(same)
