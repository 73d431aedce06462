"""Cast compressors: send floating-point gradients as float16 or bfloat16 (2 bytes a value).

Summable: ranks allreduce the cast payload; callers pre-divide (prescale by 1/n) so a sum of n
float16 gradients does not overflow. bfloat16 keeps float32's exponent range (no overflow) with
8 bits of mantissa; float16 keeps 11 bits of mantissa with a max of 65504.
"""

from __future__ import annotations

from typing import Any

import torch

from commlayer.compression.base import (
    DECOMPRESS_INTO,
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    horovod_args,
)


class CastCompressor(CompressorBase):
    """Base of compressors that send floating-point tensors in a narrower dtype."""

    summable = True
    capabilities = frozenset({WIRE_BYTES, DECOMPRESS_INTO})
    # A cast has no per-tensor cost, so (as in Horovod) small tensors are cast too.
    compresses_small_tensors = True
    wire_dtype: torch.dtype  # the subclass's

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        if not tensor.is_floating_point() or tensor.dtype == self.wire_dtype:
            return Compressed([tensor], None)
        return Compressed([tensor.to(self.wire_dtype)], tensor.dtype)

    def decompress(self, compressed: Compressed | torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """``decompress(compressed)``, or horovod.torch's ``decompress(tensor, ctx)``."""
        compressed = horovod_args(compressed, ctx)
        payload = compressed.payload[0]
        return payload if compressed.ctx is None else payload.to(compressed.ctx)

    def decompress_into(self, compressed: Compressed, out: torch.Tensor) -> None:
        """The reduced payload into ``out`` in one converting copy (the communicator's path:
        no float32 temporary, then a second copy)."""
        payload = compressed.payload[0]
        if payload is not out:
            out.copy_(payload.view(out.shape))

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        """A floating-point tensor's bytes as ``wire_dtype``."""
        return numel * self.wire_dtype.itemsize
