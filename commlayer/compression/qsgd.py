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

Quantizing with packing, and unpacking with scaling, are kernels (commlayer.kernels: the torch
reference, one fused numba pass on the CPU, the CUDA kernels on a GPU); the random numbers come
from torch's CPU generator whichever kernel runs and whichever device the tensor is on, so the
payload is the same bits for the same seed, rank and norms (a CUDA tensor's draws are copied
to its device: a host-to-device copy the size of the bucketed tensor, logged once).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from commlayer import kernels
from commlayer.compression import bitpack
from commlayer.compression.base import (
    Compressed,
    check_positive_int,
    compute_dtype,
    expect_finite,
    expect_numel,
    host_work,
    register,
)
from commlayer.errors import PayloadError

_HOST_DRAWS = (
    "its stochastic-rounding draws are made on the CPU (the same bits as a CPU rank's) and "
    "copied to the device, one value per element"
)


def _bits_for(levels: int) -> int:
    """Fewest packable bits for 2 * levels + 1 codes."""
    needed = math.ceil(math.log2(2 * levels + 1))
    return next(b for b in (2, 4, 8, 16) if b >= needed)


@register("qsgd")
class QSGDCompressor:
    """Unbiased stochastic quantization to ``levels`` levels per ``bucket`` elements."""

    name: ClassVar[str] = "qsgd"
    summable: ClassVar[bool] = False
    biased: ClassVar[bool] = False

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
        self._generator: torch.Generator | None = None

    def _rng(self) -> torch.Generator:
        # Private, so the compressor neither consumes nor depends on the user's global RNG;
        # seeded per rank, so the ranks' rounding noise is independent and averages out.
        if self._generator is None:
            rank = self.process_rank or 0
            self._generator = torch.Generator().manual_seed(self._seed * 1_000_003 + rank)
        return self._generator

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1).to(compute_dtype(tensor.dtype))
        count = flat.numel()
        buckets = max(1, -(-count // self.bucket))
        x = torch.zeros(buckets * self.bucket, dtype=flat.dtype, device=flat.device)
        x[:count] = flat
        x = x.view(buckets, self.bucket)
        norms = torch.linalg.vector_norm(x, dim=1)
        scale = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms))
        # Drawn on the CPU for any device, then moved: a CUDA rank rounds with the same numbers
        # as a CPU rank of the same seed and rank (the GPU tests compare payloads bit for bit),
        # at the price of the draw on the host and one copy of x's size to the device.
        rand = torch.rand(x.shape, generator=self._rng(), dtype=x.dtype).to(x.device)
        host_work(self.name, x.device, _HOST_DRAWS)
        packed = kernels.qsgd_quantize(x, scale, rand, self.levels, self.bits)
        return Compressed([packed, norms.float()], (tensor.shape, tensor.dtype, count))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype, count = compressed.ctx
        packed, norms = compressed.payload
        buckets = max(1, -(-count // self.bucket))
        padded = buckets * self.bucket
        expect_numel(norms, buckets, "qsgd norms")
        expect_finite(norms, "qsgd norm", nonnegative=True)
        expect = padded if self.bits == 16 else bitpack.packed_bytes(padded, self.bits)
        expect_numel(packed, expect, "qsgd levels" if self.bits == 16 else "qsgd packed levels")
        # A tensor divisor, not the int: torch on CUDA divides by a Python number as a product
        # with its reciprocal, one float32 unit off the CPU's division for some norms (seen on
        # an H200: float64 results 7e-8 apart); element by element both devices divide exactly.
        step = (norms / torch.full_like(norms, self.levels)).to(compute_dtype(dtype))
        values, top = kernels.qsgd_dequantize(packed, step, self.levels, self.bits, self.bucket)
        if top > self.levels:
            raise PayloadError(f"qsgd level {top:g} exceeds levels={self.levels}")
        return values[:count].reshape(shape).to(dtype)

    def wire_bytes(self, numel: int) -> int:
        buckets = max(1, -(-numel // self.bucket))
        return bitpack.packed_bytes(buckets * self.bucket, self.bits) + 4 * buckets
