"""Bit packing: small unsigned codes stored 8 // bits to a byte, and signs 32 to an int32.

The torch code lives in commlayer/kernels/reference.py (the kernels' ground truth, layout
described there); the compressors call the dispatched kernels (commlayer.kernels).
"""

from __future__ import annotations

from commlayer.kernels.reference import (
    PACKABLE_BITS,
    pack_bits,
    pack_signs,
    unpack_bits,
    unpack_signs,
)

__all__ = [
    "PACKABLE_BITS",
    "pack_bits",
    "pack_signs",
    "packed_bytes",
    "sign_words",
    "unpack_bits",
    "unpack_signs",
]


def packed_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def sign_words(count: int) -> int:
    return -(-count // 32)
