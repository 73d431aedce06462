"""EF-SignSGD: the sign of each element times one scale, 32 signs to an int32 word.

Math (Karimireddy et al., ICML 2019, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", Algorithm 1): C(x) = (||x||_1 / d) * sign(x), with sign(0) = +1. Scaled
by the mean magnitude, C is a contraction (||C(x) - x||^2 <= (1 - ||x||_1^2 / (d ||x||_2^2))
||x||^2) but biased; plain signSGD can diverge, and the error feedback that ``create`` adds by
default restores SGD's convergence (their Theorem II).

Payload: ceil(d / 32) int32 words of packed signs (1 = non-negative) and one float32 scale:
32x smaller than float32. Not summable (the sum of two signs is not a sign): allgathered, each
rank's decoded and summed.
"""

from __future__ import annotations

import torch

from commlayer import kernels
from commlayer.compression import bitpack
from commlayer.compression.base import (
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    compute_dtype,
    expect_finite,
    expect_numel,
)


class EFSignSGDCompressor(CompressorBase):
    """sign(x) scaled by mean |x|."""

    name = "efsignsgd"
    summable = False
    capabilities = frozenset({WIRE_BYTES})
    biased = True

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1)
        scale = flat.to(compute_dtype(flat.dtype)).abs().mean().float().reshape(1)
        return Compressed([kernels.pack_signs(flat), scale], (tensor.shape, tensor.dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        words, scale = compressed.payload
        count = shape.numel()
        expect_numel(words, bitpack.sign_words(count), "efsignsgd sign words")
        expect_numel(scale, 1, "efsignsgd scale")
        expect_finite(scale, "efsignsgd scale", nonnegative=True)
        value = scale[0].to(dtype)
        return kernels.decode_signs(words, count, value, -value).view(shape)

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return 4 * bitpack.sign_words(numel) + 4
