"""DistributedOptimizer's bucket plan (optimizer._bucket_plan): order kept, one dtype a bucket,
cut once a bucket holds ``bucket_bytes``."""

from __future__ import annotations

import torch
from torch import nn

from commlayer.optimizer import _bucket_plan


def _params(*specs: tuple[int, torch.dtype]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in specs]


def _shape(buckets: list[list[nn.Parameter]], params: list[nn.Parameter]) -> list[list[int]]:
    """Buckets as lists of positions in ``params``."""
    position = {id(p): k for k, p in enumerate(params)}
    return [[position[id(p)] for p in bucket] for bucket in buckets]


def test_buckets_are_cut_once_they_hold_the_threshold_in_order() -> None:
    f32 = torch.float32
    params = _params((100, f32), (100, f32), (300, f32), (50, f32), (10, f32))  # bytes x4
    # 400+400 = 800 >= 800 closes; 1200 closes alone; 200+40 stays open to the end
    assert _shape(_bucket_plan(params, 800), params) == [[0, 1], [2], [3, 4]]


def test_each_dtype_fills_its_own_buckets() -> None:
    f32, f64 = torch.float32, torch.float64
    params = _params((100, f32), (100, f64), (100, f32), (10, f64), (1, f32))
    # float64's 800 bytes close [1] first, float32's 400 + 400 close [0, 2]; then what is
    # left of each, in the order it was opened
    assert _shape(_bucket_plan(params, 800), params) == [[1], [0, 2], [3], [4]]


def test_zero_bytes_makes_a_bucket_per_parameter_and_none_is_lost() -> None:
    params = _params(*[(n, torch.float32) for n in (5, 1, 7, 3)])
    assert _shape(_bucket_plan(params, 0), params) == [[0], [1], [2], [3]]
    assert _bucket_plan([], 1 << 20) == []
    big = _bucket_plan(params, 1 << 30)
    assert _shape(big, params) == [[0, 1, 2, 3]]
