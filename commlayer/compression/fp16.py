"""Floating-point tensors travel as float16 (Horovod: Compression.fp16)."""

from __future__ import annotations

from typing import ClassVar

import torch

from commlayer.compression.cast import CastCompressor


class FP16Compressor(CastCompressor):
    """Floating-point tensors travel as float16 (Horovod: Compression.fp16)."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16
