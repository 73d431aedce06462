"""QSGD: unbiased stochastic quantization to s levels per bucket (Alistarh et al., NeurIPS 2017).

Math (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", eq. (1)-(2)): the flat tensor is cut into buckets v of ``bucket`` elements; each
element becomes

    Q(v_i) = ||v||_2 * sign(v_i) * xi_i / s,  xi_i = l + 1 with probability |v_i| s/||v|| - l,
                                              else l,  where l = floor(|v_i| s / ||v||_2),

so E[Q(v)] = v (unbiased) and E||Q(v) - v||^2 <= min(b / s^2, sqrt(b) / s) * ||v||^2 (Lemma 3.1,
b = bucket size). On the wire: the signed level xi_i * sign(v_i) + s in [0, 2s] packed into the
fewest of 2, 4, 8 or 16 bits (``levels=127``: 8 bits, ``levels=7``: 4 bits, ``levels=1``: 2
bits), plus one float32 norm per bucket; 8-bit with 512-element buckets is 4.03x smaller than
float32.

Reduction: allgather of every rank's payload, each decoded and summed locally (not summable:
the sum of two quantized vectors is not a quantized vector). Chosen over scatter-reduce-
allgather with re-quantization because it quantizes once, so the result stays unbiased with
exactly the variance above (re-quantizing partial sums adds a second error per hop), and it
reuses the allgather the engine already has. The cost grows with the ranks: each rank
receives n - 1 payloads of ~1.008 bytes per element at 8 bits, against 8 (n - 1) / n bytes for
a float32 ring allreduce, so 8-bit QSGD moves fewer bytes up to 7 ranks, 4-bit up to 15.

Quantizing with packing, and decoding with summing, are kernels (commlayer.kernels: the torch
reference, the CUDA kernels on a GPU, and on the CPU numba: one read of the gradient after its
norms, the random numbers drawn inside the loop; every rank's record decoded and summed into
the gradient in one write). The random numbers are counter-based
(``kernels.reference.uniform_hash``): element i of a call draws a hash of (i, key), the key a
hash of (seed, rank, the compressor's call count). Any kernel on any device draws the same
numbers without a generator's sequence or a tensor of draws, so the payload is the same bits
for the same seed, rank, call and norms (a CPU rank's and a CUDA rank's too). Their
resolution is 2^-24, so the probability of rounding up is off by less than 2^-24: a bias of
under 6e-8 of a level step, negligible against the rounding's own variance.
"""

from __future__ import annotations

import math

import torch

from commlayer import kernels
from commlayer.common.errors import PayloadError
from commlayer.compression import bitpack
from commlayer.compression.base import (
    DECOMPRESS_SUM,
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    RecordError,
    check_positive_int,
    compute_dtype,
    expect_finite,
    expect_numel,
    stable_seed,
)


def _bits_for(levels: int) -> int:
    """Fewest packable bits for 2 * levels + 1 codes."""
    needed = math.ceil(math.log2(2 * levels + 1))
    return next(b for b in (2, 4, 8, 16) if b >= needed)


class QSGDCompressor(CompressorBase):
    """Unbiased stochastic quantization to ``levels`` levels per ``bucket`` elements."""

    name = "qsgd"
    summable = False
    capabilities = frozenset({WIRE_BYTES, DECOMPRESS_SUM})
    biased = False

    def __init__(
        self, levels: int = 127, bucket: int = 512, seed: int = 0, process_rank: int | None = None
    ) -> None:
        """``process_rank``: this process's rank, passed in by ``create`` (None: 0, unless
        ``create(this, rank=r)`` binds it before the first ``compress``)."""
        self.levels = check_positive_int(levels, "levels")
        if self.levels > 32767:
            raise ValueError(f"levels must be <= 32767 (16 bits), got {levels!r}")
        self.bucket = check_positive_int(bucket, "bucket")
        self.bits = _bits_for(self.levels)
        self._seed = seed
        self.process_rank = process_rank
        self._calls = 0  # the draws' counter: one key per compress call

    def bind_rank(self, rank: int) -> None:
        """This process's rank, where it was made without one."""
        if self.process_rank is None:
            self.process_rank = rank

    def _key(self) -> int:
        # Per rank, so the ranks' rounding noise is independent and averages out; per call, so
        # no two calls round with the same numbers. No global RNG is read or advanced.
        self._calls += 1
        return stable_seed("qsgd", self._seed, self.process_rank or 0, self._calls)

    def _norms(self, flat: torch.Tensor) -> torch.Tensor:
        """||bucket||_2 of each bucket of ``flat``, the last one short (what zeros would add
        is nothing): no padded copy of the tensor."""
        count = flat.numel()
        whole = count // self.bucket
        if whole * self.bucket == count and count:
            return torch.linalg.vector_norm(flat.view(whole, self.bucket), dim=1)
        norms = flat.new_empty(whole + 1)
        torch.linalg.vector_norm(flat[: whole * self.bucket].view(whole, self.bucket), dim=1,
                                 out=norms[:whole])  # fmt: skip
        norms[whole] = torch.linalg.vector_norm(flat[whole * self.bucket :])
        return norms

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1).to(compute_dtype(tensor.dtype)).contiguous()
        count = flat.numel()
        norms = self._norms(flat)
        scale = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms))
        packed = kernels.qsgd_quantize_hashed(
            flat, scale, self.bucket, self.levels, self.bits, self._key()
        )
        return Compressed([packed, norms.float()], (tensor.shape, tensor.dtype, count))

    def check_payload(self, compressed: Compressed) -> tuple[torch.Tensor, torch.Tensor]:
        """A peer's (packed levels, norms), their lengths and the norms checked against this
        rank's ctx (the levels are checked by the decoding kernel)."""
        _, _, count = compressed.ctx
        packed, norms = compressed.payload
        buckets = max(1, -(-count // self.bucket))
        padded = buckets * self.bucket
        expect_numel(norms, buckets, "qsgd norms")
        expect_finite(norms, "qsgd norm", nonnegative=True)
        expect = padded if self.bits == 16 else bitpack.packed_bytes(padded, self.bits)
        expect_numel(packed, expect, "qsgd levels" if self.bits == 16 else "qsgd packed levels")
        return packed, norms

    def _step(self, norms: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # A tensor divisor, not the int: torch on CUDA divides by a Python number as a product
        # with its reciprocal, one float32 unit off the CPU's division for some norms (seen on
        # an H200: float64 results 7e-8 apart); element by element both devices divide exactly.
        return (norms / torch.full_like(norms, self.levels)).to(compute_dtype(dtype))

    def decompress_sum_(self, records: list[Compressed], out: torch.Tensor, divisor: float) -> None:
        """``out`` (flat, contiguous, the tensor's dtype) = the sum of every record decoded, over
        ``divisor``: the bits of decoding each and summing, in one write of ``out`` with numba.
        A malformed record raises :class:`RecordError` naming it, ``out`` untouched."""
        checked = []
        for index, record in enumerate(records):
            try:
                checked.append(self.check_payload(record))
            except PayloadError as exc:
                raise RecordError(index, str(exc)) from None
        dtype = records[0].ctx[1]
        steps = [self._step(norms, dtype) for _, norms in checked]
        top, bad = kernels.qsgd_dequantize_sum_(
            [packed for packed, _ in checked], steps, self.levels, self.bits, self.bucket,
            divisor, out,
        )  # fmt: skip
        if bad >= 0:
            raise RecordError(bad, f"qsgd level {top:g} exceeds levels={self.levels}")

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype, count = compressed.ctx
        packed, norms = self.check_payload(compressed)
        values, top = kernels.qsgd_dequantize(
            packed, self._step(norms, dtype), self.levels, self.bits, self.bucket
        )
        if top > self.levels:
            raise PayloadError(f"qsgd level {top:g} exceeds levels={self.levels}")
        return values[:count].reshape(shape).to(dtype)

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        buckets = max(1, -(-numel // self.bucket))
        return bitpack.packed_bytes(buckets * self.bucket, self.bits) + 4 * buckets
