"""Kernels' CPU fast path, compiled by numba ``@njit`` (imported only when numba is present).

The merge is where torch is slow: it has no merge of two sorted lists, so the reference
concatenates and sorts (``torch.unique``), O((a + b) log(a + b)); the two-pointer merge here is
one linear pass. QSGD quantization and sign packing are one fused pass here where the reference
makes five to ten (abs, scale, floor, compare, sign, then one shift-or per packed code), each
writing a temporary as large as the input. Arguments are torch CPU tensors, passed to numba
as zero-copy numpy views. float16/bfloat16 values are not handled here (numba has no
bfloat16): the dispatcher sends them to the torch reference.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from commlayer.kernels.reference import index_dtype

DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


@numba.njit(cache=True, nogil=True)
def _merge(ia, va, ib, vb, out_i, out_v):  # type: ignore[no-untyped-def]
    i = j = n = 0
    while i < ia.size and j < ib.size:
        if ia[i] < ib[j]:
            out_i[n] = ia[i]
            out_v[n] = va[i]
            i += 1
        elif ib[j] < ia[i]:
            out_i[n] = ib[j]
            out_v[n] = vb[j]
            j += 1
        else:
            out_i[n] = ia[i]
            out_v[n] = va[i] + vb[j]
            i += 1
            j += 1
        n += 1
    while i < ia.size:
        out_i[n] = ia[i]
        out_v[n] = va[i]
        i += 1
        n += 1
    while j < ib.size:
        out_i[n] = ib[j]
        out_v[n] = vb[j]
        j += 1
        n += 1
    return n


@numba.njit(cache=True, nogil=True)
def _scatter_add(dense, idx, val):  # type: ignore[no-untyped-def]
    for i in range(idx.size):
        dense[idx[i]] += val[i]


# Blocks of 16: the largest |x| of a block first (no stores, no branch per element), and the
# block's indices only where it reaches the threshold (at top-k's ~1.5% candidates most blocks
# hold none); inside a block the index is stored unconditionally and the count advanced by the
# comparison, so neither loop has an unpredictable branch. NaN never passes (NaN >= t is False).
@numba.njit(cache=True, nogil=True)
def _threshold(x, threshold, out):  # type: ignore[no-untyped-def]
    n = 0
    size = x.size
    whole = size - size % 16
    for start in range(0, whole, 16):
        top = abs(x[start])
        for j in range(start + 1, start + 16):
            a = abs(x[j])
            top = a if a > top else top
        if top >= threshold:
            for j in range(start, start + 16):
                out[n] = j
                n += abs(x[j]) >= threshold
    for j in range(whole, size):
        out[n] = j
        n += abs(x[j]) >= threshold
    return n


# Error feedback's correction and top-k's pick in one read: e += g, then the indices where
# |e| >= threshold (the loop above, on the sum as it is written).
@numba.njit(cache=True, nogil=True)
def _add_threshold(e, g, threshold, out):  # type: ignore[no-untyped-def]
    n = 0
    size = e.size
    whole = size - size % 16
    for start in range(0, whole, 16):
        top = -1.0  # below every |e|
        for j in range(start, start + 16):
            e[j] += g[j]
            a = abs(e[j])
            top = a if a > top else top
        if top >= threshold:
            for j in range(start, start + 16):
                out[n] = j
                n += abs(e[j]) >= threshold
    for j in range(whole, size):
        e[j] += g[j]
        out[n] = j
        n += abs(e[j]) >= threshold
    return n


@numba.njit(cache=True, nogil=True)
def _qsgd_code(x, scale, rand, levels):  # type: ignore[no-untyped-def]
    # |x| * scale in x's dtype, as torch computes it; level - low, the fractional part, is
    # exact, so comparing it to rand gives torch's answer.
    level = abs(x) * scale
    low = np.floor(level)  # in x's dtype: math.floor (via double and int) was 4x slower
    step = min(np.int64(low) + (1 if rand < level - low else 0), levels)
    if x > 0:
        return levels + step
    if x < 0:
        return levels - step
    return levels


# Per bucket, then per element (an integer division per element, e // bucket, made these 2x
# slower than torch), and codes packed in a second loop: a shift-or carried from element to
# element ran 3x slower than the two simple loops (measured at 4M elements).
@numba.njit(cache=True, nogil=True)
def _qsgd_codes(x, scale, rand, bucket, levels, shift, out):  # type: ignore[no-untyped-def]
    for b in range(scale.size):
        s = scale[b]
        for e in range(b * bucket, (b + 1) * bucket):
            out[e] = _qsgd_code(x[e], s, rand[e], levels) - shift


@numba.njit(cache=True, nogil=True, inline="always")
def _uniform(index, key):  # type: ignore[no-untyped-def]
    # reference.uniform_hash, element ``index``: lowbias32 of (index ^ key), its top 24 bits.
    # In uint32 (wrapping products) and through int32 to float32: this vectorizes, 0.35 ns an
    # element; the same in uint64 with masks, converted from uint64, took 2-4 ns.
    v = np.uint32(index) ^ key
    v ^= v >> np.uint32(16)
    v = np.uint32(v * np.uint32(0x7FEB352D))
    v ^= v >> np.uint32(15)
    v = np.uint32(v * np.uint32(0x846CA68B))
    v ^= v >> np.uint32(16)
    return np.float32(np.int32(v >> np.uint32(8))) * np.float32(1.0 / 16777216.0)


@numba.njit(cache=True, nogil=True, inline="always")
def _qsgd_one(v, s, e, k, top, base):  # type: ignore[no-untyped-def]
    # element e's code: |v| * s in v's dtype (as torch computes it), rounded up where the draw
    # is below its fractional part, at most ``top``, signed, plus ``base``; float throughout up
    # to the one conversion (x86 without AVX-512 has no vector float -> int64), selects for the
    # rounding and the sign (each as likely as not: a branch would be mispredicted half the time)
    one, zero = np.float32(1.0), np.float32(0.0)
    level = abs(v) * s
    low = np.floor(level)
    t = low + (one if _uniform(e, k) < level - low else zero)
    step = t if t < top else top
    sign = one if v > 0 else (-one if v < 0 else zero)
    return np.int32(base + sign * step)


# QSGD's codes with the uniform draws made in the loop (no rand tensor), from the unpadded
# flat ``x``: the rest of the last bucket is coded as zeros. The ``whole`` buckets' inner loop
# has a constant trip count (``bucket``): with the short last bucket's bound in it, or with
# ``whole`` computed here, LLVM did not vectorize it (5 passes of memory bandwidth against
# 1.5, measured at 4 M elements).
@numba.njit(cache=True, nogil=True)
def _qsgd_hashed(x, scale, whole, bucket, levels, shift, key, out):  # type: ignore[no-untyped-def]
    count = x.size
    k = np.uint32(key)
    top = np.float32(levels)
    base = np.float32(levels - shift)
    one, zero = np.float32(1.0), np.float32(0.0)
    for b in range(whole):  # ``whole`` from the caller: x.size // bucket here did not vectorize
        s = scale[b]
        start = b * bucket
        for i in range(bucket):  # _qsgd_one written out: called here, this did not vectorize
            e = start + i
            v = x[e]
            level = abs(v) * s
            low = np.floor(level)
            t = low + (one if _uniform(e, k) < level - low else zero)
            step = t if t < top else top
            sign = one if v > 0 else (-one if v < 0 else zero)
            out[e] = np.int32(base + sign * step)
    if whole < scale.size:
        start = whole * bucket
        s = scale[whole]
        for e in range(start, count):
            out[e] = _qsgd_one(x[e], s, e, k, top, base)
        for e in range(count, start + bucket):
            out[e] = levels - shift


# Every rank's QSGD codes (rows of ``codes``) decoded and summed into ``out`` in one write:
# bucket by bucket, each record's level times its step in out's dtype, added in rank order,
# then divided by ``divisor``: the operations, and so the bits, of decoding each record and
# summing the decoded tensors. Nothing is written when a record holds a level above
# ``levels``: returns (largest |level|, first such record or -1).
@numba.njit(cache=True, nogil=True, inline="always")
def _qsgd_sum_bucket(codes, steps, b, start, size, shift, divisor, out):  # type: ignore[no-untyped-def]
    s = steps[0, b]
    for i in range(size):
        # a float32 level (exact: |level| <= 32767) times a step of out's dtype: the product,
        # rounded, in out's dtype, as torch multiplies
        out[start + i] = np.float32(np.int32(codes[0, start + i]) - shift) * s
    for r in range(1, codes.shape[0]):
        s = steps[r, b]
        for i in range(size):
            out[start + i] += np.float32(np.int32(codes[r, start + i]) - shift) * s
    if divisor != 1.0:
        for i in range(size):
            out[start + i] /= divisor


@numba.njit(cache=True, nogil=True)
def _qsgd_sum(codes, steps, bucket, levels, shift, divisor, out):  # type: ignore[no-untyped-def]
    top = 0
    for r in range(codes.shape[0]):
        mine = 0
        for e in range(codes.shape[1]):
            mine = max(mine, abs(np.int64(codes[r, e]) - shift))
        top = max(top, mine)
        if mine > levels:
            return top, r
    count = out.size
    if count == 0:
        return top, -1
    for b in range(steps.shape[1]):
        start = b * bucket
        if start + bucket <= count:  # a whole bucket: a constant trip count, which vectorizes
            _qsgd_sum_bucket(codes, steps, b, start, bucket, shift, divisor, out)
        else:
            _qsgd_sum_bucket(codes, steps, b, start, count - start, shift, divisor, out)
    return top, -1


# Whole bytes with a constant count of codes each (2 at 4 bits, 4 at 2 bits), which LLVM
# vectorizes, then the last partial byte: the generic loop's per-byte trip count (min(...))
# kept it scalar, 3x the time of QSGD 8-bit's quantizing for 4-bit's (compress_cost.py).
@numba.njit(cache=True, nogil=True)
def _pack(codes, bits, out):  # type: ignore[no-untyped-def]
    per_byte = 8 // bits
    full = min(out.size, codes.size // per_byte)
    if bits == 4:
        for o in range(full):
            out[o] = codes[2 * o] | (codes[2 * o + 1] << 4)
    elif bits == 2:
        for o in range(full):
            b = 4 * o
            out[o] = codes[b] | (codes[b + 1] << 2) | (codes[b + 2] << 4) | (codes[b + 3] << 6)
    else:
        full = 0
    for o in range(full, out.size):
        acc = 0
        base = o * per_byte
        for j in range(min(per_byte, codes.size - base)):
            acc |= codes[base + j] << (j * bits)
        out[o] = acc


@numba.njit(cache=True, nogil=True)
def _unpack(packed, bits, out):  # type: ignore[no-untyped-def]
    per_byte, mask = 8 // bits, (1 << bits) - 1
    full = min(packed.size, out.size // per_byte)
    if bits == 4:
        for o in range(full):
            p = packed[o]
            out[2 * o] = p & 15
            out[2 * o + 1] = p >> 4
    elif bits == 2:
        for o in range(full):
            p = packed[o]
            b = 4 * o
            out[b] = p & 3
            out[b + 1] = (p >> 2) & 3
            out[b + 2] = (p >> 4) & 3
            out[b + 3] = p >> 6
    else:
        full = 0
    for o in range(full, packed.size):
        base = o * per_byte
        for j in range(min(per_byte, out.size - base)):
            out[base + j] = (packed[o] >> (j * bits)) & mask


@numba.njit(cache=True, nogil=True)
def _scale_levels(codes, step, bucket, shift, out):  # type: ignore[no-untyped-def]
    top = 0
    for b in range(step.size):
        s = step[b]
        for e in range(b * bucket, (b + 1) * bucket):
            signed = np.int64(codes[e]) - shift
            top = max(top, abs(signed))
            out[e] = signed
            out[e] *= s  # in out's dtype, as torch multiplies
    return top


@numba.njit(cache=True, nogil=True)
def _pack_signs(x, words):  # type: ignore[no-untyped-def]
    for w in range(words.size):
        acc = 0
        for t in range(min(32, x.size - 32 * w)):
            if x[32 * w + t] >= 0:
                acc |= 1 << t
        words[w] = acc - (1 << 32) if acc >= 1 << 31 else acc  # the int32 with those bits


@numba.njit(cache=True, nogil=True)
def _decode_signs(words, positive, negative, out):  # type: ignore[no-untyped-def]
    for w in range(words.size):
        word = np.int64(words[w])
        for t in range(min(32, out.size - 32 * w)):
            out[32 * w + t] = positive if (word >> t) & 1 else negative


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def merge_sum(
    idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor, val_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    total = idx_a.numel() + idx_b.numel()
    out_i = torch.empty(total, dtype=idx_a.dtype)
    out_v = torch.empty(total, dtype=val_a.dtype)
    n = _merge(_np(idx_a), _np(val_a), _np(idx_b.to(idx_a.dtype)), _np(val_b.to(val_a.dtype)),
               out_i.numpy(), out_v.numpy())  # fmt: skip
    return out_i[:n], out_v[:n]


def scatter_add_(dense: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if not dense.is_contiguous():
        raise ValueError("scatter_add_: the dense buffer must be contiguous")
    _scatter_add(dense.numpy(), _np(idx), _np(val.to(dense.dtype)))
    return dense


def threshold_select(x: torch.Tensor, threshold: float) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=index_dtype(x.numel()))
    n = _threshold(_np(x), x.new_tensor(threshold).item(), out.numpy())
    return out[:n].clone()  # not a view of a buffer as large as x


def add_threshold_select_(e: torch.Tensor, g: torch.Tensor, threshold: float) -> torch.Tensor:
    if not e.is_contiguous():
        raise ValueError("add_threshold_select_: the accumulator must be contiguous")
    out = torch.empty(e.numel(), dtype=index_dtype(e.numel()))
    flat = e.view(-1)
    n = _add_threshold(flat.numpy(), _np(g.reshape(-1).to(e.dtype)), e.new_tensor(threshold).item(),
                       out.numpy())  # fmt: skip
    return out[:n].clone()


def qsgd_quantize_hashed(
    flat: torch.Tensor, scale: torch.Tensor, bucket: int, levels: int, bits: int, key: int
) -> torch.Tensor:
    padded = scale.numel() * bucket
    args = (_np(flat), _np(scale), flat.numel() // bucket, bucket, levels)
    if bits in (8, 16):
        out = torch.empty(padded, dtype=torch.int16 if bits == 16 else torch.uint8)
        _qsgd_hashed(*args, levels if bits == 16 else 0, key, out.numpy())
        return out
    codes = torch.empty(padded, dtype=torch.uint8)
    _qsgd_hashed(*args, 0, key, codes.numpy())
    out = torch.empty(-(-padded * bits // 8), dtype=torch.uint8)
    _pack(codes.numpy(), bits, out.numpy())
    return out


def qsgd_dequantize_sum_(
    records: list[torch.Tensor], steps: list[torch.Tensor], levels: int, bits: int, bucket: int,
    divisor: float, out: torch.Tensor,
) -> tuple[int, int]:  # fmt: skip
    padded = steps[0].numel() * bucket
    dtype = torch.int16 if bits == 16 else torch.uint8
    codes = torch.empty(len(records), padded, dtype=dtype)
    for row, packed in zip(codes, records):
        if bits in (8, 16):
            row.copy_(packed.view(-1))
        else:
            _unpack(_np(packed), bits, row.numpy())
    stacked = torch.stack([s.to(out.dtype) for s in steps])
    shift = 0 if bits == 16 else levels
    top, bad = _qsgd_sum(codes.numpy(), stacked.numpy(), bucket, levels, shift, float(divisor),
                         out.view(-1).numpy())  # fmt: skip
    return int(top), int(bad)


def qsgd_quantize(
    x: torch.Tensor, scale: torch.Tensor, rand: torch.Tensor, levels: int, bits: int
) -> torch.Tensor:
    flat, bucket = x.reshape(-1), x.shape[1]
    args = (_np(flat), _np(scale), _np(rand.reshape(-1)), bucket, levels)
    if bits in (8, 16):  # codes are the payload: int16 levels, or codes one to a byte
        out = torch.empty(flat.numel(), dtype=torch.int16 if bits == 16 else torch.uint8)
        _qsgd_codes(*args, levels if bits == 16 else 0, out.numpy())
        return out
    codes = torch.empty(flat.numel(), dtype=torch.uint8)
    _qsgd_codes(*args, 0, codes.numpy())
    out = torch.empty(-(-flat.numel() * bits // 8), dtype=torch.uint8)
    _pack(codes.numpy(), bits, out.numpy())
    return out


def qsgd_dequantize(
    packed: torch.Tensor, step: torch.Tensor, levels: int, bits: int, bucket: int
) -> tuple[torch.Tensor, int]:
    out = torch.empty(step.numel() * bucket, dtype=step.dtype)
    codes = _np(packed)
    if bits not in (8, 16):
        codes = np.empty(out.numel(), dtype=np.uint8)
        _unpack(_np(packed), bits, codes)
    top = _scale_levels(codes, _np(step), bucket, 0 if bits == 16 else levels, out.numpy())
    return out, int(top)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    words = torch.empty(-(-flat.numel() // 32), dtype=torch.int32)
    _pack_signs(_np(flat), words.numpy())
    return words


def decode_signs(
    words: torch.Tensor, count: int, positive: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    out = torch.empty(count, dtype=positive.dtype)
    _decode_signs(_np(words), positive.item(), negative.item(), out.numpy())
    return out
