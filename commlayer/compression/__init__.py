"""Gradient compression: the Compressor contract, a registry, and the built-in compressors.

``create("topk:ratio=0.01", rank=..., seed=...)`` (or ``COMMLAYER_COMPRESSION``, or
``DistributedOptimizer(compression=...)``) picks one by name; see ``base.py`` for the contract,
``factory.py`` for specs, and each compressor's module for its math and paper.
"""

from commlayer.compression.auto import AutoCompressor
from commlayer.compression.base import (
    ENTRY_POINT_GROUP,
    Compressed,
    Compressor,
    available,
    register,
)
from commlayer.compression.bf16 import BF16Compressor
from commlayer.compression.efsignsgd import EFSignSGDCompressor
from commlayer.compression.error_feedback import ErrorFeedback
from commlayer.compression.factory import SPEC_HELP, check_spec, create
from commlayer.compression.fp16 import FP16Compressor
from commlayer.compression.none import NoneCompressor
from commlayer.compression.onebit import OneBitCompressor
from commlayer.compression.policy import DEFAULT_MIN_NUMEL, Policy
from commlayer.compression.powersgd import PowerSGDCompressor
from commlayer.compression.qsgd import QSGDCompressor
from commlayer.compression.randomk import RandomKCompressor
from commlayer.compression.topk import TopKCompressor


class Compression:
    """Horovod-style namespace: ``compression=commlayer.Compression.fp16``."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()


__all__ = [
    "AutoCompressor",
    "DEFAULT_MIN_NUMEL",
    "ENTRY_POINT_GROUP",
    "SPEC_HELP",
    "BF16Compressor",
    "Compressed",
    "Compression",
    "Compressor",
    "EFSignSGDCompressor",
    "ErrorFeedback",
    "FP16Compressor",
    "NoneCompressor",
    "OneBitCompressor",
    "Policy",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "TopKCompressor",
    "available",
    "check_spec",
    "create",
    "register",
]
