"""Gradient compression: the Compressor contract, a registry, and the built-in compressors.

``create("topk:ratio=0.01", rank=..., seed=...)`` (or ``COMMLAYER_COMPRESSION``, or
``DistributedOptimizer(compression=...)``) picks one by name; see ``base.py`` for the contract
(what a compressor declares), ``factory.py`` for specs, and each compressor's module for its
math and paper. A built-in compressor is its module, imported here and listed once in
``BUILTINS``, which registers it: nothing else in commlayer names it.
"""

from commlayer.compression.auto import AutoCompressor
from commlayer.compression.base import (
    ENTRY_POINT_GROUP,
    Compressed,
    Compressor,
    CompressorBase,
    available,
    register,
    registered,
    unregister,
)
from commlayer.compression.bf16 import BF16Compressor
from commlayer.compression.efsignsgd import EFSignSGDCompressor
from commlayer.compression.error_feedback import ErrorFeedback
from commlayer.compression.factory import check_spec, create, spec_help
from commlayer.compression.fp16 import FP16Compressor
from commlayer.compression.none import NoneCompressor
from commlayer.compression.onebit import OneBitCompressor
from commlayer.compression.policy import DEFAULT_MIN_NUMEL, Policy
from commlayer.compression.powersgd import PowerSGDCompressor
from commlayer.compression.qsgd import QSGDCompressor
from commlayer.compression.randomk import RandomKCompressor
from commlayer.compression.topk import TopKCompressor

# The built-in compressors, one line each, registered under their ``name`` (the name of their
# module) in this order, the order error messages list them in.
BUILTINS: tuple[type[CompressorBase], ...] = (
    NoneCompressor,
    FP16Compressor,
    BF16Compressor,
    QSGDCompressor,
    TopKCompressor,
    RandomKCompressor,
    EFSignSGDCompressor,
    OneBitCompressor,
    PowerSGDCompressor,
    AutoCompressor,
)
for _builtin in BUILTINS:
    register(_builtin.name)(_builtin)


class Compression:
    """Horovod-style namespace: ``compression=commlayer.Compression.fp16``."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()


__all__ = [
    "AutoCompressor",
    "BUILTINS",
    "DEFAULT_MIN_NUMEL",
    "ENTRY_POINT_GROUP",
    "BF16Compressor",
    "Compressed",
    "Compression",
    "Compressor",
    "CompressorBase",
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
    "registered",
    "spec_help",
    "unregister",
]
