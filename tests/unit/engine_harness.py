"""Engine test harness: one Engine per loopback thread rank, operations built as ops.py does.

``run_engines(size, fn, **settings)``:
1. Start ``size`` thread ranks (``run_ranks``); each builds ``Engine(backend, config)`` with
   ``config.load(environ={}, ...)`` (the machine's COMMLAYER_* variables never leak in), fast
   cycles by default, and starts it (unless ``start=False``: then ``fn`` starts it, after
   submitting, so every operation is in the engine's first cycle).
2. Run ``fn(engine)``; then wait for every rank (a thread barrier, so no rank shuts down while
   a peer still has work) and shut the engine down, checking that it stopped.
3. A failing rank aborts the barrier and (through run_ranks) the loopback world, which stops
   every engine: no rank is left blocked, and the first error is the one reported.
Every wait has a timeout: a bug fails a test, it never hangs the suite.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from commlayer.backends.loopback import LoopbackBackend, LoopbackRequest, run_ranks
from commlayer.common import config
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core.engine import Engine, Operation
from commlayer.core.future import Handle
from commlayer.core.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    Announce,
    dtype_name,
    shapes_of,
)

T = TypeVar("T")
WAIT_S = 10.0  # per handle: far above any healthy run (ms), far below the pytest timeout
SHUTDOWN_S = 3.0  # a healthy shutdown takes one idle heartbeat (25 ms); a broken one costs this
# Heartbeat of an idle engine is max(100 x cycle, 5 ms): 0.25 ms gives 25 ms, so shutdown and
# stall news spread in tens of ms while idle ranks still sleep most of the time.
FAST = {"cycle_time_ms": 0.25}


class CountingBackend:
    """A loopback backend that counts name exchanges (``iallgather_bytes`` calls): the
    negotiation's steady state, served from the response cache, makes none."""

    def __init__(self, inner: LoopbackBackend) -> None:
        self._inner = inner
        self.name_exchanges = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def iallgather_bytes(self, payload: bytes) -> tuple[LoopbackRequest, list[bytes]]:
        self.name_exchanges += 1
        return self._inner.iallgather_bytes(payload)


def run_engines(
    size: int,
    fn: Callable[[Engine], T],
    *,
    start: bool = True,
    wrap: Callable[[LoopbackBackend], Any] | None = None,
    timeout_s: float = 20.0,
    **settings: Any,
) -> list[T]:
    """``fn(engine)`` on ``size`` thread ranks, each with a running Engine; results in rank
    order. ``settings`` are Config fields; ``wrap`` wraps each rank's backend."""
    cfg = config.load(environ={}, **{**FAST, **settings})
    gate = threading.Barrier(size)

    def main(backend: LoopbackBackend) -> T:
        engine = Engine(wrap(backend) if wrap else backend, cfg)
        if start:
            engine.start()
        try:
            result = fn(engine)
            gate.wait(WAIT_S)
        except BaseException:
            # No shutdown here: peers would fail with "rank r shut down" and might report that
            # first. run_ranks records this error, then aborts the world, which stops every engine.
            gate.abort()
            raise
        engine.shutdown(timeout_s=SHUTDOWN_S)
        assert not engine.running, f"rank {engine.rank}: engine still running after shutdown"
        return result

    return run_ranks(size, main, timeout_s=timeout_s)


def wait(handle: Handle) -> Any:
    """The handle's result (or its error), never waiting longer than WAIT_S."""
    return handle.wait(timeout_s=WAIT_S)


def _operation(
    name: str,
    kind: str,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    *,
    op: ReduceOp = ReduceOp.Sum,
    root: int = -1,
    splits: tuple[int, ...] | None = None,
    shapes: tuple[tuple[int, ...], ...] | None = None,
    **fields: Any,
) -> Operation:
    dtype = dtype_name(inputs[0].dtype) if inputs else "uint8"
    shapes = shapes_of(inputs) if shapes is None else shapes
    announce = Announce(name, kind, dtype, shapes, int(op), root, splits)
    return Operation(announce, inputs, outputs, **fields)


def allreduce(
    name: str,
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.Sum,
    *,
    prescale: float = 1.0,
    postscale: float = 1.0,
    in_place: bool = False,
    finish: Callable[[Any], Any] | None = None,
) -> Operation:
    """Allreduce of ``tensor``: into a new tensor, or into ``tensor`` itself."""
    output = tensor if in_place else torch.empty_like(tensor)
    return _operation(
        name,
        ALLREDUCE,
        [tensor],
        [output],
        op=op,
        prescale=prescale,
        postscale=postscale,
        finish=finish or (lambda outs: outs[0]),
    )


def grouped_allreduce(
    name: str, tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.Sum, *, in_place: bool = False
) -> Operation:
    outputs = tensors if in_place else [torch.empty_like(t) for t in tensors]
    return _operation(name, ALLREDUCE, tensors, outputs, op=op, finish=list)


def allgather(name: str, tensor: torch.Tensor) -> Operation:
    return _operation(name, ALLGATHER, [tensor], [])


def broadcast(name: str, tensor: torch.Tensor, root: int) -> Operation:
    return _operation(name, BROADCAST, [tensor], [torch.empty_like(tensor)], root=root)


def reducescatter(name: str, tensor: torch.Tensor, op: ReduceOp = ReduceOp.Sum) -> Operation:
    return _operation(name, REDUCESCATTER, [tensor], [], op=op)


def alltoall(name: str, tensor: torch.Tensor, splits: tuple[int, ...]) -> Operation:
    return _operation(name, ALLTOALL, [tensor], [], splits=splits)


def barrier(name: str) -> Operation:
    return _operation(name, BARRIER, [], [], shapes=())
