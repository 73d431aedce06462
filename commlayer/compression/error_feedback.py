"""Error feedback: remember what compression dropped and add it to the next gradient.

Math (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019, Algorithm 2): with
residual e_t (0 at first) and compressor C,

1. p_t = g_t + e_t                       (the corrected gradient)
2. send C(p_t)
3. e_{t+1} = p_t - D(C(p_t))             (D: this rank's own decompression, before reduction)

so nothing is lost, only delayed: sum_t D(C(p_t)) = sum_t g_t - e_{T+1}. This is what lets
biased compressors (top-k, signs, PowerSGD) converge like SGD. For a multi-round compressor
(PowerSGD) step 3 uses the last round's local payload, before it is reduced.

Cost: the generic path builds p_t (one read of g and e, one write) and e_{t+1} (D(C(p_t)) and a
subtraction: two to three more passes over the tensor). A compressor that sends some entries
exactly and drops the rest (top-k, random-k) declares ``drop_sent_(p, compressed)``: p_t is then
built in the residual's own buffer (``e.add_(g)``) and the sent entries zeroed in it, which is
e_{t+1}, bit for bit the generic result, in one pass instead of three to four. Top-k goes one
step further (``compress_sum_(e, g)``): the addition and its selection's read of p_t are one
kernel.

State: one residual per tensor name (the name the optimizer gives each gradient), returned by
``state_dict()`` so a checkpoint keeps it; residuals are per rank. Compressed once per host
(comm/hierarchy.py), a gradient's residual is kept by the bucket's leader (what it compresses
is its host's sum: the residual is still a part of the sum delayed); ``take_residual`` hands
one over where a rank stopped compressing a name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from commlayer.compression.base import (
    COMPRESS_SUM,
    DECOMPRESS_ADD,
    DECOMPRESS_INTO,
    DECOMPRESS_SUM,
    DROP_SENT,
    LOCAL_ERROR,
    MULTI_ROUND,
    RESIDUALS,
    ROUND_BYTES,
    STATEFUL,
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    CompressSum,
    DecompressAdd,
    DecompressInto,
    DecompressSum,
    DropSent,
    LocalError,
    MultiRound,
    RoundBytes,
    WireBytes,
)

# The inner compressor's capabilities the wrapper has as they are: its fast paths that read or
# write the reduced result, never the residual, and its payload's size.
_FORWARDED = frozenset(
    {DECOMPRESS_ADD, DECOMPRESS_SUM, DECOMPRESS_INTO, WIRE_BYTES, ROUND_BYTES, MULTI_ROUND}
)


class ErrorFeedback(CompressorBase):
    """Wraps ``inner``: adds the residual before compressing, keeps the new residual."""

    __slots__ = (
        "inner", "residuals", "_corrected", "name", "summable", "sparse", "identity",
        "wire_dtype", "wire_parameters", "capabilities", "hierarchy",
    )  # fmt: skip

    def __init__(self, inner: CompressorBase) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("ErrorFeedback(ErrorFeedback(...)): error feedback is already on")
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable
        self.sparse = inner.sparse
        # the inner compressor's: error feedback around the identity keeps nothing
        self.identity = inner.identity
        self.wire_dtype = inner.wire_dtype
        self.wire_parameters = inner.wire_parameters
        self.capabilities = (inner.capabilities & _FORWARDED) | {RESIDUALS, STATEFUL}
        self.hierarchy: str | None = None  # a spec's hierarchy= (factory.py)
        self.residuals: dict[str, torch.Tensor] = {}
        self._corrected: dict[str, torch.Tensor] = {}  # between rounds of a multi-round inner

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"

    def bind_rank(self, rank: int) -> None:
        self.inner.bind_rank(rank)

    # -- the inner compressor's, forwarded where its capabilities name them ---------------
    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return cast(WireBytes, self.inner).wire_bytes(numel, element_bytes)

    def round_bytes(self, shape: torch.Size, element_bytes: int = 4) -> list[int]:
        return cast(RoundBytes, self.inner).round_bytes(shape, element_bytes)

    def decompress_into(self, compressed: Compressed, out: torch.Tensor) -> None:
        cast(DecompressInto, self.inner).decompress_into(compressed, out)

    def check_payload(self, compressed: Compressed) -> Any:
        return cast(DecompressAdd, self.inner).check_payload(compressed)

    def decompress_add_(self, compressed: Compressed, out: torch.Tensor, alpha: float) -> None:
        cast(DecompressAdd, self.inner).decompress_add_(compressed, out, alpha)

    def decompress_sum_(self, records: list[Compressed], out: torch.Tensor, divisor: float) -> None:
        cast(DecompressSum, self.inner).decompress_sum_(records, out, divisor)

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        residual = self.residuals.get(name)
        if DROP_SENT in self.inner.capabilities:
            drop_sent = cast(DropSent, self.inner).drop_sent_
            return self._compress_in_place(tensor, name, residual, drop_sent)
        corrected = tensor
        if residual is not None and residual.shape == tensor.shape:
            # .to: a residual restored by load_state_dict may sit elsewhere (a checkpoint
            # loaded with map_location="cpu"); it then joins the gradient's device for good.
            corrected = tensor + residual.to(tensor.device)
        compressed = self.inner.compress(corrected, name)
        self._remember(name, corrected, compressed)
        return compressed

    def _compress_in_place(
        self,
        tensor: torch.Tensor,
        name: str,
        residual: torch.Tensor | None,
        drop_sent: Callable[[torch.Tensor, Compressed], torch.Tensor],
    ) -> Compressed:
        """p_t in the residual's buffer, e_{t+1} = p_t with the sent entries zeroed (module
        docstring): the payload holds copies of the sent values, so the buffer is free."""
        usable = (
            residual is not None
            and residual.shape == tensor.shape
            and residual.dtype == tensor.dtype
            and residual.device == tensor.device
        )
        if usable:
            assert residual is not None
            if COMPRESS_SUM in self.inner.capabilities and residual.is_contiguous():
                # top-k: the correction and the selection's read in one kernel
                compressed = cast(CompressSum, self.inner).compress_sum_(residual, tensor, name)
                self.residuals[name] = drop_sent(residual, compressed)
                return compressed
            corrected = residual.add_(tensor.detach())
        elif residual is not None and residual.shape == tensor.shape:
            corrected = (tensor.detach() + residual.to(tensor.device, tensor.dtype)).contiguous()
        else:
            corrected = tensor.detach().clone(memory_format=torch.contiguous_format)
        compressed = self.inner.compress(corrected, name)
        self.residuals[name] = drop_sent(corrected, compressed)
        return compressed

    def next_round(self, compressed: Compressed, name: str = "") -> Compressed | None:
        following = cast(MultiRound, self.inner).next_round(compressed, name)
        if following is not None:
            self._remember(name, self._corrected.pop(name), following)
        return following

    def next_rounds(self, rounds: list[tuple[Compressed, str]]) -> list[Compressed | None]:
        """``next_round`` of several tensors, by the inner compressor's ``next_rounds``
        (PowerSGD: one batched QR)."""
        following = cast(MultiRound, self.inner).next_rounds(rounds)
        for (_, name), nxt in zip(rounds, following):
            if nxt is not None:
                self._remember(name, self._corrected.pop(name), nxt)
        return following

    def _remember(self, name: str, corrected: torch.Tensor, compressed: Compressed) -> None:
        if compressed.final:
            # Now, before the payload is communicated: a summable one is reduced in place. Not
            # in place: the payload may be ``corrected`` itself (PowerSGD sends vectors as is).
            if LOCAL_ERROR in self.inner.capabilities:  # PowerSGD: one fused product
                local_error = cast(LocalError, self.inner).local_error
                self.residuals[name] = local_error(corrected, compressed)
                return
            local = self.inner.decompress(compressed)
            self.residuals[name] = corrected.detach() - local.to(corrected.dtype)
        else:
            self._corrected[name] = corrected

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        return self.inner.decompress(compressed)

    def add_dropped(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Entries of the payload sent for ``name`` that the reduction dropped (gtopk's
        re-selection, algorithms/sparse/gtopk.py): flat indices into the tensor. Added to the
        residual, so they are delayed like what the compressor itself dropped, not lost."""
        residual = self.residuals.get(name)
        if residual is None:
            raise ValueError(f"add_dropped({name!r}): nothing was compressed under that name")
        indices = indices.to(residual.device, torch.long)
        values = values.to(residual.device, residual.dtype)
        flat = residual.reshape(-1).index_add(0, indices, values)
        self.residuals[name] = flat.view(residual.shape)

    def take_residual(self, name: str) -> torch.Tensor | None:
        """The residual kept for ``name``, removed (None if none): a rank that no longer
        compresses ``name`` adds it to what it sends instead (comm/hierarchy.py), so it is
        delayed, not lost."""
        return self.residuals.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {name: r.clone() for name, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {name: r.clone() for name, r in state["residuals"].items()}
