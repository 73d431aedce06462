"""Tensor fusion as a user sees it (issue #2).

1. Many small tensors submitted asynchronously at once (mixed dtypes, ops and scale factors, odd
   sizes, zero-element and scalar tensors, in place or not, with other collectives in between)
   all come back right, whichever buckets the engine packs them into.
2. The same burst again, as every training step after the first submits it: every name is then
   in the response cache (the bit-vector path), and results must still be right.
3. A grouped allreduce of one dtype is a single collective (``communication_stats``).

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from collective_reference import ALL_DTYPES, OPS, assert_reduced, seed_of, small_ints

import commlayer as cl
from commlayer.core import runtime

SHAPES = ((), (0,), (1,), (7,), (3, 5), (2, 0, 3), (13,), (1, 1, 1))
BURST = 40  # 10 dtypes x 8 shapes x 5 ops cycle together: 40 distinct combinations


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One operation of the burst."""

    kind: str  # "allreduce", "allreduce_", "grouped", "allgather" or "broadcast"
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: cl.ReduceOp = cl.Sum
    prescale: float = 1.0
    postscale: float = 1.0


def _burst() -> list[_Spec]:
    specs = []
    for i in range(BURST):
        dtype, shape, op = ALL_DTYPES[i % 10], SHAPES[i % 8], OPS[i % 5]
        if dtype == torch.bool and op == cl.Average:
            op = cl.Max  # Average of bool is a known bug (test_allreduce.py)
        pre, post = 1.0, 1.0
        if i % 3 == 0 and op in (cl.Sum, cl.Average) and dtype != torch.bool:
            pre, post = (0.5, 3.0) if dtype.is_floating_point else (2.0, 3.0)
        kind = ("allreduce", "allreduce_", "allreduce", "grouped")[i % 4]
        specs.append(_Spec(kind, f"fusion.{i}", dtype, shape, op, pre, post))
        if i % 8 == 7:  # other collectives submitted in the middle of the burst
            specs.append(_Spec("allgather", f"fusion.gather.{i}", dtype, (2, 3)))
            specs.append(_Spec("broadcast", f"fusion.bcast.{i}", dtype, (4,)))
    return specs


def _inputs(spec: _Spec, step: int) -> list[torch.Tensor]:
    seed = seed_of(f"{spec.name}.{step}")
    nonzero = spec.op == cl.Product
    return [small_ints(seed, r, spec.shape, spec.dtype, nonzero=nonzero) for r in range(cl.size())]


def _submit(spec: _Spec, tensor: torch.Tensor) -> cl.Handle:
    scales = {"prescale_factor": spec.prescale, "postscale_factor": spec.postscale}
    if spec.kind == "allreduce":
        return cl.allreduce_async(tensor, name=spec.name, op=spec.op, **scales)
    if spec.kind == "allreduce_":
        return cl.allreduce_async_(tensor, name=spec.name, op=spec.op, **scales)
    if spec.kind == "grouped":
        return cl.grouped_allreduce_async([tensor], name=spec.name, op=spec.op, **scales)
    if spec.kind == "allgather":
        return cl.allgather_async(tensor, name=spec.name)
    return cl.broadcast_async(tensor, root_rank=cl.size() - 1, name=spec.name)


def _check(spec: _Spec, result: Any, inputs: list[torch.Tensor]) -> None:
    if spec.kind == "grouped":
        result = result[0]
    if spec.kind == "allgather":
        assert torch.equal(result, torch.cat(inputs)), f"rank {cl.rank()}: {spec.name}"
    elif spec.kind == "broadcast":
        assert torch.equal(result, inputs[-1]), f"rank {cl.rank()}: {spec.name}"
    else:
        assert_reduced(result, inputs, spec.op, spec.prescale, spec.postscale)


def _run_burst(step: int) -> None:
    specs = _burst()
    inputs = [_inputs(spec, step) for spec in specs]
    mine = [per_rank[cl.rank()].clone() for per_rank in inputs]
    handles = [_submit(spec, tensor) for spec, tensor in zip(specs, mine)]
    results = [cl.synchronize(handle) for handle in reversed(handles)][::-1]
    for spec, result, per_rank, tensor in zip(specs, results, inputs, mine):
        _check(spec, result, per_rank)
        if spec.kind == "allreduce_":
            _check(spec, tensor, per_rank)
        else:
            assert torch.equal(tensor, per_rank[cl.rank()]), f"{spec.name} changed its input"


def test_async_burst_of_mixed_small_tensors() -> None:
    _run_burst(step=0)


def test_same_burst_again_from_the_response_cache() -> None:
    # Same names as the test above, new values: every response comes from the cache.
    _run_burst(step=1)
    _run_burst(step=2)


def test_grouped_allreduce_of_one_dtype_is_one_collective() -> None:
    name = "fusion.grouped.one"
    shapes = [(), (0,), (5,), (3, 3), (1,), (17,)]
    inputs = [
        small_ints(seed_of(f"{name}.{i}"), cl.rank(), s, torch.float32)
        for i, s in enumerate(shapes)
    ]
    group_bytes = sum(t.numel() * t.element_size() for t in inputs)
    if runtime.engine().config.fusion_threshold_bytes < group_bytes:  # same setting everywhere
        pytest.skip(f"COMMLAYER_FUSION_THRESHOLD is below the group's {group_bytes} bytes")
    before = cl.communication_stats()["operations"]
    results = cl.grouped_allreduce(inputs, op=cl.Sum, name=name)
    collectives = cl.communication_stats()["operations"] - before
    for i, (shape, result) in enumerate(zip(shapes, results)):
        every = [
            small_ints(seed_of(f"{name}.{i}"), r, shape, torch.float32) for r in range(cl.size())
        ]
        assert_reduced(result, every, cl.Sum)
    assert collectives == 1, (
        f"rank {cl.rank()}: {len(shapes)} tensors took {collectives} collectives"
    )


# Sizes about fusion.ONE_PASS_NUMEL (64 Ki elements): over gloo a bucket's large tensors are
# reduced where they lie, several in flight at once, the small ones between them packed (runners/
# allreduce.py, 3.); over MPI the bucket is packed. Either way every result must be exact.
_MIXED = (70_000, 5, 65_536, 3, 1, 300_003, 7, 65_535, 131_072)
# over gloo: [5, 3, 1, 7, 65535] [70000] [65536] [300003] [131072]
_MIXED_PARTS = 5


def _mixed_inputs(name: str, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    return [
        [small_ints(seed_of(f"{name}.{i}"), r, (n,), dtype) for r in range(cl.size())]
        for i, n in enumerate(_MIXED)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize(
    ("op", "pre", "post"), [(cl.Sum, 1.0, 1.0), (cl.Average, 1.0, 1.0), (cl.Sum, 2.0, 0.5)]
)
def test_large_and_small_tensors_grouped(
    dtype: torch.dtype, op: Any, pre: float, post: float
) -> None:
    name = f"fusion.mixed.{dtype}.{op}.{pre}"
    every = _mixed_inputs(name, dtype)
    mine = [per_rank[cl.rank()].clone() for per_rank in every]
    before = cl.communication_stats()["operations"]
    results = cl.grouped_allreduce(
        mine, op=op, name=name, prescale_factor=pre, postscale_factor=post
    )
    collectives = cl.communication_stats()["operations"] - before
    backend = runtime.engine().backend(0)
    if cl.size() > 1 and getattr(backend, "progress_threads", 0):
        # whole through the window where the bucket's algorithm is the window (every rank on
        # one machine), else split where no machine runs more ranks than it has cores, else
        # packed in one
        total = sum(t.numel() for t in mine)
        allreducer = runtime.engine()._allreduce
        window = getattr(backend, "window_capable", False) and (
            allreducer.choose(backend, total, mine[0].element_size()) == "shm"
        )
        split = not window and not backend.oversubscribed()  # type: ignore[union-attr]
        parts = _MIXED_PARTS if split else 1
        assert collectives == parts, f"rank {cl.rank()}: {collectives} collectives"
    for result, per_rank, tensor in zip(results, every, mine):
        assert_reduced(result, per_rank, op, pre, post)
        assert torch.equal(tensor, per_rank[cl.rank()]), f"{name} changed its input"


def test_large_and_small_tensors_in_flight_together_in_place() -> None:
    # one operation per tensor, submitted at once: the engine gets them in one cycle and keeps
    # the large ones in flight together; in place (allreduce_) and out of place alternate
    for step in range(2):  # the second time from the response cache
        name = f"fusion.flight.{step}"
        every = _mixed_inputs(name, torch.float32)
        mine = [per_rank[cl.rank()].clone() for per_rank in every]
        handles = [
            (cl.allreduce_async_ if i % 2 else cl.allreduce_async)(
                tensor, name=f"{name}.{i}", op=cl.Average
            )
            for i, tensor in enumerate(mine)
        ]
        results = [cl.synchronize(handle) for handle in handles]
        for i, (result, per_rank) in enumerate(zip(results, every)):
            assert_reduced(result, per_rank, cl.Average)
            if i % 2:
                assert_reduced(mine[i], per_rank, cl.Average)


def test_communication_stats_count_the_engines_cpu() -> None:
    """``engine_cpu_s``: the engine thread's CPU seconds, which grow as it works (issue 52 asks
    for the engine's CPU a step from ``communication_stats()``)."""
    before = cl.communication_stats()
    tensors = [torch.full((1 << 16,), float(cl.rank())) for _ in range(8)]
    for step in range(20):
        cl.grouped_allreduce(tensors, name=f"fusion.cpu.{step}", op=cl.Sum)
    after = cl.communication_stats()
    assert 0.0 < before["engine_cpu_s"] < after["engine_cpu_s"], (before, after)
    assert after["operations"] > before["operations"]
