"""Floating-point tensors travel as bfloat16 (float32's range, 8-bit mantissa)."""

from __future__ import annotations

import torch

from commlayer.compression.cast import CastCompressor


class BF16Compressor(CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, 8-bit mantissa)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
