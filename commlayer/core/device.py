"""Device tensors: CUDA tensors either taken by the backend as they are (direct) or staged in
pinned host buffers.

One decision, ``path(backend, device, dtype)``: does this backend take this device's tensors
directly? The backend answers (``direct_path``): the MPI backend when its MPI is CUDA-aware
(backends/cuda_aware.py), the torch backend when it has an NCCL group for CUDA tensors. This
module is the one place that acts on the answer; ``prepare`` runs at submit, in the caller's
thread, and returns either record:

**Direct** (``Direct``): the operation's own tensors go to the engine; an event is recorded on
the caller's current stream (the producer's). The engine thread runs all its device work
(fusion buffers, which are then on the device; packs, the Python reductions of the schedules,
unpacks) on a stream of its own (``_work_stream``) and, before the collective reads an input,
waits on that event the way the backend needs (``Path.wait``):

- ``"stream"`` (NCCL, which orders its work after the calling thread's current stream): the
  work stream waits on the event, no host wait, no device-wide synchronisation;
- ``"host"`` (MPI, stream-unaware): the engine polls the event host-side before the call, and
  the backend synchronizes the work stream before it hands MPI a device buffer
  (``sync_before_host_call``), so the engine's own packs and reductions are done too.

Once the collective and the unpack are queued, ``Direct.done`` hands the result on at once:
the engine thread does not wait for its device work. That work is queued on the work stream,
the engine thread's current stream, so the future's marks (**Order** below), recorded there when
it completes, order whoever reads the result after it, with no host wait. The fusion buffers
(a BufferPool, algorithms/executor.py) are only touched on the work stream (packs, unpacks, and
the collective, which NCCL orders after it and it after NCCL; MPI after
``sync_before_host_call``), so a buffer
the next bucket packs into while the previous bucket's unpack is still queued is written after
that unpack. A tensor the engine makes for a result (allgather's...) is allocated on the work
stream and read on the caller's: it is kept (``record_stream``) for the caller's stream at
submit.

A ``Path.channel`` that is not empty must be the same on every rank of an operation (NCCL on
one rank and gloo on another would never meet): it is negotiated with the operation
(``Announce.channel``), and a joined rank makes its buffers on that channel's device.

**Staged** (``Staged``), for every other CUDA tensor (the backends move host memory: MPI without
CUDA support, gloo):

1. **In**: the device's D2H stream waits on the caller's current stream (an event: no
   device-wide synchronisation, nothing the caller queued later is waited for) and copies each
   CUDA input to a pinned host buffer, then records the operation's ``ready`` event. The
   caller's thread never blocks; the copies run while the ranks negotiate and while earlier
   collectives run. The host buffers come from a pool (``_HostPool``, by device, dtype and
   size) and are reused across steps: one is handed out again only once the event recorded
   after the last copy that touched it has completed (queried host-side, never waited for).
2. **Run**: the engine waits on ``ready`` (polled like a collective's request, under the
   watchdog) before the collective reads the host buffers; the collective itself is the CPU
   one, so fusion, algorithms, errors and join are the same code for both devices.
3. **Out**: ``Staged.unstage`` copies the result back on the device's H2D stream, a stream of
   its own, which waits on this operation's ``ready`` (so after its copies in and the caller's
   stream at submit) but never queues behind a later operation's copies to the host: into the
   caller's own CUDA outputs (in-place forms, out-of-place outputs), or to new tensors on the
   device for the results a collective creates (allgather, broadcast, alltoall's rows,
   reducescatter; kept for the caller's stream); alltoall's received splits stay on the CPU,
   as Horovod's do. No host wait: the engine's work stream waits on an event after the copies
   back and the future completes at once, its marks recorded on that stream (**Order**); the
   host buffers go back to the pool with that event.

**Order** (``marks``, ``follow``): no thread waits for an operation's device work, and more of
it is queued after the engine's own: its ``finish`` (an in-place form's copy back, Adasum's
combine) and the callbacks its future runs (a compressor's decompress, the copy into the
gradient, a next round), all on the completing thread's current stream (the engine's work
stream, or a stream torch's future callbacks run on). So a future completed in a process that
uses a device carries ``marks``: an event recorded on the completing thread's current stream of
each such device after that work; whoever waits on the future, or runs a callback on it,
``follow``s them: its current streams wait on the events (no host wait), as torch's CUDA
futures do. A future chained from it (``then``, a communicator round) records its own after its
callback's work, so the stream of whoever waits last (``step()``'s, DDP's) is ordered after
all of it.

The device-dependent steps are the functions ``_d2h_stream``, ``_h2d_stream``, ``_work_stream``,
``_current_stream``, ``_set_stream``, ``_on``, ``_keep``, ``_copy``, ``_pinned`` and ``_event``
(and ``_host_pool``, the pool of host buffers); everything else runs unchanged on CPU tensors
when a test sets ``STAGE_CPU`` (staging) or ``DIRECT_CPU`` (the direct path, with a CPU data
group on the torch backend) (tests/parallel/test_device.py), which is how CI, without a GPU,
checks the seam's logic; a test that also replaces those functions with fake streams and events
checks the order, the pool's reuse and that no thread waits on the device
(tests/parallel/test_stream_order.py). tests/gpu/ runs it on CUDA tensors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from commlayer.backends.base import (  # noqa: F401  (Path, sync_before_host_call: re-exported)
    COMPLETED,
    DIRECT_PATHS,
    Backend,
    DirectPaths,
    Path,
    Request,
    sync_before_host_call,
)

# CUDA tensors are staged through host memory; tests set this to stage CPU tensors the same way.
STAGE_CPU = False


# Tests: CPU tensors through the direct path with this Path (None: CPU tensors are plain).
DIRECT_CPU: Path | None = None
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
def _d2h_stream(device: torch.device) -> Any:
    """The stream this process copies ``device``'s tensors to the host on (one per device, so
    copies queue behind the previous operation's copies in, never behind compute or behind the
    copies back)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return None


@functools.cache
def _h2d_stream(device: torch.device) -> Any:
    """The stream this process copies results back to ``device`` on (one per device: an
    operation's copies back never queue behind a later operation's copies to the host)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` <- ``src``, queued on the calling thread's current stream (asynchronous between
    pinned host memory and a device)."""
    dst.copy_(src, non_blocking=True)


@contextlib.contextmanager
def _on(stream: Any) -> Iterator[None]:
    """``stream`` current for the block (its device's), the previous one after it."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def _current_stream(device: torch.device) -> Any:
    """The calling thread's current stream of ``device`` (None for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return None


def _set_stream(device: torch.device, stream: Any) -> None:
    """Make ``stream`` the calling thread's current stream (and ``device`` its device)."""
    if torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)  # (a thread's device starts at 0)
    torch.cuda.set_stream(stream)


def _keep(tensor: torch.Tensor, stream: Any) -> None:
    """``tensor``'s memory is not reused by its own stream while ``stream`` works on it."""
    tensor.record_stream(stream)


def _pinned(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A new flat host tensor of ``numel`` elements of ``like``'s dtype: pinned for a CUDA
    tensor (asynchronous copies)."""
    return torch.empty(numel, dtype=like.dtype, pin_memory=like.is_cuda)


HOST_POOL_MAX_BYTES = 1 << 30  # host buffers kept for reuse at most (more are freed)


class _HostPool:
    """Host buffers reused across steps (module docstring, **Staged**), by (device, dtype,
    number of elements). A buffer comes back with an event recorded after the last copy that
    touches it (``give``) and is handed out again only once that event has completed, asked
    host-side without waiting (``take``): never while a copy that reads or writes it is
    pending. A buffer of a failed operation never comes back (it is freed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.device, torch.dtype, int], collections.deque[Any]] = {}
        self._free_bytes = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like ``like``: the oldest given back whose copies are done,
        else a new one."""
        numel = like.numel()
        key = (like.device, like.dtype, numel)
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer, after = free[0]
                if after is None or after.query():  # (host-side, no wait)
                    free.popleft()
                    self._free_bytes -= buffer.numel() * buffer.element_size()
                    return buffer.view(like.shape)
        return _pinned(like, numel).view(like.shape)

    def give(self, device: torch.device, buffers: Iterable[torch.Tensor], after: Any) -> None:
        """``buffers`` (taken for ``device``'s tensors) free for reuse once ``after`` (an event;
        None: at once) has completed."""
        with self._lock:
            for buffer in buffers:
                nbytes = buffer.numel() * buffer.element_size()
                if self._free_bytes + nbytes > HOST_POOL_MAX_BYTES:
                    continue  # freed (torch's host allocator waits for its copies)
                key = (device, buffer.dtype, buffer.numel())
                self._free.setdefault(key, collections.deque()).append((buffer, after))
                self._free_bytes += nbytes


_host_pool = _HostPool()


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host buffer shaped like ``like`` for one staged tensor, from the pool."""
    return _host_pool.take(like)


def _event(stream: Any) -> Any:
    """An event recorded on ``stream`` now (None for the CPU: nothing to wait for)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


# -- order: whoever waits on a future after the device work queued for it (module docstring) --
Marks = tuple[tuple[torch.device, Any, Any], ...]  # (device, stream, event recorded on it)
_marked: tuple[torch.device, ...] = ()  # the devices futures carry marks for


def mark_futures_on(device: torch.device) -> None:
    """From now on, futures completed in this process carry marks for ``device`` (``prepare``
    and ``stage`` call it for the devices the engine works on, the DDP hook for its buckets')."""
    global _marked
    if device not in _marked:
        _marked = (*_marked, device)


def marks() -> Marks | None:
    """An event recorded now on the calling thread's current stream of each marked device, after
    the work it queued there; None when no device is marked (a CPU job's futures carry none)."""
    if not _marked:
        return None
    found = []
    for device in _marked:
        stream = _current_stream(device)
        if stream is not None:
            found.append((device, stream, _event(stream)))
    return tuple(found) or None


def follow(marks: Marks) -> None:
    """Make the calling thread's current streams wait on ``marks`` (no host wait); a stream that
    recorded one is already ordered after it."""
    for device, stream, event in marks:
        current = _current_stream(device)
        if current is not None and current != stream:
            current.wait_event(event)


def future_devices() -> list[torch.device]:
    """The devices a torch Future standing for a commlayer one declares (``Future.to_torch``):
    every CUDA device once one is marked, so that torch's Future records events for its value
    and its waiters and callbacks wait on them; none otherwise."""
    if not any(device.type == "cuda" for device in _marked):
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


class Staged:
    """The host side of one operation's staged tensors (module docstring, steps 2 and 3)."""

    __slots__ = ("device", "ready", "_copied", "_caller", "_outputs", "_buffers")

    def __init__(
        self,
        device: torch.device,
        outputs: dict[int, torch.Tensor],
        buffers: list[torch.Tensor],
        copied: Any,
        caller: Any,
    ) -> None:
        self.device = device
        self._outputs = outputs  # id(host output) -> the caller's device output
        self._buffers = buffers  # the host buffers taken from the pool (given back by unstage)
        self._copied = copied  # event after the copies in (None: nothing to wait for)
        self._caller = caller  # the caller's stream at submit (None for the CPU)
        self.ready: Request = COMPLETED if copied is None else _EventRequest(copied)

    def unstage(self, raw: Any) -> Any:
        """``raw`` (the collective's host result) on the device (step 3): copied back on the
        device's H2D stream, which waits for this operation's copies in (and so for the caller's
        stream at submit) but not for later operations' ones; the calling thread's current
        stream of the device (the engine's work stream) then waits for the copies back, so the
        future's marks, recorded on it when it completes, order whoever reads the result after
        them. No host wait. The host buffers go back to the pool, reusable once the copies back
        are done."""
        stream = _h2d_stream(self.device)
        if stream is not None and self._copied is not None:
            stream.wait_event(self._copied)
        with _on(stream):
            result = self._map(raw)
            done = _event(stream)
        if done is not None:
            work = _work_stream(self.device)
            _set_stream(self.device, work)  # the engine's device work: on its work stream
            work.wait_event(done)
        _host_pool.give(self.device, self._buffers, done)
        self._buffers = []
        return result

    def _map(self, raw: Any) -> Any:
        if isinstance(raw, torch.Tensor):
            out = self._outputs.get(id(raw))
            if out is None:  # a result the collective created (maybe a pooled buffer's view)
                out = torch.empty(raw.shape, dtype=raw.dtype, device=self.device)
                _copy(out, raw)
                if self._caller is not None:  # made on the H2D stream, read on the caller's
                    _keep(out, self._caller)
                return out
            if out is not raw:  # (a CPU output of a group with CUDA members is its own)
                _copy(out, raw)
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


def path(backend: Backend, device: torch.device, dtype: torch.dtype) -> Path | None:
    """The one decision: does ``backend`` take ``device``'s tensors of ``dtype`` as they are
    (how, when it does)? None: stage them (CUDA) or nothing to decide (CPU)."""
    if device.type == "cpu":
        return DIRECT_CPU
    if DIRECT_PATHS not in backend.capabilities:
        return None
    direct: DirectPaths = backend  # type: ignore[assignment]  # declared: no cast() call per op
    return direct.direct_path(device, dtype)


@functools.cache
def _work_stream(device: torch.device) -> Any:
    """The stream the engine thread queues its device work on for ``device`` (one per device;
    None for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return None


_channel_devices: dict[str, torch.device] = {}  # the device each channel was last used with


def channel_device(channel: str) -> torch.device:
    """Where a rank that has no tensors of an operation (a joined rank) makes its buffers: the
    CPU for operations without a channel, else the device this rank used the channel with
    (the current CUDA device if it never did)."""
    if not channel:
        return _CPU
    found = _channel_devices.get(channel)
    if found is None:
        return torch.device("cuda", torch.cuda.current_device())
    return found


_CPU = torch.device("cpu")


class _Produced:
    """The engine's wait for the producer's event before a direct operation's collective
    (module docstring, **Direct**): a Request the engine polls like a staged one."""

    __slots__ = ("device", "wait", "event")

    def __init__(self, device: torch.device, wait: str, event: Any) -> None:
        self.device, self.wait, self.event = device, wait, event

    def test(self) -> bool:
        stream = _work_stream(self.device)
        if stream is not None:  # the engine thread's device work goes on its own stream
            _set_stream(self.device, stream)
        if self.event is None:
            return True
        if self.wait == "host":  # MPI: the producer's work must be done before MPI reads
            return bool(self.event.query())
        if stream is not None:  # NCCL: its stream follows the work stream, which follows this
            stream.wait_event(self.event)
        else:
            self.event.wait()
        return True


class Direct:
    """A direct operation's device side (module docstring, **Direct**)."""

    __slots__ = ("device", "route", "ready", "_caller", "_outputs")

    def __init__(
        self,
        device: torch.device,
        route: Path,
        produced: Any,
        caller: Any = None,
        outputs: Sequence[torch.Tensor] = (),
    ) -> None:
        self.device, self.route = device, route
        self.ready: Request = _Produced(device, route.wait, produced)
        self._caller = caller  # the caller's stream at submit (None: nothing to keep)
        self._outputs = outputs

    def done(self, raw: Any) -> Any:
        """``raw``, at once: no host wait. The engine's device work on it (the collective, the
        unpack) is queued on its work stream, the engine thread's current stream, on which the
        future's marks are recorded when it completes (**Order**). A tensor the engine made
        (allgather's result...) was allocated on the work stream and is read on the caller's:
        it is kept from reuse until the caller's stream is done with it."""
        if self._caller is not None and raw is not self._outputs:
            mine = {id(t) for t in self._outputs}
            for tensor in _tensors(raw):
                if id(tensor) not in mine:
                    _keep(tensor, self._caller)
        return raw

    def wrap(self, finish: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        if finish is None:
            return self.done
        return lambda raw: finish(self.done(raw))


def _tensors(raw: Any) -> Iterator[torch.Tensor]:
    """The device tensors in a collective's result (a tensor, or lists and tuples of them)."""
    if isinstance(raw, torch.Tensor):
        if raw.device.type != "cpu":
            yield raw
    elif isinstance(raw, (list, tuple)):
        for item in raw:
            yield from _tensors(item)


def _staged(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or STAGE_CPU


def _device_of(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in (*inputs, *outputs) if _staged(t) or DIRECT_CPU is not None}
    if len(devices) > 1:
        raise ValueError(
            "the tensors of one operation must be on one device (or the CPU); got "
            f"{sorted(map(str, devices))}"
        )
    (device,) = devices
    return device


def prepare(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], backend: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], Staged | Direct | None, str]:
    """An operation's tensors as the engine gets them, the record that brings the result back
    (None: plain CPU tensors), and its channel (negotiated; "" for none)."""
    # Every submit comes here: CPU operations leave after one is_cuda pass (13 us for a group of
    # 100 tensors in place, where reading each tensor's device took 65 us).
    if not (
        (STAGE_CPU or DIRECT_CPU is not None)
        and (inputs or outputs)
        or any(t.is_cuda for t in inputs)
        or any(t.is_cuda for t in outputs)
    ):  # the tests' staging of CPU tensors stages tensors: an operation of none has nothing
        return list(inputs), list(outputs), None, ""
    device = _device_of(inputs, outputs)
    route = None
    every = (*inputs, *outputs)
    if not STAGE_CPU and all(t.device == device for t in every):  # a CPU member: staged
        dtype = every[0].dtype if every else torch.uint8
        route = path(backend, device, dtype)
    if route is None:
        return (*stage(inputs, outputs, device), "")  # type: ignore[return-value]
    _channel_devices[route.channel] = device
    produced = caller = None
    stream = _work_stream(device)
    outputs = list(outputs)
    if stream is not None:
        caller = _current_stream(device)
        produced = _event(caller)
        for tensor in every:  # not reused by the caller's stream while the engine works on it
            _keep(tensor, stream)
        mark_futures_on(device)
    elif DIRECT_CPU is not None:
        produced = _event(None)
    return list(inputs), outputs, Direct(device, route, produced, caller, outputs), route.channel


def stage(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    device: torch.device | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], Staged | None]:
    """Host stand-ins for an operation's tensors on a staged device (step 1), and the
    ``Staged`` record that brings the result back; (inputs, outputs, None) when none is."""
    if device is None:
        if not (STAGE_CPU or any(t.is_cuda for t in inputs) or any(t.is_cuda for t in outputs)):
            return list(inputs), list(outputs), None
        device = _device_of(inputs, outputs)
    stream, caller = _d2h_stream(device), _current_stream(device)
    if stream is not None:
        stream.wait_stream(caller)  # an event: not what the caller queues later
        mark_futures_on(device)
    host: dict[int, torch.Tensor] = {}  # id(device tensor) -> its host stand-in
    with _on(stream):
        for tensor in inputs:
            if _staged(tensor) and id(tensor) not in host:
                buffer = host[id(tensor)] = _host_buffer(tensor)
                _copy(buffer, tensor)
                if stream is not None:
                    _keep(tensor, stream)  # not reused by the caller's stream meanwhile
        copied = _event(stream)
    h2d = None if stream is None else _h2d_stream(device)
    back: dict[int, torch.Tensor] = {}
    for tensor in outputs:
        if not _staged(tensor):
            back[id(tensor)] = tensor  # a CPU member of a group: its own result
            continue
        if id(tensor) not in host:  # an output that is not also an input
            host[id(tensor)] = _host_buffer(tensor)
        back[id(host[id(tensor)])] = tensor
        if h2d is not None:
            _keep(tensor, h2d)  # written there: not reused by the caller's stream meanwhile
    swapped = [host.get(id(t), t) for t in inputs], [host.get(id(t), t) for t in outputs]
    return swapped[0], swapped[1], Staged(device, back, list(host.values()), copied, caller)
