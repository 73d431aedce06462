"""A fused bucket through the shared-memory window without packing it (backends/shm.py
``iallreduce_pieces``, engine.py): the window reads each rank's tensors where they lie and writes
every tensor's result, scaled by its own factor, where it belongs.

Piece boundaries fall anywhere: inside a chunk, on a chunk boundary, inside another rank's
slice; pieces can be empty; outputs can be the sources themselves (in place). Under mpiexec the
window is MPI's, under torchrun files in /dev/shm (FileWindow). Results must
match the locally computed reference (exact for small integers held in floats, with scales that
are powers of two) and be the same bits on every rank. Collectives first, asserts last (see
test_allreduce.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from collective_reference import (
    assert_reduced,
    assert_same_on_every_rank,
    dtype_id,
    every_rank_small_ints,
    gather_rows,
    random_floats,
    seed_of,
)
from launch import own_backend, under_torchrun
from restart import reinit
from waiting import wait_until

import commlayer as cl
from commlayer import ops
from commlayer.backends import shm
from commlayer.backends.shm import CHUNK_BYTES
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import fusion

OPS = (cl.Sum, cl.Min, cl.Max, cl.Product)
SCALES = (1.0, 0.5, 0.25, 1.0, 2.0, 1.0, 0.5)


def piece_sizes(dtype: torch.dtype) -> list[int]:
    """Seven pieces whose boundaries fall inside and on the window's chunks (2.5 chunks in all
    at any rank count), two of them empty."""
    chunk = CHUNK_BYTES // dtype.itemsize
    return [0, 5, chunk - 5, 1, chunk + chunk // 2 - 3, 0, 17]


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    if cl.size() == 1:
        pytest.skip("one rank: the window needs two")
    own = own_backend()  # collective: every rank makes it here
    yield own
    own.close()


def run(
    backend: Any,
    sources: list[torch.Tensor],
    op: ReduceOp,
    in_place: bool,
    scales: tuple[float, ...] = SCALES,
) -> list[torch.Tensor]:
    outputs = sources if in_place else [torch.full_like(s, -7) for s in sources]
    request = backend.shm_iallreduce_pieces(sources, outputs, list(scales), op)
    wait_until(request.test, 60.0, f"rank {cl.rank()}: the window did not complete")
    return outputs


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
def test_pieces_give_the_reference(
    backend: Any, dtype: torch.dtype, op: ReduceOp, in_place: bool
) -> None:
    runs = []
    sizes = piece_sizes(dtype)
    every = [
        every_rank_small_ints(seed_of(f"pieces.{dtype}.{op.name}.{k}"), (n,), dtype)
        for k, n in enumerate(sizes)
    ]
    mine = [inputs[cl.rank()].clone() for inputs in every]
    inputs_before = [t.clone() for t in mine]
    results = run(backend, mine, op, in_place)
    runs.append((results, every))
    if not in_place:  # out of place: the sources are left as they were
        assert all(torch.equal(a, b) for a, b in zip(mine, inputs_before, strict=True))
    for results, every in runs:
        for result, inputs, scale in zip(results, every, SCALES, strict=True):
            assert_reduced(result, inputs, op, postscale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_float_results_are_the_same_bits_on_every_rank(backend: Any, dtype: torch.dtype) -> None:
    sizes = piece_sizes(dtype)
    mine = [
        random_floats(seed_of(f"pieces.bits.{dtype}.{k}"), cl.rank(), (n,), dtype)
        for k, n in enumerate(sizes)
    ]
    scales = (1.0 / cl.size(),) * len(sizes)  # Average's factor: not a power of two at 3 ranks
    results = run(backend, mine, cl.Sum, True, scales)
    rows = gather_rows(torch.cat(results), f"pieces.bits.{dtype}")
    assert_same_on_every_rank(rows)


def test_without_a_window_the_torch_backend_packs_and_scales_as_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun, where no rank can map a window (here: its folder missing on every rank),
    the pieces are packed and reduced over gloo, each output scaled as the window scales it."""
    if cl.size() == 1 or not under_torchrun():
        pytest.skip("the torch backend's fallback, at 2 ranks or more")
    monkeypatch.setattr(shm.FileWindow, "DIRECTORY", "/nonexistent/commlayer-test")
    own = own_backend()  # every rank finds no window at its start-up gather
    try:
        assert not own.window_capable
        sizes = piece_sizes(torch.float32)
        every = [
            every_rank_small_ints(seed_of(f"pieces.fallback.{k}"), (n,), torch.float32)
            for k, n in enumerate(sizes)
        ]
        mine = [inputs[cl.rank()].clone() for inputs in every]
        scales = (1.0 / cl.size(), *SCALES[1:])  # Average's 1/n among powers of two
        results = run(own, mine, cl.Sum, False, scales)
    finally:
        own.close()
    for result, inputs, scale in zip(results, every, scales, strict=True):
        assert_reduced(result, inputs, cl.Sum, postscale=scale)


# -- through the engine: a burst of large tensors fused under the window ------------------------
@pytest.mark.parametrize("grouped", [False, True], ids=["separate", "grouped"])
def test_the_engine_reduces_large_tensors_in_place_without_packing(
    monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """Separate operations fused in one cycle, or one grouped operation (DistributedOptimizer's
    buckets): either way every tensor goes through the window where it lies."""
    if cl.size() == 1:
        pytest.skip("one rank: the window needs two")
    packed: list[int] = []
    pieces: list[int] = []
    original_pack = fusion.pack
    original_pieces = shm.SharedMemoryAllreduce.iallreduce_pieces

    def spy_pack(bucket: list[fusion.Entry], buf: torch.Tensor) -> None:
        packed.append(len(bucket))
        original_pack(bucket, buf)

    def spy_pieces(self: shm.SharedMemoryAllreduce, sources: Any, *rest: Any) -> Any:
        pieces.append(len(sources))
        return original_pieces(self, sources, *rest)

    monkeypatch.setattr(fusion, "pack", spy_pack)
    monkeypatch.setattr(shm.SharedMemoryAllreduce, "iallreduce_pieces", spy_pieces)
    reinit(allreduce_algorithm="shm")
    try:
        shapes = [(300, 700), (700,), (512, 1024), (3,), (1 << 18,)]  # small ones ride along
        every = [
            every_rank_small_ints(seed_of(f"engine.pieces.{k}"), shape, torch.float32)
            for k, shape in enumerate(shapes)
        ]
        mine = [inputs[cl.rank()].clone() for inputs in every]
        if grouped:
            group = cl.grouped_allreduce_async_(mine, op=cl.Average, name="engine.pieces.group")
            results = cl.synchronize(group)
        else:
            with ops.batch():  # as DistributedOptimizer's first-step gradients: together
                handles = [
                    cl.allreduce_async_(t, op=cl.Average, name=f"engine.pieces.{k}")
                    for k, t in enumerate(mine)
                ]
            results = [cl.synchronize(h) for h in handles]
    finally:
        reinit()
    for result, tensor, inputs in zip(results, mine, every, strict=True):
        assert result is tensor
        assert_reduced(result, inputs, cl.Average)
    assert sum(pieces) == len(shapes), (pieces, packed)  # every tensor went through the window
    assert not packed
