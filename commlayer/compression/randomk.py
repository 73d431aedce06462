"""Random-k sparsification with a seed shared by all ranks, so the payloads are summable.

Math (Stich et al., NeurIPS 2018, "Sparsified SGD with Memory"; Wangni et al. 2018): C(x) keeps
x_i at k = ceil(ratio * d) random positions and zeroes the rest; E||x - C(x)||^2 =
(1 - k/d) ||x||^2, a contraction like top-k, but blind to magnitudes. Unscaled, so biased:
``create("randomk:...")`` wraps it in ErrorFeedback (Stich et al.'s "memory").

Every rank draws the positions from a generator seeded by (seed, tensor name, how many times
this name was compressed), so at each step all ranks pick the same positions without sending
them: the payload is just the k values, allreduced like a dense tensor (summable), and the
indices never travel. At ratio <= 5% positions are drawn with replacement and deduplicated
(O(k log k) instead of a permutation of all d elements): k (1 - k/(2d)) distinct positions on
average, 0.5% fewer than k at 1%; above 5%, exactly k from a permutation.
"""

from __future__ import annotations

import torch

from commlayer.compression.base import (
    DROP_SENT,
    WIRE_BYTES,
    Compressed,
    CompressorBase,
    check_ratio,
    host_work,
    kept,
    stable_seed,
)

_HOST_DRAWS = (
    "its positions are drawn on the CPU (every rank's must be equal, whatever its device) and "
    "copied to the device, one index per kept element"
)


class RandomKCompressor(CompressorBase):
    """``ratio`` of the elements at positions every rank draws alike."""

    name = "randomk"
    summable = True
    capabilities = frozenset({WIRE_BYTES, DROP_SENT})
    biased = True
    wire_parameters = ("ratio",)

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        self.ratio = check_ratio(ratio)
        self.seed = seed
        self._steps: dict[str, int] = {}

    def indices(self, name: str, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """This step's positions for tensor ``name``, on ``device``; advances its step counter.
        Drawn by a CPU generator whatever the device, then moved: a CUDA rank and a CPU rank
        of one job must pick the same positions, and torch's CPU and CUDA generators draw
        different numbers from one seed."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        generator = torch.Generator().manual_seed(stable_seed(self.seed, name, step))
        k = kept(numel, self.ratio)
        if k * 20 > numel:
            positions = torch.randperm(numel, generator=generator)[:k].sort().values
        else:
            positions = torch.unique(torch.randint(0, numel, (k,), generator=generator))
        host_work(self.name, torch.device(device), _HOST_DRAWS)
        return positions.to(device)

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1)
        positions = self.indices(name, flat.numel(), flat.device)
        return Compressed([flat[positions]], (tensor.shape, positions))

    def drop_sent_(self, corrected: torch.Tensor, compressed: Compressed) -> torch.Tensor:
        """Error feedback's new residual, in place: the sent positions zeroed (ErrorFeedback)."""
        corrected.reshape(-1)[compressed.ctx[1]] = 0
        return corrected

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, positions = compressed.ctx
        values = compressed.payload[0]
        out = values.new_zeros(shape.numel())
        out[positions] = values
        return out.view(shape)

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return kept(numel, self.ratio) * element_bytes
