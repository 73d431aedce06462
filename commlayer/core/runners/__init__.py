"""The collectives the engine runs one operation at a time (all but the fused allreduce): one
module per kind, each a function ``run(backend, response, op, active)`` returning (result or a
callable that finishes it, the backend request, payload bytes, wire factor). ``op`` is None on a
joined rank, which takes part without data of its own; ``active`` are the ranks not joined.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from commlayer.core import device
from commlayer.core.negotiation import Response


class Submitted(Protocol):
    """What a runner reads of a submitted operation (engine.Operation)."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    prescale: float
    postscale: float


def place(response: Response) -> torch.device:
    """Where a runner makes an operation's buffers: the CPU, or for a direct operation
    (``response.channel``) the device this rank uses that channel with (device.py)."""
    return device.channel_device(response.channel)


def row_numel(response: Response) -> int:
    """Elements of one row (dimension 0 is the one collectives concatenate or split)."""
    return math.prod(response.shapes[0][1:]) if response.shapes and response.shapes[0] else 1
