"""Floating-point tensors travel as bfloat16 (float32's range, 8-bit mantissa)."""

from __future__ import annotations

from typing import ClassVar

import torch

from commlayer.compression.cast import CastCompressor


class BF16Compressor(CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, 8-bit mantissa)."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
