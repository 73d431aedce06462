"""Top-k sparsification: send the k largest-magnitude elements and their positions.

Math (Aji & Heafield 2017, "Sparse Communication for Distributed Gradient Descent"; Lin et al.,
ICLR 2018, "Deep Gradient Compression"): C(x) keeps x_i for the k = ceil(ratio * d) indices of
largest |x_i| and zeroes the rest. It is biased (||x - C(x)||^2 <= (1 - k/d) ||x||^2, a
contraction), so ``create("topk:...")`` wraps it in ErrorFeedback, which is what makes it
converge (Stich et al. 2018, "Sparsified SGD with Memory").

Selection, ``mode``:
1. ``sampled`` (the default; DGC's sampled threshold, Lin et al. 2018, section 3 / appendix):
   take |x| at ~1% random positions, set the threshold to the sample's top 1.5 * ratio
   quantile, keep the candidates |x| >= threshold (one read of the tensor, comparing |x| as it
   goes, 16 elements at a time with no branch per element: no |x| temporary) and run
   ``torch.topk`` on the candidates only. Under error feedback (``compress_sum_``) the
   correction e += g and this read are one kernel, the sample taken of e + g. Whenever at least
   k candidates pass, the k largest are all among them, so the result equals exact top-k;
   when too few pass (the sample overestimated the threshold: rare with the 50% margin, and
   error feedback's residuals fatten the tail) it reads again with the threshold at twice
   the margin, twice (``retries``), then falls back to exact (``fallbacks``). The
   compaction is ``kernels.threshold_select``, dispatched by the tensor's device and
   COMMLAYER_KERNELS (numba on the CPU: 2.7x torch's in benchmarks/results/kernels.md; the CUDA
   kernels on a GPU).
2. ``exact``: ``torch.topk`` of |x| over the whole tensor (a |x| temporary and a selection
   over all of it: several times the sampled threshold's cost, benchmarks/compress_cost.py).

Error feedback (``ErrorFeedback``) keeps what was not sent: ``drop_sent_`` zeroes the sent
positions of the corrected gradient in place, which is exactly p - D(C(p)) without building
D(C(p)). Summing gathered payloads, ``decompress_add_`` adds each rank's k values into the
result in place (no dense tensor per rank).

Payload: values (the tensor's dtype) and int32 indices, 2 x 4 bytes per kept float32 element;
reduced by allgather (each rank's k pairs are scattered and summed locally).
"""

from __future__ import annotations

import torch

from commlayer import kernels
from commlayer.common.errors import PayloadError
from commlayer.compression.base import (
    COMPRESS_SUM,
    DECOMPRESS_ADD,
    DROP_SENT,
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    check_ratio,
    expect_numel,
    host_work,
    kept,
)

MODES = ("exact", "sampled")
_SAMPLE_FRACTION = 0.01  # DGC samples 0.1-1% of the gradient
_MIN_SAMPLE = 4096  # at fewer samples the quantile estimate is too noisy; below, exact is cheap
_MARGIN = 1.5  # candidates ~1.5 k: fewer than k is a > 3 sigma event at 1% of 1 M elements
_RETRIES = 2  # too few candidates: the threshold at twice the margin, then exact
_HOST_DRAWS = (
    "sampled mode draws its sample positions on the CPU (the same as a CPU rank with this seed) "
    "and copies them to the device, one index per sampled element"
)


class TopKCompressor(CompressorBase):
    """The ``ratio`` fraction of elements largest in magnitude, with int32 indices."""

    name = "topk"
    summable = False
    capabilities = frozenset({WIRE_BYTES, DECOMPRESS_ADD, DROP_SENT, COMPRESS_SUM})
    sparse = True  # [values, int32 indices]: a sparse algorithm may reduce it
    biased = True
    wire_parameters = ("ratio",)

    def __init__(self, ratio: float = 0.01, mode: str = "sampled", seed: int = 0) -> None:
        self.ratio = check_ratio(ratio)
        if mode not in MODES:
            raise ValueError(f"topk mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._generator = torch.Generator().manual_seed(seed)
        self.retries = 0  # sampled selections read again with a lower threshold
        self.fallbacks = 0  # sampled selections that had to fall back to exact

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1)
        if flat.numel() >= 2**31:
            raise ValueError(f"topk: {flat.numel()} elements do not fit int32 indices")
        k = kept(flat.numel(), self.ratio)
        indices = self.select(flat, k)
        values = flat[indices]
        return Compressed([values, indices.to(torch.int32)], (tensor.shape, tensor.dtype))

    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (int64) of the k entries of ``x`` (1-D) largest in magnitude."""
        if self._exact(x.numel(), k):
            return torch.topk(x.abs(), k, sorted=False).indices
        return self._pick(x, k, self._sample(x, None), _MARGIN)

    def _exact(self, count: int, k: int) -> bool:
        # Exact when the sample would be a quarter of the tensor, or the candidates would:
        # the compaction then costs about what it saves.
        sample = max(_MIN_SAMPLE, int(count * _SAMPLE_FRACTION))
        return self.mode == "exact" or sample * 4 > count or _MARGIN * k * 4 > count

    def _sample(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """|x + y| (``y`` None: |x|) at random positions. The positions come from the CPU
        generator for any device (then moved), so a CUDA rank samples where a CPU rank with
        this seed does: the same threshold and result."""
        count = x.numel()
        sample = max(_MIN_SAMPLE, int(count * _SAMPLE_FRACTION))
        positions = torch.randint(0, count, (sample,), generator=self._generator)
        positions = positions.to(x.device)
        host_work(self.name, x.device, _HOST_DRAWS)
        values = x.index_select(0, positions)  # a third of x[positions]'s time at 6 K
        return (values if y is None else values.add_(y.index_select(0, positions))).abs_()

    @staticmethod
    def _threshold(sampled: torch.Tensor, margin: float, k: int, count: int) -> float:
        top_in_sample = min(sampled.numel(), int(margin * k / count * sampled.numel()) + 1)
        return float(torch.topk(sampled, top_in_sample, sorted=False).values.min())

    @staticmethod
    def _largest(x: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
        """The k of ``candidates`` (indices into ``x``, at least k) largest in magnitude."""
        picked = torch.topk(x.index_select(0, candidates).abs_(), k, sorted=False)
        return candidates[picked.indices]

    def _pick(self, x: torch.Tensor, k: int, sampled: torch.Tensor, margin: float) -> torch.Tensor:
        for _ in range(1 + _RETRIES):
            threshold = self._threshold(sampled, margin, k, x.numel())
            candidates = kernels.threshold_select(x, threshold).long()  # compares |x|
            if candidates.numel() >= k:
                return self._largest(x, candidates, k)
            self.retries += 1
            margin *= 2  # the sample's estimate was high: a lower threshold, one more read
        self.fallbacks += 1
        return torch.topk(x.abs(), k, sorted=False).indices

    def compress_sum_(self, acc: torch.Tensor, tensor: torch.Tensor, name: str = "") -> Compressed:
        """``compress(acc + tensor)`` with the sum left in ``acc`` (contiguous, the tensor's
        shape, dtype and device): error feedback's correction and the candidates' read are one
        kernel (``kernels.add_threshold_select_``), the threshold from the sum's sample. The
        indices are those ``compress`` of the sum gives (both are exact top-k whenever enough
        candidates pass)."""
        x, g = acc.view(-1), tensor.detach().reshape(-1)
        count = x.numel()
        if count >= 2**31:
            raise ValueError(f"topk: {count} elements do not fit int32 indices")
        k = kept(count, self.ratio)
        if self._exact(count, k):
            x.add_(g)
            indices = torch.topk(x.abs(), k, sorted=False).indices
        else:
            sampled = self._sample(x, g)
            threshold = self._threshold(sampled, _MARGIN, k, count)
            candidates = kernels.add_threshold_select_(x, g, threshold).long()
            if candidates.numel() >= k:
                indices = self._largest(x, candidates, k)
            else:
                self.retries += 1
                indices = self._pick(x, k, sampled, _MARGIN * 2)
        values = x.index_select(0, indices)
        return Compressed([values, indices.to(torch.int32)], (tensor.shape, tensor.dtype))

    def drop_sent_(self, corrected: torch.Tensor, compressed: Compressed) -> torch.Tensor:
        """Error feedback's new residual, in place: ``corrected`` less what was sent (the
        sent positions zeroed; D(C(p)) holds p's own values there and zeros elsewhere)."""
        indices = compressed.payload[1]
        corrected.reshape(-1).index_fill_(0, indices.to(corrected.device, torch.long), 0)
        return corrected

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        values, indices = self.check_payload(compressed)
        out = torch.zeros(shape.numel(), dtype=dtype, device=values.device)
        # index_add_, not scatter: a duplicated index sums instead of picking one arbitrarily.
        out.index_add_(0, indices, values.to(dtype))
        return out.view(shape)

    def decompress_add_(self, compressed: Compressed, out: torch.Tensor, alpha: float) -> None:
        """``out`` (flat, the tensor's dtype) += ``alpha`` x the decompressed payload, touching
        only the k positions (the communicator sums gathered payloads with it)."""
        values, indices = self.check_payload(compressed)
        out.index_add_(0, indices, values.to(out.dtype), alpha=alpha)

    def check_payload(self, compressed: Compressed) -> tuple[torch.Tensor, torch.Tensor]:
        """A peer's (values, indices), checked against this rank's ctx."""
        shape, _ = compressed.ctx
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
        return values, indices

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return kept(numel, self.ratio) * (element_bytes + 4)
