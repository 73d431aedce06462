"""SyncBatchNorm: batch normalization whose statistics cover the batch of every rank.

Horovod's ``hvd.SyncBatchNorm`` (a drop-in for ``torch.nn.BatchNorm{1,2,3}d``), on CPU tensors;
Horovod's calls torch's CUDA-only ``batch_norm_stats``/``batch_norm_backward_*`` kernels, so the
math is written here with plain tensor operations. Per channel c, over all other dimensions:

1. Forward: each rank computes its count n_r, mean m_r and biased variance v_r; one allgather
   gives every rank all of them (Horovod gathers invstd and recovers the variance from it; the
   variance itself skips that round trip). N = sum n_r, mean = sum n_r m_r / N,
   var = sum n_r (v_r + (m_r - mean)^2) / N; y = (x - mean) / sqrt(var + eps) * weight + bias.
   The running statistics get the mean and the unbiased variance var * N / (N - 1).
2. Backward: each rank computes sum_dy = sum dy and sum_dy_xmu = sum dy (x - mean); one
   allreduce (Sum) makes them global, and
   dx = weight * invstd * (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N).
   The weight and bias gradients stay local, as in Horovod: DistributedOptimizer averages them.

A rank may bring a different batch size, even 0 rows (it then contributes nothing); the result
equals ``torch.nn.BatchNorm`` on the concatenated batch (tested at 1-4 ranks). Every rank must
call forward and backward the same number of times, as with any collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.modules.batchnorm import _BatchNorm

from commlayer import ops
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import runtime


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` with statistics over every rank's batch (module docstring).

    Same arguments as ``torch.nn.BatchNorm2d``; input of shape (N, C, ...) with N >= 0 on each
    rank and more than one value per channel over all ranks.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"rank {runtime.rank()}: SyncBatchNorm expects an input of shape (N, C, ...), "
                f"got {input.dim()}-D input of shape {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"rank {runtime.rank()}: SyncBatchNorm({self.num_features}) got an input with "
                f"{input.shape[1]} channels (shape {tuple(input.shape)})"
            )
        if not self.training and self.track_running_stats:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias,
                False, 0.0, self.eps,
            )  # fmt: skip
        factor = 0.0
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            # As torch's _BatchNorm: momentum None means a cumulative average.
            factor = (
                1.0 / float(self.num_batches_tracked)
                if self.momentum is None
                else float(self.momentum)
            )
        update = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if update else None,
            self.running_var if update else None,
            self.eps,
            factor,
        )


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (rows, C) with every non-channel position a row."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
    ) -> torch.Tensor:
        rows = _channels_last(input.detach()).double()
        count = rows.shape[0]
        if count:
            mean, var = rows.mean(0), rows.var(0, unbiased=False)
        else:
            mean = var = rows.new_zeros(rows.shape[1])
        local = torch.cat([rows.new_tensor([count]), mean, var]).unsqueeze(0)
        # Named by channel count: layers of one width reuse a name (they run one after another),
        # so steady-state negotiation hits the cache.
        channels = mean.numel()
        stats = ops.synchronize(ops.allgather_async(local, f"sync_batch_norm.{channels}.stats"))
        counts = stats[:, :1]
        means, variances = stats[:, 1 : 1 + channels], stats[:, 1 + channels :]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                f"rank {runtime.rank()}: SyncBatchNorm expects more than 1 value per channel "
                f"over all ranks when training, got {int(total)} (input shape "
                f"{tuple(input.shape)} here)"
            )
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (variances + (means - g_mean) ** 2)).sum(0) / total
        invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
            unbiased = g_var * total / (total - 1)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        mean_t, invstd_t = g_mean.to(input.dtype), invstd.to(input.dtype)
        ctx.save_for_backward(input, weight, mean_t, invstd_t)
        ctx.total = total
        out = (input - _per_channel(mean_t, input)) * _per_channel(invstd_t, input)
        if weight is not None:
            out = out * _per_channel(weight, input)
        if bias is not None:
            out = out + _per_channel(bias, input)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        xmu = input - _per_channel(mean, input)
        dy_rows, xmu_rows = _channels_last(grad_output), _channels_last(xmu)
        sum_dy = dy_rows.sum(0)
        sum_dy_xmu = (dy_rows * xmu_rows).sum(0)
        grad_weight = sum_dy_xmu * invstd if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.clone() if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu]).double()
            summed = ops.synchronize(
                ops.allreduce_async(
                    both, name=f"sync_batch_norm.{sum_dy.numel()}.grads", op=ReduceOp.Sum
                )
            )
            g_dy, g_dy_xmu = (summed / ctx.total).to(input.dtype).chunk(2)
            scale = invstd if weight is None else weight * invstd
            grad_input = _per_channel(scale, input) * (
                grad_output
                - _per_channel(g_dy, input)
                - xmu * _per_channel(invstd * invstd * g_dy_xmu, input)
            )
        return grad_input, grad_weight, grad_bias, None, None, None, None
