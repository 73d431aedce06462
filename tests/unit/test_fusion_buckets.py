"""Fusion: bucket planning, pack/unpack with scaling, buffer reuse, and fusion in the engine."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from engine_harness import allreduce, grouped_allreduce, run_engines, wait

from commlayer.algorithms.executor import BufferPool
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import fusion
from commlayer.core.engine import Engine
from commlayer.core.fusion import Entry, pack, plan_buckets, unpack

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
SIZES = [1, 3, 1023, 0]


def entries(*numels: int) -> list[Entry]:
    return [Entry(None, None, n) for n in numels]


def numels(buckets: list[list[Entry]]) -> list[list[int]]:
    return [[e.numel for e in bucket] for bucket in buckets]


def values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, (numel,), generator=g, dtype=dtype)


# -- plan_buckets ----------------------------------------------------------------------------------
def test_buckets_fill_up_to_the_threshold_inclusive() -> None:
    # 4-byte elements, 16-byte threshold: 2 + 2 fill a bucket exactly, the third opens a new one.
    assert numels(list(plan_buckets(entries(2, 2, 2, 1, 1), 4, 16))) == [[2, 2], [2, 1, 1]]


def test_tensor_bigger_than_threshold_gets_its_own_bucket() -> None:
    buckets = list(plan_buckets(entries(1, 1, 100, 1, 1), 4, 16))
    assert numels(buckets) == [[1, 1], [100], [1, 1]]


def test_threshold_zero_means_no_fusion() -> None:
    buckets = list(plan_buckets(entries(1, 5, 3, 1023), 8, 0))
    assert numels(buckets) == [[1], [5], [3], [1023]]


def test_no_entries_no_buckets() -> None:
    assert list(plan_buckets([], 4, 1024)) == []


@pytest.mark.parametrize("seed", range(20))
def test_buckets_keep_order_and_respect_threshold(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 3, 7, 64, 1023]) for _ in range(rng.randint(1, 30))]
    element, threshold = rng.choice([1, 2, 4, 8]), rng.choice([0, 1, 16, 100, 4096])
    plan = list(entries(*sizes))
    buckets = list(plan_buckets(plan, element, threshold))
    assert [e for bucket in buckets for e in bucket] == plan  # each entry once, in order
    for bucket in buckets:
        assert bucket
        assert len(bucket) == 1 or sum(e.numel for e in bucket) * element <= threshold


# -- pack / unpack ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_unpack_round_trip_odd_sizes(dtype: torch.dtype) -> None:
    sources = [values(n, dtype, seed=n) for n in SIZES]
    sources.append(values(6, dtype, seed=6).reshape(2, 3))  # multi-dimensional
    sources.append(values(1, dtype, seed=1).reshape(()))  # 0-d
    outputs = [torch.empty_like(s) for s in sources]
    bucket = [Entry(s, o, s.numel()) for s, o in zip(sources, outputs)]
    buf = BufferPool().get(dtype, sum(e.numel for e in bucket))

    pack(bucket, buf)
    assert torch.equal(buf, torch.cat([s.reshape(-1) for s in sources]))
    unpack(bucket, buf)
    for source, output in zip(sources, outputs):
        assert output.shape == source.shape and torch.equal(output, source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
def test_joined_entry_packs_zeros_and_unpacks_nowhere(dtype: torch.dtype) -> None:
    a, out = values(3, dtype, seed=1), torch.empty(3, dtype=dtype)
    bucket = [Entry(a, out, 3), Entry(None, None, 5)]
    buf = torch.full((8,), 7, dtype=dtype)
    pack(bucket, buf)
    assert torch.equal(buf[:3], a) and torch.equal(buf[3:], torch.zeros(5, dtype=dtype))
    unpack(bucket, buf)
    assert torch.equal(out, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_prescale_and_postscale_float(dtype: torch.dtype) -> None:
    a, b = values(3, dtype, seed=3), values(1023, dtype, seed=4)
    out_a, out_b = torch.empty_like(a), torch.empty_like(b)
    bucket = [Entry(a, out_a, 3, prescale=2.0, postscale=0.5), Entry(b, out_b, 1023, 1.0, 0.5)]
    buf = torch.empty(1026, dtype=dtype)
    pack(bucket, buf)
    assert torch.equal(buf[:3], a * 2.0) and torch.equal(buf[3:], b)
    assert torch.equal(a, values(3, dtype, seed=3))  # the source is left untouched
    unpack(bucket, buf)  # one postscale for the whole bucket: scaled in one pass
    assert torch.equal(out_a, a * 2.0 * 0.5) and torch.equal(out_b, b * 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_postscaled_unpack_of_small_and_large_tensors(dtype: torch.dtype, large: bool) -> None:
    """Large tensors are scaled straight into their outputs (one pass), small ones by scaling
    the buffer and copying: the same values either way, multi-dimensional outputs included."""
    n = fusion.ONE_PASS_NUMEL * 2 if large else 100
    sources = [values(n, dtype, seed=1), values(n + 7, dtype, seed=2).reshape(-1, 1)]
    outputs = [torch.empty_like(t) for t in sources]
    bucket = [Entry(t, o, t.numel(), postscale=0.125) for t, o in zip(sources, outputs)]
    buf = torch.empty(sum(e.numel for e in bucket), dtype=dtype)
    pack(bucket, buf)
    unpack(bucket, buf)
    for source, output in zip(sources, outputs):
        assert output.shape == source.shape and torch.equal(output, source * 0.125)


def test_different_postscales_in_one_bucket() -> None:
    a, b = torch.arange(4.0), torch.arange(5.0)
    out_a, out_b = torch.empty(4), torch.empty(5)
    bucket = [Entry(a, out_a, 4, postscale=0.25), Entry(b, out_b, 5, postscale=3.0)]
    buf = torch.empty(9)
    pack(bucket, buf)
    unpack(bucket, buf)
    assert torch.equal(out_a, a * 0.25) and torch.equal(out_b, b * 3.0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8], ids=str)
def test_integer_scaling_truncates_toward_zero(dtype: torch.dtype) -> None:
    a = torch.tensor([3, -3, 5, -7], dtype=dtype)
    out = torch.empty_like(a)
    bucket = [Entry(a, out, 4, prescale=2.5, postscale=0.5), Entry(None, None, 1)]
    buf = torch.empty(5, dtype=dtype)
    pack(bucket, buf)
    assert buf[:4].tolist() == [7, -7, 12, -17]  # 7.5 -> 7, -7.5 -> -7, ...
    unpack(bucket, buf)
    assert out.tolist() == [3, -3, 6, -8]
    assert out.dtype == dtype


def test_scale_by_one_is_a_no_op() -> None:
    t = torch.tensor([1.5, -2.0])
    fusion.scale_(t, 1.0)
    assert t.tolist() == [1.5, -2.0]


# -- BufferPool ------------------------------------------------------------------------------------
def test_buffer_pool_reuses_its_storage() -> None:
    pool = BufferPool()
    first = pool.get(torch.float32, 100)
    smaller = pool.get(torch.float32, 40)
    same = pool.get(torch.float32, 100)
    assert (first.numel(), smaller.numel(), same.numel()) == (100, 40, 100)
    assert smaller.data_ptr() == first.data_ptr() == same.data_ptr()
    assert smaller.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def test_buffer_pool_grows_then_reuses_the_larger_buffer() -> None:
    pool = BufferPool()
    pool.get(torch.float32, 10)
    grown = pool.get(torch.float32, 1000)
    assert grown.numel() == 1000
    assert pool.get(torch.float32, 500).data_ptr() == grown.data_ptr()
    assert pool.get(torch.float32, 1000).data_ptr() == grown.data_ptr()


def test_buffer_pool_keeps_one_buffer_per_dtype() -> None:
    pool = BufferPool()
    f32, f64 = pool.get(torch.float32, 8), pool.get(torch.float64, 8)
    assert (f32.dtype, f64.dtype) == (torch.float32, torch.float64)
    assert f32.data_ptr() != f64.data_ptr()
    assert pool.get(torch.float32, 8).data_ptr() == f32.data_ptr()


# -- fusion in the engine --------------------------------------------------------------------------
def fused_run(
    threshold: int, numel_list: list[int], op: ReduceOp = ReduceOp.Sum
) -> list[tuple[list[torch.Tensor], int]]:
    """Each of 3 ranks submits allreduces of rank + 1 before its engine starts (so they are
    negotiated and fused in one cycle); per rank: (results, collectives run)."""

    def fn(engine: Engine) -> tuple[list[torch.Tensor], int]:
        value = float(engine.rank + 1)
        handles = [
            engine.submit(allreduce(f"t{i}", torch.full((n,), value), op))
            for i, n in enumerate(numel_list)
        ]
        engine.start()
        results = [wait(h) for h in handles]
        return results, engine.stats.operations

    return run_engines(3, fn, start=False, fusion_threshold_bytes=threshold)


@pytest.mark.parametrize(
    ("threshold", "buckets"),
    [(0, 5), (1 << 20, 1), (40, 3)],  # 40 B: [10] [1000] [3 1 0] (float32 elements)
    ids=["no-fusion", "all-fused", "big-tensor-alone"],
)
def test_engine_fuses_up_to_the_threshold(threshold: int, buckets: int) -> None:
    sizes = [10, 1000, 3, 1, 0]
    for results, operations in fused_run(threshold, sizes):
        assert operations == buckets  # stats count one collective per bucket
        for n, out in zip(sizes, results):
            assert torch.equal(out, torch.full((n,), 6.0))


def test_engine_average_with_fusion_divides_by_size() -> None:
    for results, operations in fused_run(1 << 20, [4, 3], ReduceOp.Average):
        assert operations == 1
        assert torch.equal(results[0], torch.full((4,), 2.0))
        assert torch.equal(results[1], torch.full((3,), 2.0))


# -- groups: one entry for a whole grouped allreduce -----------------------------------------------
def group_entry(sources: list[torch.Tensor], outputs: list[torch.Tensor], **scales: float) -> Entry:
    numel_list = [s.numel() for s in sources]
    return Entry(None, None, sum(numel_list), group=(sources, outputs, numel_list), **scales)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flat", [True, False], ids=["1d", "nd"])
def test_group_entry_round_trip(dtype: torch.dtype, flat: bool) -> None:
    sources = [values(n, dtype, seed=n) for n in (5, 1, 0, 17)]
    if not flat:
        sources += [values(6, dtype, seed=6).reshape(2, 3), values(1, dtype, seed=1).reshape(())]
    outputs = [torch.empty_like(s) for s in sources]
    entry = group_entry(sources, outputs)
    buf = torch.empty(entry.numel, dtype=dtype)
    pack([entry], buf)
    assert torch.equal(buf, torch.cat([s.reshape(-1) for s in sources]))
    unpack([entry], buf)
    for source, output in zip(sources, outputs, strict=True):
        assert output.shape == source.shape and torch.equal(output, source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
def test_group_entry_shares_a_bucket_with_singles_and_joined_zeros(dtype: torch.dtype) -> None:
    a, out_a = values(3, dtype, seed=1), torch.empty(3, dtype=dtype)
    members = [values(4, dtype, seed=2), values(2, dtype, seed=3).reshape(2, 1)]
    outs = [torch.empty_like(m) for m in members]
    bucket = [Entry(a, out_a, 3), group_entry(members, outs, postscale=3.0), Entry(None, None, 2)]
    buf = torch.full((11,), 7, dtype=dtype)
    pack(bucket, buf)
    expected = torch.cat([a, members[0], members[1].reshape(-1), torch.zeros(2, dtype=dtype)])
    assert torch.equal(buf, expected)
    unpack(bucket, buf)
    assert torch.equal(out_a, a)
    for member, out in zip(members, outs, strict=True):
        assert torch.equal(out, member * 3)


def test_group_entry_prescale_and_postscale() -> None:
    members = [torch.arange(4.0), torch.arange(3.0)]
    outs = [torch.empty(4), torch.empty(3)]
    buf = torch.empty(7)
    pack([group_entry(members, outs, prescale=2.0, postscale=0.25)], buf)
    assert torch.equal(buf, torch.cat(members) * 2.0)
    unpack([group_entry(members, outs, prescale=2.0, postscale=0.25)], buf)
    assert torch.equal(outs[0], members[0] * 0.5) and torch.equal(outs[1], members[1] * 0.5)


def grouped_run(threshold: int, group_sizes: list[int], single: int) -> list[Any]:
    """3 ranks: a single allreduce then a grouped one, submitted before the engine starts;
    rank 2 instead joins. Per rank: (group results, single result, collectives run)."""

    def fn(engine: Engine) -> Any:
        value = float(engine.rank + 1)
        if engine.rank == 2:
            engine.start()
            wait(engine.join())
            return None
        members = [torch.full((n,), value) for n in group_sizes]
        handles = [
            engine.submit(allreduce("single", torch.full((single,), value))),
            engine.submit(grouped_allreduce("group", members, in_place=True)),
        ]
        engine.start()
        single_out, group_out = (wait(h) for h in handles)
        wait(engine.join())
        return group_out, single_out, members, engine.stats.operations

    return run_engines(3, fn, start=False, fusion_threshold_bytes=threshold)


@pytest.mark.parametrize(
    ("threshold", "collectives"),
    [(1 << 20, 1), (4 * 12, 2), (4 * 5, 4)],  # group of 12 floats: fused / alone / split
    ids=["fused-with-single", "group-alone", "group-over-threshold"],
)
def test_engine_grouped_allreduce_with_a_joined_rank(threshold: int, collectives: int) -> None:
    for result in grouped_run(threshold, [5, 4, 3], single=2)[:2]:
        group_out, single_out, members, operations = result
        assert torch.equal(single_out, torch.full((2,), 3.0))  # ranks 0 and 1; rank 2 gives 0
        for n, out, member in zip([5, 4, 3], group_out, members, strict=True):
            assert out is member and torch.equal(out, torch.full((n,), 3.0))
        assert operations == collectives


def _large(numel: int = 1 << 16, dtype: torch.dtype = torch.float32) -> Entry:
    source = torch.arange(numel, dtype=dtype)
    return Entry(source, torch.empty(numel, dtype=dtype), numel, postscale=0.5)


def test_a_bucket_of_large_float_tensors_goes_as_pieces() -> None:
    bucket = [_large(1 << 17), _large((1 << 16) + 5), _large(3)]  # a small one rides along
    found = fusion.pieces(bucket, torch.float32)
    assert found is not None
    sources, outputs, scales = found
    assert [t.data_ptr() for t in sources] == [e.source.data_ptr() for e in bucket]  # type: ignore[union-attr]
    assert [t.data_ptr() for t in outputs] == [e.output.data_ptr() for e in bucket]  # type: ignore[union-attr]
    assert all(t.dim() == 1 for t in sources + outputs)
    assert scales == [0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    "why",
    ["small", "integer", "joined", "prescale", "group"],
)
def test_buckets_that_must_be_packed(why: str) -> None:
    bucket = [_large(), _large()]
    dtype = torch.float32
    if why == "small":
        bucket = [_large(1000), _large(1000)]
    elif why == "integer":
        bucket, dtype = [_large(dtype=torch.int32), _large(dtype=torch.int32)], torch.int32
    elif why == "joined":
        bucket[1].source = None
    elif why == "prescale":
        bucket[0].prescale = 0.5
    else:
        bucket[1].group = ([torch.zeros(1 << 16)], [torch.zeros(1 << 16)], [1 << 16])
    assert fusion.pieces(bucket, dtype) is None


# -- an operation of one large tensor is reduced alone (runners/allreduce.py, 4.) ------------------
def test_one_large_tensor_operations_are_not_packed_with_others() -> None:
    """Fused in one cycle under a threshold that holds them all: the small ones packed together
    (one collective), each one-tensor operation of ``ALONE_NUMEL`` elements alone, in place."""
    big = fusion.ALONE_NUMEL
    sizes = [10, big, 3, big + 1]
    for results, operations in fused_run(1 << 30, sizes):
        assert operations == 3
        for n, out in zip(sizes, results):
            assert torch.equal(out, torch.full((n,), 6.0))


def test_a_joined_rank_parts_one_large_tensor_operations_alike() -> None:
    """Rank 2 joined (its entries are zeros it packs): the parts, and so the collectives, are
    the same on every rank, decided from the responses alone."""
    big = fusion.ALONE_NUMEL

    def fn(engine: Engine) -> Any:
        value = float(engine.rank + 1)
        if engine.rank == 2:
            engine.start()
            wait(engine.join())
            return None
        handles = [
            engine.submit(allreduce(f"t{i}", torch.full((n,), value)))
            for i, n in enumerate([big, 5, big])
        ]
        engine.start()
        results = [wait(h) for h in handles]
        wait(engine.join())
        return results, engine.stats.operations

    for result in run_engines(3, fn, start=False, fusion_threshold_bytes=1 << 30)[:2]:
        results, operations = result
        assert operations == 3
        for n, out in zip([big, 5, big], results):
            assert torch.equal(out, torch.full((n,), 3.0))  # ranks 0 and 1; rank 2 gives 0
