"""Per-tensor compression policy: which compressor each gradient gets.

1. Non-floating-point tensors are never compressed.
2. Tensors with fewer than ``min_numel`` elements (default 1024) are sent as they are, except by
   cast compressors (fp16, bf16), which cost nothing per tensor: for a bias vector a sparsifier
   or quantizer saves a few hundred bytes but adds its per-tensor work and, for gathered
   compressors, an allgather the engine cannot fuse with the dense allreduces.
3. ``per_parameter={"fc.weight": "topk:ratio=0.1", "head.weight": "none"}`` overrides the
   default for the parameters named (names as in ``model.named_parameters()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from commlayer.compression.base import STATEFUL, Compressor, CompressorBase, Stateful
from commlayer.compression.factory import create
from commlayer.compression.none import NoneCompressor

DEFAULT_MIN_NUMEL = 1024


class Policy:
    """Chooses a compressor per tensor; holds the compressors' state for ``state_dict``."""

    __slots__ = ("default", "per_parameter", "min_numel")

    def __init__(
        self,
        default: Compressor | str = "none",
        per_parameter: Mapping[str, Compressor | str] | None = None,
        min_numel: int = DEFAULT_MIN_NUMEL,
        *,
        rank: int | None = None,
        seed: int | None = None,
    ) -> None:
        """``rank``, ``seed``: passed to every compressor made from a spec (``create``)."""
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
        self.default = create(default, rank=rank, seed=seed)
        self.per_parameter = {
            name: create(c, rank=rank, seed=seed) for name, c in (per_parameter or {}).items()
        }
        self.min_numel = min_numel

    def __repr__(self) -> str:
        return (
            f"Policy(default={self.default!r}, per_parameter={self.per_parameter!r}, "
            f"min_numel={self.min_numel})"
        )

    def choose(self, parameter: str, tensor: torch.Tensor) -> CompressorBase:
        """The compressor for the gradient ``tensor`` of the parameter named ``parameter``."""
        compressor = self.per_parameter.get(parameter, self.default)
        if not tensor.is_floating_point():
            return _NONE
        if tensor.numel() < self.min_numel and not compressor.compresses_small_tensors:
            return _NONE
        return compressor

    def compressors(self) -> dict[str, CompressorBase]:
        """{key: compressor}: "default" and each per-parameter name."""
        return {"default": self.default, **self.per_parameter}

    def state_dict(self) -> dict[str, Any]:
        """State of the stateful compressors (error-feedback residuals), by key."""
        return {
            key: cast(Stateful, c).state_dict()
            for key, c in self.compressors().items()
            if STATEFUL in c.capabilities
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stateful = {
            k: cast(Stateful, c)
            for k, c in self.compressors().items()
            if STATEFUL in c.capabilities
        }
        for key, value in state.items():
            if key not in stateful:
                raise ValueError(
                    f"compression state for {key!r} has no stateful compressor to load into; "
                    f"this optimizer's stateful compressors: {sorted(stateful)}"
                )
            stateful[key].load_state_dict(value)


_NONE = NoneCompressor()
