"""Allgather: every active rank's rows, concatenated in rank order (a joined rank adds none)."""

from __future__ import annotations

from typing import Any

import torch

from commlayer.backends.base import Backend, Request
from commlayer.core.negotiation import Response
from commlayer.core.runners import Submitted, place, row_numel


def run(
    backend: Backend, response: Response, op: Submitted | None, active: list[int]
) -> tuple[Any, Request, int, float]:
    row = row_numel(response)
    dim0 = [response.dim0[r] if r in active else 0 for r in range(backend.size)]
    rest = response.shapes[0][1:]
    output = torch.empty((sum(dim0), *rest), dtype=response.torch_dtype, device=place(response))
    send = op.inputs[0].reshape(-1) if op is not None else output.new_empty(0)
    request = backend.iallgatherv(send, output.view(-1), [d * row for d in dim0])
    return output, request, output.numel() * output.element_size(), 1.0
