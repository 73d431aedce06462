"""1-bit SGD: one bit per element, decoded to the mean of the positive or negative elements.

Math (Seide et al., Interspeech 2014, "1-Bit Stochastic Gradient Descent and its Application
to Data-Parallel Distributed Training of Speech DNNs", section 3): each element is quantized to
one bit, b_i = [x_i >= 0], and reconstructed as mu_+ = mean{x_j : x_j >= 0} where b_i = 1 and
mu_- = mean{x_j : x_j < 0} where b_i = 0 (the two values minimising the squared error of a
1-bit code given the signs). Biased; Seide et al. introduced error feedback ("delay the
quantization error to the next minibatch") for it, which ``create`` adds by default.

Payload: ceil(d / 32) int32 words of packed signs and two float32 reconstruction values
(mu_+, mu_-). Gathered and summed like EF-SignSGD; mu_+ < 0 or mu_- > 0 from a peer is refused.
"""

from __future__ import annotations

import torch

from commlayer import kernels
from commlayer.common.errors import PayloadError
from commlayer.compression import bitpack
from commlayer.compression.base import (
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    compute_dtype,
    expect_finite,
    expect_numel,
)


class OneBitCompressor(CompressorBase):
    """One bit per element; mean of the non-negative and of the negative elements."""

    name = "onebit"
    summable = False
    capabilities = frozenset({WIRE_BYTES})
    biased = True

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1)
        x = flat.to(compute_dtype(flat.dtype))
        positive = x >= 0
        count = positive.sum()
        total = x.sum()
        positive_sum = torch.where(positive, x, 0).sum()
        mean_pos = positive_sum / count.clamp(min=1)
        mean_neg = (total - positive_sum) / (x.numel() - count).clamp(min=1)
        means = torch.stack([mean_pos, mean_neg]).float()
        return Compressed([kernels.pack_signs(flat), means], (tensor.shape, tensor.dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        words, means = compressed.payload
        count = shape.numel()
        expect_numel(words, bitpack.sign_words(count), "onebit sign words")
        expect_numel(means, 2, "onebit reconstruction values")
        expect_finite(means, "onebit reconstruction value")
        if means[0] < 0 or means[1] > 0:
            raise PayloadError(f"onebit reconstruction values {means.tolist()} have wrong signs")
        decoded = kernels.decode_signs(words, count, means[0].to(dtype), means[1].to(dtype))
        return decoded.view(shape)

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return 4 * bitpack.sign_words(numel) + 8
