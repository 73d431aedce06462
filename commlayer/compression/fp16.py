"""Floating-point tensors travel as float16 (Horovod: Compression.fp16)."""

from __future__ import annotations

import torch

from commlayer.compression.cast import CastCompressor


class FP16Compressor(CastCompressor):
    """Floating-point tensors travel as float16 (Horovod: Compression.fp16)."""

    name = "fp16"
    wire_dtype = torch.float16
