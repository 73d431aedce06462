"""Runs one allreduce schedule over a backend's point-to-point calls (the executor proper).

``ScheduleRequest(backend, schedule, buf, op, scratch)`` is a Request like the backend's own
``iallreduce``: ``test()`` advances it without waiting. A step posts its receives into scratch
memory and its sends straight from the buffer (zero-copy slices of a contiguous tensor), and
applies the receives in order (reduce into the buffer or copy over it), each as soon as it and
those before it arrived when the step's sends do not overlap them, else once everything of the
step completed. It knows no algorithm and no cost model: core/selection.py picks the schedule,
and the calibration (launch/calibrate.py) times exchanges through it.
"""

from __future__ import annotations

import torch

from commlayer.algorithms.schedule import Schedule
from commlayer.backends.base import Backend, Request
from commlayer.common.reduce_ops import ReduceOp, reduce_into

_CPU = torch.device("cpu")


class BufferPool:
    """One growing flat buffer per dtype and device, reused (never freed while running; one
    engine thread): a schedule's receives here, the engine's fusion buffers in a pool of its
    own (core/fusion.py); on the tensors' device, so a direct CUDA operation's packs and
    reductions run there (core/device.py)."""

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, numel: int, device: torch.device = _CPU) -> torch.Tensor:
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


class ScheduleRequest:
    """One allreduce in flight under a schedule; ``test()`` advances it without waiting.

    A step's receives are applied in their listed order, each once it and every receive
    before it completed; in a step whose sends overlap its receives (``Step.early`` false)
    only after the sends completed too. So a chunked ring step reduces its first piece while
    later pieces are still arriving."""

    __slots__ = (
        "_backend", "_schedule", "_buf", "_op", "_scratch", "_index", "_sends", "_recvs",
        "_done", "_applied", "_early",
    )  # fmt: skip

    def __init__(
        self,
        backend: Backend,
        schedule: Schedule,
        buf: torch.Tensor,
        op: ReduceOp,
        scratch: BufferPool,
    ) -> None:
        self._backend = backend
        self._schedule = schedule
        self._buf = buf
        self._op = op
        self._scratch = scratch
        self._index = 0
        self._sends: list[Request] = []
        # (request, target range, scratch) of the step in flight; None before it is posted
        self._recvs: list[tuple[Request, torch.Tensor, torch.Tensor]] | None = None
        self._done: list[bool] = []
        self._applied = 0
        self._early = False

    def _post(self) -> None:
        step = self._schedule[self._index]
        total = sum(t.numel for t in step.recvs)
        space = self._scratch.get(self._buf.dtype, total, self._buf.device)
        offset = 0
        recvs = []
        for t in step.recvs:
            room = space[offset : offset + t.numel]
            offset += t.numel
            recvs.append((self._backend.irecv(room, t.peer), self._buf[t.start : t.stop], room))
        self._sends = [self._backend.isend(self._buf[t.start : t.stop], t.peer) for t in step.sends]
        self._recvs = recvs
        self._done = [False] * len(recvs)
        self._applied = 0
        self._early = step.early

    def test(self) -> bool:
        while self._index < len(self._schedule):
            if self._recvs is None:
                self._post()
            recvs, done = self._recvs, self._done
            assert recvs is not None
            for i in range(self._applied, len(recvs)):
                if not done[i]:
                    done[i] = recvs[i][0].test()
            if self._sends:
                self._sends = [r for r in self._sends if not r.test()]
            if self._early or not self._sends:
                reduce = self._schedule[self._index].reduce
                while self._applied < len(recvs) and done[self._applied]:
                    _, target, data = recvs[self._applied]
                    if reduce:
                        reduce_into(target, data, self._op)
                    else:
                        target.copy_(data)
                    self._applied += 1
            if self._sends or self._applied < len(recvs):
                return False
            self._recvs = None
            self._index += 1
        return True
