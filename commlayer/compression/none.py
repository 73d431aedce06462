"""The identity compressor: the gradient goes on the wire as it is."""

from __future__ import annotations

from typing import ClassVar

import torch

from commlayer.compression.base import Compressed, register


@register("none")
class NoneCompressor:
    """No compression (Horovod: Compression.none)."""

    name: ClassVar[str] = "none"
    summable: ClassVar[bool] = True
    compresses_small_tensors: ClassVar[bool] = True

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        return Compressed([tensor])

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        return compressed.payload[0]
