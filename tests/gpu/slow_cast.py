"""A float16 compressor that makes a missing device order visible in the values, for the GPU
tests of issue 35's item 6 (tests/gpu/test_stream_order_cuda.py, test_ddp_hook_cuda.py).

It zeroes the tensor it compresses (a gradient, a DDP bucket) once cast, on the caller's stream,
and queues a ~0.1 s device sleep before the cast back, on whatever stream decompresses: until
the reduced value is written back, the tensor holds zeros. A consumer (the optimizer's step,
DDP's copy into the gradients) whose stream is not ordered after that write reads zeros, and the
parameter does not move."""

from __future__ import annotations

from typing import Any

import torch

from commlayer.compression import Compressed
from commlayer.compression.fp16 import FP16Compressor

SLEEP_CYCLES = 200_000_000  # ~0.1 s at the 1.4-2 GHz clocks of recent GPUs


class SlowZeroingFP16(FP16Compressor):
    """fp16, with the compressed tensor zeroed and the decompress delayed (module docstring)."""

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        compressed = super().compress(tensor, name)
        tensor.zero_()
        return compressed

    def decompress(self, compressed: Compressed | torch.Tensor, ctx: Any = None) -> torch.Tensor:
        torch.cuda._sleep(SLEEP_CYCLES)
        return super().decompress(compressed, ctx)


def fp16_exact(n: int) -> torch.Tensor:
    """n float32 values that float16 holds exactly, and their halves too (1..7 and 0.5..3.5)."""
    return (torch.arange(n) % 7 + 1).float()
