"""Broadcast: the root's tensor to every rank of the set."""

from __future__ import annotations

from typing import Any

import torch

from commlayer.backends.base import Backend, Request
from commlayer.core.negotiation import Response
from commlayer.core.runners import Submitted, place


def run(
    backend: Backend, response: Response, op: Submitted | None, active: list[int]
) -> tuple[Any, Request, int, float]:
    if op is None:
        buf = torch.empty(response.shapes[0], dtype=response.torch_dtype, device=place(response))
    else:
        buf = op.outputs[0]
        if backend.rank == response.root and op.inputs[0] is not buf:
            buf.copy_(op.inputs[0])
    request = backend.ibcast(buf.view(-1), response.root)
    return buf, request, buf.numel() * buf.element_size(), 1.0
