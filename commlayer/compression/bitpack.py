"""Bit packing: small unsigned codes stored 8 // bits to a byte, and signs 32 to an int32.

Layout is little-endian within a byte: code j of a group sits at bits [j*bits, (j+1)*bits).
``pack_signs`` packs one bit per element (1 = non-negative) into bytes and views every four as
one int32, so 32 signs travel in one int32 word, as in 1-bit SGD and EF-SignSGD.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``codes`` (each < 2**bits) -> ceil(n * bits / 8) bytes."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits!r}")
    per_byte = 8 // bits
    codes = codes.reshape(-1)
    if per_byte == 1:
        return codes.clone()
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    grouped = codes.view(-1, per_byte)
    packed = grouped[:, 0].clone()
    for j in range(1, per_byte):
        packed.bitwise_or_(grouped[:, j] << (j * bits))
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` uint8 codes."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:count]
    mask = (1 << bits) - 1
    out = torch.empty(packed.numel(), per_byte, dtype=torch.uint8)
    for j in range(per_byte):
        torch.bitwise_and(packed >> (j * bits), mask, out=out[:, j])
    return out.view(-1)[:count]


def packed_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """One bit per element (1 where >= 0) -> ceil(n / 32) int32 words."""
    packed = pack_bits((tensor.reshape(-1) >= 0).view(torch.uint8), 1)
    pad = -packed.numel() % 4
    if pad:
        packed = torch.cat([packed, packed.new_zeros(pad)])
    return packed.view(torch.int32)


def unpack_signs(words: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a bool tensor of ``count`` elements, True = non-negative."""
    return unpack_bits(words.contiguous().view(torch.uint8), 1, count).view(torch.bool)


def sign_words(count: int) -> int:
    return -(-count // 32)
