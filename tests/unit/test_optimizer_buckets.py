"""DistributedOptimizer's bucket policy (comm/bucketer.py): the plan (order kept, one dtype a
bucket, cut once a bucket holds ``bucket_bytes``), groups, and what to send when."""

from __future__ import annotations

import torch
from torch import nn

from commlayer.comm.bucketer import Bucket, Bucketer, Part, bucket, cut, split_groups, take_in
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


# -- buckets that own their memory (4.) -----------------------------------------------------------
def _names(params: list[nn.Parameter]) -> dict[nn.Parameter, str]:
    return {p: f"grad.{i}" for i, p in enumerate(params)}


def _owned(params: list[nn.Parameter], compressor: str = "none") -> Bucket:
    chosen = create(compressor)
    return bucket(params, dict.fromkeys(params, chosen), _names(params), lambda c: False, own=True)


def test_an_uncompressed_planned_part_owns_one_flat_buffer_its_gradients_are_views_of() -> None:
    a = nn.Parameter(torch.zeros(2, 3))
    b = nn.Parameter(torch.zeros(4))
    c = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    owned = _owned([a, b, c])
    f32, f64 = owned.parts  # one part a dtype
    assert f32.flat is not None and f32.flat.shape == (10,) and f32.flat.dtype == torch.float32
    assert [v.shape for v in f32.views] == [(2, 3), (4,)]
    assert f32.views[1].data_ptr() == f32.flat.data_ptr() + 6 * 4  # b's slice follows a's
    assert f64.flat is not None and f64.flat.dtype == torch.float64
    compressed = _owned([a, b], "fp16")
    assert compressed.parts[0].flat is None and compressed.parts[0].views == ()
    assert _bucket([a, b]).parts[0].flat is None  # not planned (groups=): no memory of its own


def test_install_moves_the_gradients_in_and_take_in_copies_once_and_re_points() -> None:
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    bucketer = Bucketer(1 << 20)
    owned = _owned([a, b])
    bucketer.install([owned])
    part = owned.parts[0]
    assert a.grad is part.views[0] and b.grad is None  # b had none: left None
    assert part.flat is not None and part.flat[:3].tolist() == [1.0, 2.0, 3.0]
    b.grad = torch.tensor([4.0, 5.0])  # as backward makes it after zero_grad(set_to_none=True)
    assert take_in(b, bucketer.view_of[b]) is False
    assert b.grad is part.views[1] and part.flat.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[1]]), torch.tensor([7.0]), (3,), check_invariants=True
    )
    a.grad = sparse
    assert take_in(a, part.views[0]) is True  # reduced dense, given back sparse by the caller
    assert a.grad is part.views[0] and part.flat[:3].tolist() == [0.0, 7.0, 0.0]


def test_gather_makes_the_buffer_hold_this_steps_gradients_never_a_stale_one() -> None:
    a, b, c, d = (nn.Parameter(torch.zeros(2)) for _ in range(4))
    owned = _owned([a, b, c, d])
    part = owned.parts[0]
    assert part.flat is not None
    part.flat.fill_(9.0)  # last step's reduced gradients
    a.grad = part.views[0]  # kept (zero_grad(set_to_none=False) zeroed it in place) ...
    a.grad.zero_()
    b.grad = None  # no gradient this step: zeros
    c.grad = torch.tensor([3.0, 4.0])  # assigned by the user: copied in
    d.requires_grad_(False)  # stopped requiring grad: zeros, its stale gradient kept as it was
    d.grad = part.views[3]
    stale = d.grad
    assert part.gather() == []
    assert part.flat.tolist() == [0.0, 0.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]
    assert a.grad is part.views[0] and b.grad is part.views[1] and c.grad is part.views[2]
    assert d.grad is not stale and d.grad.tolist() == [9.0, 9.0]
