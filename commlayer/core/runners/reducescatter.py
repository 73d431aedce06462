"""Reducescatter: reduce over ranks, rank r keeps its block of dimension 0."""

from __future__ import annotations

import math
from typing import Any

import torch

from commlayer.backends.base import Backend, Request
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import fusion
from commlayer.core.negotiation import Response
from commlayer.core.runners import Submitted, place, row_numel


def reducescatter_rows(dim0: int, size: int) -> list[int]:
    """Rows of the first dimension each rank receives: the first dim0 % size ranks get one more."""
    return [dim0 // size + (1 if r < dim0 % size else 0) for r in range(size)]


def run(
    backend: Backend, response: Response, op: Submitted | None, active: list[int]
) -> tuple[Any, Request, int, float]:
    shape = response.shapes[0]
    row = row_numel(response)
    rows = reducescatter_rows(shape[0] if shape else 1, backend.size)
    dtype = response.torch_dtype
    if op is None:
        send = torch.zeros(math.prod(shape), dtype=dtype, device=place(response))
    else:
        send = op.inputs[0].reshape(-1)
        if op.prescale != 1.0:
            send = send.clone()
            fusion.scale_(send, op.prescale)
    output = torch.empty((rows[backend.rank], *shape[1:]), dtype=dtype, device=place(response))
    reduce_op = ReduceOp(response.op)
    request = backend.ireduce_scatter(send, output.view(-1), [r * row for r in rows], reduce_op)
    average = 1.0 / len(active) if reduce_op == ReduceOp.Average else 1.0
    postscale = (op.postscale if op is not None else 1.0) * average

    def finish() -> torch.Tensor:
        fusion.scale_(output, postscale)
        return output

    return finish, request, send.numel() * send.element_size(), 1.0
