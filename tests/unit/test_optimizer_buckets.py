"""DistributedOptimizer's bucket policy (comm/bucketer.py): the plan (order kept, one dtype a
bucket, cut once a bucket holds ``bucket_bytes``), groups, and what to send when."""

from __future__ import annotations

import torch
from torch import nn

from commlayer.comm.bucketer import Bucket, Bucketer, Part, cut, split_groups
from commlayer.compression import create


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
    assert _shape(cut(params, 800), params) == [[0, 1], [2], [3, 4]]


def test_each_dtype_fills_its_own_buckets() -> None:
    f32, f64 = torch.float32, torch.float64
    params = _params((100, f32), (100, f64), (100, f32), (10, f64), (1, f32))
    # float64's 800 bytes close [1] first, float32's 400 + 400 close [0, 2]; then what is
    # left of each, in the order it was opened
    assert _shape(cut(params, 800), params) == [[1], [0, 2], [3], [4]]


def test_zero_bytes_makes_a_bucket_per_parameter_and_none_is_lost() -> None:
    params = _params(*[(n, torch.float32) for n in (5, 1, 7, 3)])
    assert _shape(cut(params, 0), params) == [[0], [1], [2], [3]]
    assert cut([], 1 << 20) == []
    big = cut(params, 1 << 30)
    assert _shape(big, params) == [[0, 1, 2, 3]]


def test_split_groups_as_horovod_split_list() -> None:
    params = _params(*[(1, torch.float32)] * 5)
    assert _shape(split_groups(params, 2), params) == [[0, 1, 2], [3, 4]]
    assert _shape(split_groups(params, 3), params) == [[0, 1], [2, 3], [4]]
    assert _shape(split_groups(params, 7), params) == [[0], [1], [2], [3], [4]]  # none empty


def _bucket(params: list[nn.Parameter]) -> Bucket:
    return Bucket([Part(params, "b", create("none"))])


def test_bucketer_holds_gradients_until_the_threshold_and_records_their_order() -> None:
    a, b, c = _params((100, torch.float32), (100, torch.float32), (300, torch.float32))
    bucketer = Bucketer(1000)
    assert bucketer.ready(b) is None and bucketer.ready(a) is None  # 800 bytes: not yet
    assert bucketer.ready(c) == [b, a, c]  # 2000 >= 1000: all three go together
    assert bucketer.take_unsent() == []
    assert bucketer.step_done(failed=False) == [b, a, c]  # the order to plan from
    bucketer.install([_bucket([b, a]), _bucket([c])])
    assert bucketer.order is None
    assert bucketer.ready(a) is None
    full = bucketer.ready(b)
    assert isinstance(full, Bucket) and full.params == [b, a]
    assert bucketer.step_done(failed=False) is None  # planned: nothing to record
    assert [bk.ready for bk in bucketer.buckets] == [0, 0]


def test_bucketer_groups_are_buckets_from_the_start_and_stay_on_restart() -> None:
    a, b, c = _params((1, torch.float32), (1, torch.float64), (1, torch.float32))
    group = _bucket([a, b])
    bucketer = Bucketer(1 << 20, [group])
    assert bucketer.ready(c) is None  # outside the group: held, recorded
    assert bucketer.ready(a) is None
    assert bucketer.ready(b) is group
    assert bucketer.step_done(failed=True) is None  # a failed step plans nothing ...
    assert bucketer.order == []  # ... and records the next one
    bucketer.install([_bucket([c])])
    bucketer.restart()
    assert bucketer.buckets == [group] and bucketer.order == [] and bucketer.unsent == []
