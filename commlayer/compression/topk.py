"""Top-k sparsification: send the k largest-magnitude elements and their positions.

Math (Aji & Heafield 2017, "Sparse Communication for Distributed Gradient Descent"; Lin et al.,
ICLR 2018, "Deep Gradient Compression"): C(x) keeps x_i for the k = ceil(ratio * d) indices of
largest |x_i| and zeroes the rest. It is biased (||x - C(x)||^2 <= (1 - k/d) ||x||^2, a
contraction), so ``create("topk:...")`` wraps it in ErrorFeedback, which is what makes it
converge (Stich et al. 2018, "Sparsified SGD with Memory").

Selection, ``mode``:
1. ``exact``: ``torch.topk`` of |x| over the whole tensor.
2. ``sampled`` (DGC's sampled threshold, Lin et al. 2018, section 3 / appendix): take |x| at
   ~1% random positions, set the threshold to the sample's top 1.25 * ratio quantile, keep the
   candidates |x| >= threshold (one comparison and one compaction over the tensor) and run
   ``torch.topk`` on the candidates only. Whenever at least k candidates pass, the k largest
   are all among them, so the result equals exact top-k; when too few pass (the sample
   overestimated the threshold, rare with the 25% margin) it falls back to exact. The
   compaction is ``kernels.threshold_select``, dispatched by the tensor's device and
   COMMLAYER_KERNELS (numba on the CPU: 2.7x torch's in benchmarks/results/kernels.md; the CUDA
   kernels on a GPU).

Payload: values (the tensor's dtype) and int32 indices, 2 x 4 bytes per kept float32 element;
reduced by allgather (each rank's k pairs are scattered and summed locally).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from commlayer import kernels
from commlayer.compression.base import (
    Compressed,
    check_ratio,
    expect_numel,
    host_work,
    kept,
    register,
)
from commlayer.errors import PayloadError

MODES = ("exact", "sampled")
_SAMPLE_FRACTION = 0.01  # DGC samples 0.1-1% of the gradient
_MIN_SAMPLE = 4096  # at fewer samples the quantile estimate is too noisy; below, exact is cheap
_MARGIN = 1.25  # candidates ~1.25 k: fewer than k (fallback to exact) is a > 2.5 sigma event
_HOST_DRAWS = (
    "sampled mode draws its sample positions on the CPU (the same as a CPU rank with this seed) "
    "and copies them to the device, one index per sampled element"
)


@register("topk")
class TopKCompressor:
    """The ``ratio`` fraction of elements largest in magnitude, with int32 indices."""

    name: ClassVar[str] = "topk"
    summable: ClassVar[bool] = False
    biased: ClassVar[bool] = True

    def __init__(self, ratio: float = 0.01, mode: str = "exact", seed: int = 0) -> None:
        self.ratio = check_ratio(ratio)
        if mode not in MODES:
            raise ValueError(f"topk mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._generator = torch.Generator().manual_seed(seed)
        self.fallbacks = 0  # sampled selections that had to fall back to exact

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1)
        if flat.numel() >= 2**31:
            raise ValueError(f"topk: {flat.numel()} elements do not fit int32 indices")
        k = kept(flat.numel(), self.ratio)
        indices = self.select(flat.abs(), k)
        values = flat[indices]
        return Compressed([values, indices.to(torch.int32)], (tensor.shape, tensor.dtype))

    def select(self, magnitude: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (int64) of the k largest entries of ``magnitude``."""
        count = magnitude.numel()
        sample = max(_MIN_SAMPLE, int(count * _SAMPLE_FRACTION))
        # Exact when the sample would be a quarter of the tensor, or the candidates would:
        # the compaction then costs about what it saves.
        if self.mode == "exact" or sample * 4 > count or _MARGIN * k * 4 > count:
            return torch.topk(magnitude, k, sorted=False).indices
        # The sample positions come from the CPU generator for any device (then moved), so a
        # CUDA rank samples where a CPU rank with this seed does: the same threshold and result.
        positions = torch.randint(0, count, (sample,), generator=self._generator)
        positions = positions.to(magnitude.device)
        host_work(self.name, magnitude.device, _HOST_DRAWS)
        top_in_sample = min(sample, int(_MARGIN * k / count * sample) + 1)
        threshold = torch.topk(magnitude[positions], top_in_sample, sorted=False).values.min()
        candidates = kernels.threshold_select(magnitude, float(threshold)).long()
        if candidates.numel() < k:
            self.fallbacks += 1
            return torch.topk(magnitude, k, sorted=False).indices
        return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        values, indices = compressed.payload
        count = shape.numel()
        k = kept(count, self.ratio)
        expect_numel(values, k, "topk values")
        expect_numel(indices, k, "topk indices")
        if indices.dtype != torch.int32:
            raise PayloadError(f"topk indices are {indices.dtype}, expected torch.int32")
        low, high = (int(indices.min()), int(indices.max())) if k else (0, 0)
        if low < 0 or high >= max(count, 1):
            bad = low if low < 0 else high
            raise PayloadError(f"topk index {bad} out of range [0, {count})")
        out = torch.zeros(count, dtype=dtype, device=values.device)
        # index_add_, not scatter: a duplicated index sums instead of picking one arbitrarily.
        out.index_add_(0, indices, values.to(dtype))
        return out.view(shape)

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return kept(numel, self.ratio) * (element_bytes + 4)
