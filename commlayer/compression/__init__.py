"""Gradient compression: the Compressor contract, a registry, and the built-in compressors."""

from commlayer.compression.base import Compressed, Compressor, available, create, register
from commlayer.compression.bf16 import BF16Compressor
from commlayer.compression.fp16 import FP16Compressor
from commlayer.compression.none import NoneCompressor


class Compression:
    """Horovod-style namespace: ``compression=commlayer.Compression.fp16``."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()


__all__ = [
    "Compressed",
    "Compressor",
    "Compression",
    "available",
    "create",
    "register",
    "NoneCompressor",
    "FP16Compressor",
    "BF16Compressor",
]
