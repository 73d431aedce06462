"""Compressor contract: what a compressor is, and the registry that finds one by name.

Building one from a spec (parameters, rank and seed, error feedback) is factory.py's: this module
imports no compressor and no wrapper, so every compressor can import it.

``Compressor.compress(tensor, name) -> Compressed(payload, ctx)`` and
``decompress(Compressed) -> tensor``. A compressor declares what it is in class attributes; the
code that moves, chooses and costs payloads (the communicator, the factory, the policy,
``auto``, the oracle) reads these declarations and never a compressor's name:

1. ``summable=True`` (none, fp16, bf16, randomk, powersgd): the payload is one tensor whose sum
   over ranks is the payload of the sum; it is allreduced **in place**, then decompressed.
   A compressor needing several communication rounds (PowerSGD) returns
   ``Compressed(..., final=False)`` and implements ``next_round(compressed, name)``, called
   with the reduced payload and returning the next round's ``Compressed``.
2. ``summable=False`` (qsgd, topk, efsignsgd, onebit): every rank's payload is gathered and
   each is decompressed with the *local* ``ctx``, so ``ctx`` may depend only on the tensor's
   shape and dtype, never on its values. ``decompress`` must check a peer's payload (lengths,
   index range, finite scales) and raise :class:`~commlayer.common.errors.PayloadError`.

Optional declarations (absent: the default in brackets):

- ``sparse`` [False]: the payload is ``[values, int32 flat indices]`` of distinct positions
  (topk), so a sparse allreduce algorithm (``COMMLAYER_SPARSE_ALGORITHM``) may reduce it
  instead of the gather.
- ``identity`` [False]: the payload is the tensor itself (none; auto before it decides): the
  tensors are reduced where they lie, with no compress, decompress or callback.
- ``biased`` [False]: ``factory.create`` wraps the compressor in ErrorFeedback unless the spec
  says ``ef=0``.
- ``compresses_small_tensors`` [False]: True for casts, which cost nothing per tensor; others
  skip tensors below the policy's threshold.
- ``wire_dtype`` [None: the tensor's]: the dtype a summable payload is reduced in (casts).
- ``wire_parameters`` [()]: the spec parameters the payload's size depends on and that a cost
  prediction (the oracle) must be given rather than assume (topk's and randomk's ``ratio``).
- ``wire_bytes(numel, element_bytes=4)``: bytes of one rank's payload for a tensor of ``numel``
  elements of ``element_bytes`` each, or ``round_bytes(shape, element_bytes=4)``, a list with
  each round's bytes, where they depend on the tensor's shape (PowerSGD). ``auto`` and the
  oracle cost payloads with them; a compressor declaring neither is not costed.
- ``state_dict``/``load_state_dict``: state saved with the optimizer.
- ``take_residual(name)``: a residual kept for ``name`` (error feedback), removed, or None: the
  per-host path adds it to what this rank sends where the rank no longer compresses ``name``.
- ``hierarchy`` [None: COMMLAYER_COMPRESSION_HIERARCHY]: ``flat``, ``host`` or ``auto``, set
  by a spec's ``hierarchy=`` (factory.py): where this compressor's buckets are compressed when
  a process set spans several hosts (comm/hierarchy.py). Error feedback needs nothing of the
  compressor there: its residual is kept by the one rank that compresses the bucket.

A built-in compressor is one file (its ``name`` the file's) and one line of ``BUILTINS`` in
``commlayer/compression/__init__.py``, which registers it. Users add their own with
``@commlayer.compression.register("name")`` (``registered(name, factory)`` for a block), or from
another package with an entry point in the group ``commlayer.compressors``
(``name = "module:factory"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import math
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from commlayer.common.errors import PayloadError

ENTRY_POINT_GROUP = "commlayer.compressors"
_log = logging.getLogger("commlayer")


@dataclasses.dataclass
class Compressed:
    """What goes on the wire (payload tensors) and what stays home to decode it (ctx).
    ``final=False``: a multi-round compressor has another round after this one."""

    payload: list[torch.Tensor]
    ctx: Any = None
    final: bool = True

    def __iter__(self) -> Iterator[Any]:
        """``tensor, ctx = Compression.fp16.compress(t)``, as horovod.torch's compressors
        return: the payload (its one tensor, else the list) and the context."""
        yield self.payload[0] if len(self.payload) == 1 else self.payload
        yield self.ctx


def horovod_args(compressed: Compressed | torch.Tensor, ctx: Any) -> Compressed:
    """decompress()'s argument from horovod.torch's ``decompress(tensor, ctx)`` as well."""
    if isinstance(compressed, torch.Tensor):
        return Compressed([compressed], ctx)
    return compressed


class Compressor(Protocol):
    """A (possibly lossy) encoding of a gradient for communication."""

    @property
    def name(self) -> str: ...

    @property
    def summable(self) -> bool: ...

    def compress(self, tensor: torch.Tensor, name: str) -> Compressed: ...

    def decompress(self, compressed: Compressed) -> torch.Tensor: ...


_REGISTRY: dict[str, Callable[..., Compressor]] = {}
C = TypeVar("C", bound=Callable[..., Any])


def register(name: str) -> Callable[[C], C]:
    """Class decorator: make a compressor available as ``name`` (and in COMMLAYER_COMPRESSION);
    ``register(name)(factory)`` for a factory that is not a class."""

    def decorate(factory: C) -> C:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"a compressor named {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorate


def unregister(name: str) -> None:
    """Remove compressor ``name`` (ValueError if it is not registered)."""
    if _REGISTRY.pop(name, None) is None:
        raise ValueError(f"{name!r} is not a registered compressor")


@contextlib.contextmanager
def registered(name: str, factory: Callable[..., Compressor]) -> Iterator[None]:
    """``factory`` registered as ``name`` inside the block, removed after it (tests)."""
    register(name)(factory)
    try:
        yield
    finally:
        unregister(name)


def _load_entry_points() -> None:
    """Register compressors other packages declare in the ``commlayer.compressors`` group.
    A broken plug-in is logged and skipped: it must not break every other compressor."""
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _REGISTRY:
            continue
        try:
            _REGISTRY[entry.name] = entry.load()
        except Exception as exc:  # noqa: BLE001 - any import error of a third-party plug-in
            _log.warning("compressor entry point %r (%s) failed to load: %s", entry.name,
                         entry.value, exc)  # fmt: skip


def available() -> list[str]:
    """Names ``create`` accepts, in registration order: the built-in compressors (as
    ``BUILTINS`` lists them), then those registered or declared by entry points."""
    _load_entry_points()
    return list(_REGISTRY)


def lookup(name: str) -> Callable[..., Compressor]:
    """The factory registered as ``name``; ValueError naming the available ones."""
    if name not in _REGISTRY:
        _load_entry_points()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown compressor {name!r}; available: {', '.join(available())}")
    return factory


def hierarchy_of(compressor: Compressor, default: str) -> str:
    """Where ``compressor``'s buckets are compressed across hosts: its spec's ``hierarchy=``,
    else ``default`` (the setting)."""
    chosen: str | None = getattr(compressor, "hierarchy", None)
    return chosen or default


def payload_bytes(compressor: Compressor, shape: torch.Size, element_bytes: int) -> list[int]:
    """Bytes of each round's payload one rank sends for a tensor of ``shape`` with
    ``element_bytes`` an element, as ``compressor`` (an ErrorFeedback's inner one) declares
    them: ``round_bytes``, else ``wire_bytes`` (one round); ValueError where it declares
    neither."""
    target: Any = getattr(compressor, "inner", compressor)
    rounds = getattr(target, "round_bytes", None)
    if rounds is not None:
        return list(rounds(shape, element_bytes))
    wire_bytes = getattr(target, "wire_bytes", None)
    if wire_bytes is None:
        raise ValueError(f"compressor {target.name!r} declares no wire_bytes: its cost is unknown")
    return [wire_bytes(shape.numel(), element_bytes)]


# -- helpers the compressors share ---------------------------------------------------------------
def check_ratio(ratio: Any) -> float:
    """A fraction of elements to keep: a number in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def check_positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def kept(numel: int, ratio: float) -> int:
    """How many of ``numel`` elements a sparsifier keeps: ceil(ratio * numel), at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel - 1e-9)))


def stable_seed(*parts: object) -> int:
    """A seed equal on every rank for the same parts (Python's hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float16/bfloat16/float32 are computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_host_work_logged: set[tuple[str, str]] = set()


def host_work(compressor: str, device: torch.device, why: str) -> None:
    """Say, once per process and reason, that ``compressor`` does part of its work for a
    tensor on ``device`` on the CPU (nothing for a CPU tensor). Random numbers every rank must
    draw alike come from CPU generators, so that a CPU rank and a CUDA rank of one job (or of
    a test) draw the same; this is the trace of that choice in the log."""
    if device.type == "cpu" or (compressor, why) in _host_work_logged:
        return
    _host_work_logged.add((compressor, why))
    _log.info("compressor %s on %s: %s", compressor, device, why)


class RecordError(PayloadError):
    """One of several gathered records refused by a compressor that decodes them together
    (``decompress_sum_``): ``record`` is its index, the rank that sent it."""

    def __init__(self, record: int, message: str) -> None:
        super().__init__(message)
        self.record = record


def expect_numel(tensor: torch.Tensor, numel: int, what: str) -> None:
    if tensor.numel() != numel:
        raise PayloadError(f"{what} has {tensor.numel()} elements, expected {numel}")


def expect_finite(tensor: torch.Tensor, what: str, nonnegative: bool = False) -> None:
    bad = ~torch.isfinite(tensor)
    if nonnegative:
        bad |= tensor < 0
    if bool(bad.any()):
        value = tensor[bad][0].item()
        allowed = "finite and >= 0" if nonnegative else "finite"
        raise PayloadError(f"{what} holds {value!r} (must be {allowed})")
