"""PowerSGD: a rank-r approximation by one step of power iteration, warm-started every step.

Math (Vogels et al., NeurIPS 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", Algorithm 1): a gradient viewed as the matrix M (n x m: the first
dimension by the rest, so convolution kernels count too) is approximated as P_hat Q^T:

1. P = M Q                      (Q: m x r, from the previous step: warm start)
2. P = mean over ranks of P     (allreduce: linear in M, so summable)
3. P_hat = orthonormalize(P)    (reduced QR)
4. Q = M^T P_hat                (m x r)
5. Q = mean over ranks of Q     (second allreduce)
6. M_hat = P_hat Q^T            (= P_hat P_hat^T mean(M): projection of the mean gradient)

Two rounds: ``compress`` returns P (``final=False``), ``next_round`` steps 3-4 and returns Q.
The reduced Q is kept (the allreduce writes it in place) and starts the next step's power
iteration, so the approximation improves over steps like a subspace iteration. The first Q is
drawn from a generator seeded by the tensor's name: equal on every rank. It is not saved in
``state_dict``: ranks restarted from one rank's checkpoint must still hold equal Qs, and a fresh
Q costs one step of approximation quality.

Wire: (n + m) r elements instead of n m. Vectors, and matrices where (n + m) r >= n m, travel
uncompressed in one round. Biased (rank-r truncation): ``create`` adds ErrorFeedback, whose
local error is M - P_hat Q_local^T, computed before the second allreduce (Vogels et al.'s
Algorithm 2).
"""

from __future__ import annotations

from typing import Any

import torch

from commlayer.compression.base import (
    DECOMPRESS_INTO,
    LOCAL_ERROR,
    MULTI_ROUND,
    ROUND_BYTES,
    Compressed,
    CompressorBase,
    check_positive_int,
    compute_dtype,
    host_work,
    stable_seed,
)

_HOST_DRAWS = (
    "the first Q of each tensor is drawn on the CPU (every rank's must be equal, whatever its "
    "device) and copied to the device, once per tensor"
)


class PowerSGDCompressor(CompressorBase):
    """Rank-``rank`` approximation of matrix gradients in two allreduce rounds."""

    name = "powersgd"
    summable = True
    capabilities = frozenset({ROUND_BYTES, MULTI_ROUND, DECOMPRESS_INTO, LOCAL_ERROR})
    biased = True

    def __init__(self, rank: int = 1, seed: int = 0) -> None:
        self.rank = check_positive_int(rank, "rank")
        self.seed = seed
        self._q: dict[str, torch.Tensor] = {}

    def _matrix_rank(self, shape: torch.Size) -> int:
        """The rank used for a tensor of ``shape``; 0 means send it uncompressed."""
        if len(shape) < 2:
            return 0
        rows, cols = shape[0], shape.numel() // shape[0]
        rank = min(self.rank, rows, cols)
        return rank if (rows + cols) * rank < rows * cols else 0

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        rank = self._matrix_rank(tensor.shape)
        if rank == 0:
            return Compressed([tensor], None)
        m = tensor.detach().reshape(tensor.shape[0], -1).to(compute_dtype(tensor.dtype))
        q = self._q.get(name)
        if q is None or q.shape != (m.shape[1], rank) or q.dtype != m.dtype:
            # A CPU generator for any device, then moved: every rank, CPU or CUDA, must start
            # from the same Q (torch's CUDA generator draws other numbers from one seed).
            generator = torch.Generator().manual_seed(stable_seed(self.seed, name))
            q = torch.randn(m.shape[1], rank, generator=generator, dtype=m.dtype)
            host_work(self.name, m.device, _HOST_DRAWS)
        q = q.to(m.device)  # a no-op unless just drawn, or the model moved since
        return Compressed([m @ q], (m, tensor.shape, tensor.dtype, name), final=False)

    def next_round(self, compressed: Compressed, name: str = "") -> Compressed | None:
        """Steps 3-4: orthonormalize the reduced P; the next payload is Q = M^T P_hat."""
        if compressed.final:
            return None
        return self._second(compressed, torch.linalg.qr(compressed.payload[0]).Q)

    def next_rounds(self, rounds: list[tuple[Compressed, str]]) -> list[Compressed | None]:
        """``next_round`` of a bucket's tensors at once: the reduced Ps of one shape are
        orthonormalized by one batched QR (LAPACK per matrix, so the same bits as one call
        each) instead of one call per tensor; the products M^T P_hat stay per tensor."""
        out: list[Compressed | None] = [None] * len(rounds)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for j, (compressed, _) in enumerate(rounds):
            if not compressed.final:
                p = compressed.payload[0]
                groups.setdefault((p.shape, p.dtype, p.device), []).append(j)
        for members in groups.values():
            if len(members) == 1:
                j = members[0]
                out[j] = self.next_round(*rounds[j])
                continue
            stacked = torch.stack([rounds[j][0].payload[0] for j in members])
            for p_hat, j in zip(torch.linalg.qr(stacked).Q, members):
                out[j] = self._second(rounds[j][0], p_hat)
        return out

    def _second(self, compressed: Compressed, p_hat: torch.Tensor) -> Compressed:
        m, shape, dtype, key = compressed.ctx
        q = m.t() @ p_hat
        self._q[key] = q  # reduced in place by the allreduce: the next step's warm start
        return Compressed([q], (p_hat, shape, dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        if compressed.ctx is None:
            return compressed.payload[0]
        p_hat, shape, dtype = compressed.ctx
        return (p_hat @ compressed.payload[0].t()).reshape(shape).to(dtype)

    def decompress_into(self, compressed: Compressed, out: torch.Tensor) -> None:
        """P_hat Q^T written into ``out`` by the product itself where ``out`` is a contiguous
        tensor of the compute dtype (no temporary, no copy); else decompress and copy."""
        if compressed.ctx is None:
            if compressed.payload[0] is not out:
                out.copy_(compressed.payload[0].view(out.shape))
            return
        p_hat, _, _ = compressed.ctx
        if out.is_contiguous() and out.dtype == p_hat.dtype:
            torch.mm(p_hat, compressed.payload[0].t(), out=out.view(p_hat.shape[0], -1))
        else:
            out.copy_(self.decompress(compressed).view(out.shape))

    def local_error(self, corrected: torch.Tensor, compressed: Compressed) -> torch.Tensor:
        """Error feedback's residual corrected - P_hat Q_local^T in one fused product
        (``addmm``: no decompressed temporary, no separate subtraction)."""
        if compressed.ctx is None:
            return torch.zeros_like(corrected)
        p_hat, shape, _ = compressed.ctx
        m = corrected.detach().reshape(shape[0], -1)
        if m.dtype != p_hat.dtype:
            local = self.decompress(compressed).to(corrected.dtype)
            return corrected.detach() - local
        return torch.addmm(m, p_hat, compressed.payload[0].t(), alpha=-1).view(shape)

    def round_bytes(self, shape: torch.Size, element_bytes: int = 4) -> list[int]:
        """Bytes of each round's payload: the tensor as it is, or P (n x r) then Q (m x r) in
        the compute dtype (float64 for float64, else float32)."""
        rank = self._matrix_rank(shape)
        if rank == 0:
            return [shape.numel() * element_bytes]
        computed = 8 if element_bytes == 8 else 4
        return [shape[0] * rank * computed, shape.numel() // shape[0] * rank * computed]
