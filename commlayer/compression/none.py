"""The identity compressor: the gradient goes on the wire as it is."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from commlayer.compression.base import Compressed, horovod_args


class NoneCompressor:
    """No compression (Horovod: Compression.none)."""

    name: ClassVar[str] = "none"
    summable: ClassVar[bool] = True
    identity: ClassVar[bool] = True
    compresses_small_tensors: ClassVar[bool] = True

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        return Compressed([tensor])

    def decompress(self, compressed: Compressed | torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """``decompress(compressed)``, or horovod.torch's ``decompress(tensor, ctx)``."""
        return horovod_args(compressed, ctx).payload[0]

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return numel * element_bytes
