"""hvd.SyncBatchNorm (issue #7): at any size and with a different batch size on every rank (one
rank may have none), output, input and weight gradients and running statistics equal
torch.nn.BatchNorm on the concatenated batch.

Every rank builds the whole batch from one seed and keeps its rows; the reference runs on all
rows locally. Weight and bias gradients stay local in SyncBatchNorm (DistributedOptimizer
averages them), so their sum over ranks is compared with the reference's. Collectives first,
asserts last.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import commlayer as hvd

F64 = torch.float64


def _rows_per_rank(size: int) -> list[int]:
    """Uneven batch sizes; rank 1 brings no rows when there are 3 ranks or more."""
    return [[3, 0, 2, 5][r % 4] if size >= 3 else 2 + r for r in range(size)]


def _step(
    ours: nn.Module, ref: nn.Module, x: torch.Tensor, weight: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward/backward of both on loss = sum(out * weight); this rank's rows of ours."""
    rows = _rows_per_rank(hvd.size())
    start = sum(rows[: hvd.rank()])
    mine = slice(start, start + rows[hvd.rank()])
    x_ours, x_ref = x[mine].clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_ref = ours(x_ours), ref(x_ref)
    (out_ours * weight[mine]).sum().backward()
    (out_ref * weight).sum().backward()
    grads = [hvd.allreduce(p.grad, op=hvd.Sum) for p in ours.parameters()]
    assert x_ours.grad is not None and x_ref.grad is not None
    stats = [ours.running_mean, ours.running_var, ref.running_mean, ref.running_var]
    kept = [t.clone() for t in stats if t is not None]  # updated in place by the next step
    got = [out_ours, x_ours.grad, *grads, *kept[:2]]
    want = [out_ref[mine], x_ref.grad[mine], *[p.grad for p in ref.parameters()], *kept[2:]]
    return got, want


@pytest.mark.parametrize(
    ("reference", "shape", "momentum"),
    [
        (nn.BatchNorm1d, (4,), 0.1),
        (nn.BatchNorm1d, (3, 5), None),
        (nn.BatchNorm2d, (3, 4, 2), 0.3),
        (nn.BatchNorm3d, (2, 2, 3, 2), 0.1),
    ],
)
def test_equals_batch_norm_on_the_whole_batch(
    reference: type[nn.Module], shape: tuple[int, ...], momentum: float | None
) -> None:
    total = sum(_rows_per_rank(hvd.size()))
    g = torch.Generator().manual_seed(5)
    channels = shape[0]
    ours = hvd.SyncBatchNorm(channels, momentum=momentum).to(F64)
    ref = reference(channels, momentum=momentum).to(F64)
    with torch.no_grad():
        for module in (ours, ref):
            module.weight.copy_(torch.linspace(0.5, 2.0, channels))
            module.bias.copy_(torch.linspace(-1.0, 1.0, channels))
    steps = []
    for _ in range(2):  # two steps: the running statistics accumulate
        x = torch.randn(total, *shape, generator=g, dtype=F64) * 3 + 1
        weight = torch.randn(total, *shape, generator=g, dtype=F64)
        for module in (ours, ref):
            module.zero_grad()
        steps.append(_step(ours, ref, x, weight))
    ours.eval()
    ref.eval()
    x = torch.randn(total, *shape, generator=g, dtype=F64)
    evaluated = ours(x), ref(x)

    for got, want in steps:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert int(ours.num_batches_tracked) == 2
    torch.testing.assert_close(*evaluated, rtol=1e-12, atol=1e-12)


def test_float32_and_no_running_stats() -> None:
    total = sum(_rows_per_rank(hvd.size()))
    x = torch.randn(total, 3, 4, generator=torch.Generator().manual_seed(9))
    ours = hvd.SyncBatchNorm(3, affine=False, track_running_stats=False)
    ref = nn.BatchNorm1d(3, affine=False, track_running_stats=False)
    rows = _rows_per_rank(hvd.size())
    start = sum(rows[: hvd.rank()])
    mine = slice(start, start + rows[hvd.rank()])
    ours.eval()  # without running statistics, eval also normalizes over every rank's batch
    ref.eval()
    got, want = ours(x[mine]), ref(x)[mine]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ours.running_mean is None


def test_bad_input_is_a_value_error_naming_the_rank() -> None:
    bn = hvd.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=f"rank {hvd.rank()}: .*shape \\(N, C, ...\\), got 1-D"):
        bn(torch.ones(3))
    with pytest.raises(ValueError, match=f"rank {hvd.rank()}: .*SyncBatchNorm\\(3\\) got .* 4 ch"):
        bn(torch.ones(2, 4))
    # One value per channel over all ranks: every rank raises (the count is global).
    one_row = torch.ones(1 if hvd.rank() == 0 else 0, 3)
    with pytest.raises(ValueError, match=f"rank {hvd.rank()}: .*more than 1 value per channel"):
        bn(one_row)
