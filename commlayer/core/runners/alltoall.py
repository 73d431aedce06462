"""Alltoall: rank r's block q of rows goes to rank q; the result is (rows received, counts)."""

from __future__ import annotations

from typing import Any

import torch

from commlayer.backends.base import Backend, Request
from commlayer.core.negotiation import Response
from commlayer.core.runners import Submitted, place, row_numel


def run(
    backend: Backend, response: Response, op: Submitted | None, active: list[int]
) -> tuple[Any, Request, int, float]:
    assert op is not None
    me = backend.rank
    row = row_numel(response)
    send_rows = list(response.splits[me])
    recv_rows = [response.splits[q][me] for q in range(backend.size)]
    rest = response.shapes[0][1:]
    output = torch.empty(
        (sum(recv_rows), *rest), dtype=response.torch_dtype, device=place(response)
    )
    request = backend.ialltoallv(
        op.inputs[0].reshape(-1),
        [r * row for r in send_rows],
        output.view(-1),
        [r * row for r in recv_rows],
    )
    received = torch.tensor(recv_rows, dtype=torch.int32)
    return (output, received), request, op.inputs[0].numel() * output.element_size(), 1.0
