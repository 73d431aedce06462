"""The identity compressor: the gradient goes on the wire as it is."""

from __future__ import annotations

from typing import Any

import torch

from commlayer.compression.base import (
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    horovod_args,
)


class NoneCompressor(CompressorBase):
    """No compression (Horovod: Compression.none)."""

    name = "none"
    summable = True
    capabilities = frozenset({WIRE_BYTES})
    identity = True
    compresses_small_tensors = True

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        return Compressed([tensor])

    def decompress(self, compressed: Compressed | torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """``decompress(compressed)``, or horovod.torch's ``decompress(tensor, ctx)``."""
        return horovod_args(compressed, ctx).payload[0]

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return numel * element_bytes
