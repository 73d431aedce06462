"""Kernels' torch reference: the ground truth every other implementation is tested against.

Sparse lists are (indices, values) pairs of 1-D tensors with strictly increasing indices
(int32 below 2^31 elements, int64 above: ``index_dtype``). Works on any device torch does.

Bit packing: small unsigned codes stored 8 // bits to a byte, little-endian within a byte
(code j of a group sits at bits [j*bits, (j+1)*bits)); signs one bit per element (1 = x >= 0,
so 0 and -0 count as non-negative, NaN as negative), every four bytes viewed as one int32
word, so element 32 w + t is bit t of word w.
"""

from __future__ import annotations

import torch


def index_dtype(numel: int) -> torch.dtype:
    """int32 for buffers below 2^31 elements (half the index bytes on the wire), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def merge_sum(
    idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor, val_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of two sorted lists; values at an index both hold are summed (a + b)."""
    idx = torch.cat([idx_a, idx_b])
    unique, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    out = torch.zeros(unique.numel(), dtype=val_a.dtype, device=val_a.device)
    # index_add_ adds in input order: a's value first, then b's, so the result is a + b.
    out.index_add_(0, inverse, torch.cat([val_a, val_b.to(val_a.dtype)]))
    return unique.to(idx_a.dtype), out


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """dense[idx[i]] += val[i] for every i (repeated indices accumulate); returns dense."""
    return dense.index_add_(0, idx, val.to(dense.dtype))


def densify(idx: torch.Tensor, val: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=val.dtype, device=val.device)
    return scatter_add_(out, idx, val)


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (ascending) of the entries with |x| >= threshold."""
    return torch.nonzero(x.abs() >= threshold).view(-1).to(index_dtype(x.numel()))


def add_threshold_select_(e: torch.Tensor, g: torch.Tensor, threshold: float) -> torch.Tensor:
    """``e += g`` in place, then the indices (ascending) where |e| >= threshold."""
    e.add_(g.view_as(e))
    return threshold_select(e.view(-1), threshold)


_M32 = 0xFFFFFFFF


def _mul32(v: torch.Tensor, c: int) -> torch.Tensor:
    """(v * c) mod 2^32 for int64 ``v`` < 2^32, c < 2^32, without int64 overflow (halves of c)."""
    low = v * (c & 0xFFFF)
    high = ((v * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def uniform_hash(
    key: int, count: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``count`` uniform numbers in [0, 1) of ``dtype``, element i a function of (i, key) only:
    the lowbias32 hash (Chris Wellons' hash-prospector, bias 0.17) of ``i ^ key`` (a bijection
    of i for one key), its top 24 bits over 2^24 (exact in float32). Counter-based: any
    kernel, on any device, draws element i alone, and draws what this does bit for bit."""
    v = torch.arange(count, dtype=torch.int64, device=device) ^ (key & _M32)
    v ^= v >> 16
    v = _mul32(v, 0x7FEB352D)
    v ^= v >> 15
    v = _mul32(v, 0x846CA68B)
    v ^= v >> 16
    return (v >> 8).to(dtype) * 2.0**-24


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude as a sorted sparse list (ties: torch.topk's pick)."""
    k = min(k, x.numel())
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return idx.to(index_dtype(x.numel())), x[idx]


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
    # contiguous_format: a plain clone keeps an empty column's stride (per_byte), which
    # pack_signs' int32 view then refuses; a non-empty column is copied contiguous either way.
    packed = grouped[:, 0].clone(memory_format=torch.contiguous_format)
    for j in range(1, per_byte):
        packed.bitwise_or_(grouped[:, j] << (j * bits))
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` uint8 codes."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:count]
    mask = (1 << bits) - 1
    out = torch.empty(packed.numel(), per_byte, dtype=torch.uint8, device=packed.device)
    for j in range(per_byte):
        torch.bitwise_and(packed >> (j * bits), mask, out=out[:, j])
    return out.view(-1)[:count]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element (1 where x >= 0) -> ceil(n / 32) int32 words."""
    packed = pack_bits((x.reshape(-1) >= 0).view(torch.uint8), 1)
    pad = -packed.numel() % 4
    if pad:
        packed = torch.cat([packed, packed.new_zeros(pad)])
    return packed.view(torch.int32)


def unpack_signs(words: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a bool tensor of ``count`` elements, True = x >= 0."""
    return unpack_bits(words.contiguous().view(torch.uint8), 1, count).view(torch.bool)


def decode_signs(
    words: torch.Tensor, count: int, positive: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    """``count`` elements: ``positive`` where the sign bit is 1, else ``negative`` (0-dim
    tensors of the output dtype)."""
    return torch.where(unpack_signs(words, count), positive, negative)


def qsgd_quantize(
    x: torch.Tensor, scale: torch.Tensor, rand: torch.Tensor, levels: int, bits: int
) -> torch.Tensor:
    """QSGD's stochastic rounding of ``x`` (buckets x bucket) to signed levels, packed.

    level = |x| * scale (scale: levels / ||bucket||, 0 for a zero bucket, per row), rounded up
    where ``rand`` (uniform [0, 1), x's shape) < its fractional part, at most ``levels``
    (float rounding can put |x| * scale a hair above levels), times sign(x). Returns
    int16 levels for ``bits`` = 16, else the codes level + ``levels`` packed ``bits`` to a code.
    """
    level = x.abs().mul_(scale[:, None])
    low = level.floor()
    level.sub_(low)  # now the probability of rounding up
    # clamp: |x| * (levels / norm) can round above levels when x holds the bucket's norm
    signed = low.add_(rand < level).clamp_(max=levels).mul_(torch.sign(x))
    if bits == 16:
        return signed.to(torch.int16).view(-1)
    return pack_bits(signed.add_(levels).to(torch.uint8).view(-1), bits)


def qsgd_dequantize(
    packed: torch.Tensor, step: torch.Tensor, levels: int, bits: int, bucket: int
) -> tuple[torch.Tensor, int]:
    """Inverse of :func:`qsgd_quantize` given ``step`` = ||bucket|| / levels per bucket: the
    buckets x bucket values (flat, step's dtype) and the largest |level| met (a valid payload
    has none above ``levels``)."""
    buckets = step.numel()
    if bits == 16:
        signed = packed.to(step.dtype)
    else:
        signed = unpack_bits(packed, bits, buckets * bucket).to(step.dtype).sub_(levels)
    top = int(signed.abs().max()) if signed.numel() else 0
    return signed.view(buckets, bucket).mul_(step[:, None]).view(-1), top


def qsgd_dequantize_sum_(
    records: list[torch.Tensor], steps: list[torch.Tensor], levels: int, bits: int, bucket: int,
    divisor: float, out: torch.Tensor,
) -> tuple[int, int]:  # fmt: skip
    """Every record decoded (:func:`qsgd_dequantize`, its own ``steps``), cast to out's dtype,
    summed in record order and divided by ``divisor``, into the flat ``out`` (its first
    ``out.numel()`` elements of each record). Returns (largest |level|, the first record with a
    level above ``levels`` or -1); ``out`` is untouched when there is one."""
    parts, top = [], 0
    for r, (packed, step) in enumerate(zip(records, steps)):
        values, mine = qsgd_dequantize(packed, step, levels, bits, bucket)
        top = max(top, mine)
        if mine > levels:
            return top, r
        parts.append(values[: out.numel()].to(out.dtype))
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    if divisor != 1:
        total.div_(divisor)
    out.view(-1).copy_(total)
    return top, -1
