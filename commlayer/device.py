"""Device tensors: CUDA tensors through the engine's host-memory backends, staged in pinned
host buffers.

The engine's backends move host memory (MPI without CUDA support, gloo), so an operation with
tensors on a CUDA device is staged, and this module is the one place that knows it. ``stage``
runs at submit, in the caller's thread:

1. **In**: the device's copy stream waits on the caller's current stream (an event: no
   device-wide synchronisation, nothing the caller queued later is waited for) and copies each
   CUDA input to a pinned host buffer, then records the operation's ``ready`` event. The
   caller's thread never blocks; the copies run while the ranks negotiate and while earlier
   collectives run.
2. **Run**: the engine waits on ``ready`` (polled like a collective's request, under the
   watchdog) before the collective reads the host buffers; the collective itself is the CPU
   one, so fusion, algorithms, errors and join are the same code for both devices.
3. **Out**: ``Staged.unstage`` copies the result back on the copy stream: into the caller's
   own CUDA outputs (in-place forms, out-of-place outputs), or to new tensors on the device
   for the results a collective creates (allgather, broadcast, alltoall's rows,
   reducescatter); alltoall's received splits stay on the CPU, as Horovod's do. The future
   completes once those copies are done, so its value is usable on any stream.

The device-dependent steps are the three functions ``_copy_stream``, ``_host_buffer`` and
``_event``; everything else runs unchanged on CPU tensors when a test sets ``STAGE_CPU``
(tests/parallel/test_device.py), which is how CI, without a GPU,
checks the seam's logic. tests/gpu/ runs it on CUDA tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from commlayer.backends.base import COMPLETED, Request

# CUDA tensors are staged through host memory; tests set this to stage CPU tensors the same way.
STAGE_CPU = False
DEVICE_TYPES = ("cpu", "cuda")  # what the collectives accept


def check(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s device cannot be moved (None when it can): CPU and CUDA tensors can."""
    if tensor.device.type in DEVICE_TYPES:
        return None
    return (
        f"tensor is on {tensor.device}; collectives move CPU and CUDA tensors "
        "(copy it to one of them first)"
    )


class _EventRequest:
    """A ``Request`` that completes when a CUDA event has (the engine polls it)."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def test(self) -> bool:
        return bool(self.event.query())


@functools.cache
def _copy_stream(device: torch.device) -> Any:
    """The stream this process copies between ``device`` and the host on (one per device, so
    copies of one operation queue behind those of the previous one, never behind compute)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return None


@contextlib.contextmanager
def _on(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like ``like``: pinned for a CUDA tensor (asynchronous copies;
    torch's caching host allocator reuses the blocks, so a step costs no cudaHostAlloc)."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


def _event(stream: Any) -> Any:
    """An event recorded on ``stream`` now (None for the CPU: nothing to wait for)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Staged:
    """The host side of one operation's staged tensors (module docstring, steps 2 and 3)."""

    __slots__ = ("device", "ready", "_stream", "_outputs")

    def __init__(
        self, device: torch.device, stream: Any, outputs: dict[int, torch.Tensor], ready: Any
    ) -> None:
        self.device = device
        self._stream = stream
        self._outputs = outputs  # id(host output) -> the caller's device output
        self.ready: Request = COMPLETED if ready is None else _EventRequest(ready)

    def unstage(self, raw: Any) -> Any:
        """``raw`` (the collective's host result) on the device (step 3); blocks until the
        copies are done (the engine thread calls it; they take no peer)."""
        with _on(self._stream):
            result = self._map(raw)
            done = _event(self._stream)
        if done is not None:
            done.synchronize()
        return result

    def _map(self, raw: Any) -> Any:
        if isinstance(raw, torch.Tensor):
            out = self._outputs.get(id(raw))
            if out is None:  # a result the collective created
                return raw.to(self.device, non_blocking=True)
            if out is not raw:  # (a CPU output of a group with CUDA members is its own)
                out.copy_(raw, non_blocking=True)
            return out
        if isinstance(raw, list):
            return [self._map(r) for r in raw]
        if isinstance(raw, tuple):  # alltoall: (rows, received splits), splits stay on the CPU
            return (self._map(raw[0]), *raw[1:])
        return raw

    def wrap(self, finish: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        """``finish`` applied to the result on the device."""
        if finish is None:
            return self.unstage
        return lambda raw: finish(self.unstage(raw))


def _staged(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or STAGE_CPU


def stage(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], Staged | None]:
    """Host stand-ins for an operation's tensors on a staged device (step 1), and the
    ``Staged`` record that brings the result back; (inputs, outputs, None) when none is."""
    # Every submit comes here: CPU operations leave after one is_cuda pass (13 us for a group of
    # 100 tensors in place, where reading each tensor's device took 65 us).
    if not (STAGE_CPU or any(t.is_cuda for t in inputs) or any(t.is_cuda for t in outputs)):
        return list(inputs), list(outputs), None
    devices = {t.device for t in (*inputs, *outputs) if _staged(t)}
    if len(devices) > 1:
        raise ValueError(
            "the tensors of one operation must be on one device (or the CPU); got "
            f"{sorted(map(str, devices))}"
        )
    (device,) = devices
    stream = _copy_stream(device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    host: dict[int, torch.Tensor] = {}  # id(device tensor) -> its host stand-in
    with _on(stream):
        for tensor in inputs:
            if _staged(tensor) and id(tensor) not in host:
                buffer = host[id(tensor)] = _host_buffer(tensor)
                buffer.copy_(tensor, non_blocking=True)
                if stream is not None:
                    tensor.record_stream(stream)  # not reused by the caller's stream meanwhile
        ready = _event(stream)
    back: dict[int, torch.Tensor] = {}
    for tensor in outputs:
        if not _staged(tensor):
            back[id(tensor)] = tensor  # a CPU member of a group: its own result
            continue
        if id(tensor) not in host:  # an output that is not also an input
            host[id(tensor)] = _host_buffer(tensor)
        back[id(host[id(tensor)])] = tensor
    swapped = [host.get(id(t), t) for t in inputs], [host.get(id(t), t) for t in outputs]
    return swapped[0], swapped[1], Staged(device, stream, back, ready)
