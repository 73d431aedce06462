"""Compressor contract: what a compressor is, and the registry that finds one by name.

Building one from a spec (parameters, rank and seed, error feedback) is factory.py's: this module
imports no compressor and no wrapper, so every compressor can import it.

``Compressor.compress(tensor, name) -> Compressed(payload, ctx)`` and
``decompress(Compressed) -> tensor``. A compressor declares what it is; the code that moves,
chooses and costs payloads (the communicator, the factory, the policy, ``auto``, the oracle)
reads these declarations, typed and checked by mypy, and never a compressor's name, nor probes
it for members:

1. ``summable=True`` (none, fp16, bf16, randomk, powersgd): the payload is one tensor whose sum
   over ranks is the payload of the sum; it is allreduced **in place**, then decompressed.
   A compressor needing several communication rounds (PowerSGD) returns
   ``Compressed(..., final=False)`` and declares ``MULTI_ROUND`` (below).
2. ``summable=False`` (qsgd, topk, efsignsgd, onebit): every rank's payload is gathered and
   each is decompressed with the *local* ``ctx``, so ``ctx`` may depend only on the tensor's
   shape and dtype, never on its values. ``decompress`` must check a peer's payload (lengths,
   index range, finite scales) and raise :class:`~commlayer.common.errors.PayloadError`.

The minimum (:class:`Compressor`) is those four members: ``name``, ``summable``, ``compress``
and ``decompress``. Everything else is declared on :class:`CompressorBase`, which every
built-in compressor and ErrorFeedback subclass; a compressor that is not one is given
CompressorBase's defaults by ``declared`` (factory.create calls it), and refused there if it
has members of the declarations below (they would be ignored: subclass CompressorBase).

Declarations (CompressorBase's default in brackets):

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
- ``hierarchy`` [None: COMMLAYER_COMPRESSION_HIERARCHY]: ``flat``, ``host`` or ``auto``, set
  by a spec's ``hierarchy=`` (factory.py): where this compressor's buckets are compressed when
  a process set spans several hosts (comm/hierarchy.py). Error feedback needs nothing of the
  compressor there: its residual is kept by the one rank that compresses the bucket.
- ``bind_rank(rank)`` [nothing]: told this process's rank where it was made without one
  (QSGD's rounding noise differs per rank).
- ``capabilities`` [empty]: a frozenset naming the optional protocols below that the
  compressor implements, as backends declare theirs (backends/base.py). A caller checks
  membership, then casts to the protocol:

  - ``WIRE_BYTES`` (:class:`WireBytes`): ``wire_bytes(numel, element_bytes=4)``, bytes of one
    rank's payload for a tensor of ``numel`` elements; ``ROUND_BYTES`` (:class:`RoundBytes`):
    ``round_bytes(shape, element_bytes=4)``, each round's bytes, where they depend on the
    shape (PowerSGD). ``auto`` and the oracle cost payloads with them (``payload_bytes``); a
    compressor declaring neither is not costed.
  - ``MULTI_ROUND`` (:class:`MultiRound`): ``next_round(compressed, name)``, called with the
    reduced payload of a round that was not final, returning the next round's
    ``Compressed``, and ``next_rounds`` for several tensors at once (PowerSGD: one batched QR).
  - ``DECOMPRESS_INTO`` (:class:`DecompressInto`): the reduced payload written into the
    tensor (casts: one converting copy) instead of ``decompress`` and a copy.
  - ``DECOMPRESS_ADD`` (:class:`DecompressAdd`): ``check_payload`` and ``decompress_add_``: a
    gathered record added into the tensor (top-k: no dense tensor per rank).
  - ``DECOMPRESS_SUM`` (:class:`DecompressSum`): every gathered record decoded and summed in
    one call (QSGD).
  - ``STATEFUL`` (:class:`Stateful`): ``state_dict``/``load_state_dict``, state saved with the
    optimizer.
  - ``RESIDUALS`` (:class:`Residuals`, error feedback): ``take_residual(name)``, a residual
    kept for ``name``, removed, or None: the per-host path adds it to what this rank sends
    where the rank no longer compresses ``name``; ``add_dropped``: entries a sparse
    reduction dropped, added to the residual.
  - error feedback's fast paths through the inner compressor (error_feedback.py): ``DROP_SENT``
    (:class:`DropSent`: the sent entries zeroed in the corrected tensor, top-k, random-k),
    ``COMPRESS_SUM`` (:class:`CompressSum`: the correction and the selection in one kernel,
    top-k), ``LOCAL_ERROR`` (:class:`LocalError`: the residual in one fused product, PowerSGD).

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
from typing import Any, Protocol, TypeVar, cast

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
    """A (possibly lossy) encoding of a gradient for communication: the minimum a compressor
    implements (module docstring); :class:`CompressorBase` declares the rest."""

    @property
    def name(self) -> str: ...

    @property
    def summable(self) -> bool: ...

    def compress(self, tensor: torch.Tensor, name: str) -> Compressed: ...

    def decompress(self, compressed: Compressed) -> torch.Tensor: ...


# The optional protocols a compressor's ``capabilities`` may name (module docstring).
WIRE_BYTES = "wire_bytes"
ROUND_BYTES = "round_bytes"
MULTI_ROUND = "multi_round"
DECOMPRESS_INTO = "decompress_into"
DECOMPRESS_ADD = "decompress_add"
DECOMPRESS_SUM = "decompress_sum"
STATEFUL = "stateful"
RESIDUALS = "residuals"
DROP_SENT = "drop_sent"
COMPRESS_SUM = "compress_sum"
LOCAL_ERROR = "local_error"


class CompressorBase:
    """A compressor with every declaration (module docstring), each with its default: the
    built-in compressors and ErrorFeedback subclass it, and so may a user's compressor that
    declares more than the minimum."""

    name: str
    summable: bool
    sparse: bool = False
    identity: bool = False
    biased: bool = False
    compresses_small_tensors: bool = False
    wire_dtype: torch.dtype | None = None
    wire_parameters: tuple[str, ...] = ()
    hierarchy: str | None = None
    capabilities: frozenset[str] = frozenset()

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        raise NotImplementedError(f"{type(self).__name__}.compress")

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.decompress")

    def bind_rank(self, rank: int) -> None:
        """Told this process's rank (``create(compressor, rank=r)``): nothing by default."""


class WireBytes(Protocol):
    """``WIRE_BYTES``: bytes of one rank's payload for ``numel`` elements of ``element_bytes``."""

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int: ...


class RoundBytes(Protocol):
    """``ROUND_BYTES``: each round's bytes of one rank's payload for a tensor of ``shape``."""

    def round_bytes(self, shape: torch.Size, element_bytes: int = 4) -> list[int]: ...


class MultiRound(Protocol):
    """``MULTI_ROUND``: a payload that is not final has a next round, made from the reduced
    one (None where there is none)."""

    def next_round(self, compressed: Compressed, name: str = "") -> Compressed | None: ...

    def next_rounds(self, rounds: list[tuple[Compressed, str]]) -> list[Compressed | None]: ...


class DecompressInto(Protocol):
    """``DECOMPRESS_INTO``: the reduced payload decompressed into ``out``."""

    def decompress_into(self, compressed: Compressed, out: torch.Tensor) -> None: ...


class DecompressAdd(Protocol):
    """``DECOMPRESS_ADD``: a gathered record checked, then added (times ``alpha``) into the
    flat tensor ``out``."""

    def check_payload(self, compressed: Compressed) -> Any: ...

    def decompress_add_(self, compressed: Compressed, out: torch.Tensor, alpha: float) -> None: ...


class DecompressSum(Protocol):
    """``DECOMPRESS_SUM``: every gathered record decoded and summed into the flat tensor
    ``out``, divided by ``divisor`` (a bad record raises RecordError)."""

    def decompress_sum_(
        self, records: list[Compressed], out: torch.Tensor, divisor: float
    ) -> None: ...


class Stateful(Protocol):
    """``STATEFUL``: state saved and restored with the optimizer."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Residuals(Protocol):
    """``RESIDUALS``: error feedback's residuals, handed over or added to."""

    def take_residual(self, name: str) -> torch.Tensor | None: ...

    def add_dropped(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None: ...


class DropSent(Protocol):
    """``DROP_SENT``: ``corrected`` with the entries ``compressed`` sends exactly zeroed."""

    def drop_sent_(self, corrected: torch.Tensor, compressed: Compressed) -> torch.Tensor: ...


class CompressSum(Protocol):
    """``COMPRESS_SUM``: compress ``acc + tensor``, the sum made in ``acc``."""

    def compress_sum_(
        self, acc: torch.Tensor, tensor: torch.Tensor, name: str = ""
    ) -> Compressed: ...


class LocalError(Protocol):
    """``LOCAL_ERROR``: ``corrected`` minus this rank's own decompression of ``compressed``."""

    def local_error(self, corrected: torch.Tensor, compressed: Compressed) -> torch.Tensor: ...


# Members of the declarations only CompressorBase's subclasses are read for: a compressor that
# is not one and has any of them was written for them, and would silently lose them.
_DECLARATIONS = (
    "sparse", "identity", "biased", "compresses_small_tensors", "wire_dtype", "wire_parameters",
    "capabilities", "wire_bytes", "round_bytes", "next_round", "next_rounds", "decompress_into",
    "decompress_add_", "decompress_sum_", "state_dict", "load_state_dict", "take_residual",
)  # fmt: skip


class _Minimal(CompressorBase):
    """A compressor with the minimum only (:class:`Compressor`), given the defaults."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.name = compressor.name
        self.summable = compressor.summable

    def __repr__(self) -> str:
        return repr(self.compressor)

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        return self.compressor.compress(tensor, name)

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        return self.compressor.decompress(compressed)


def declared(compressor: Compressor | CompressorBase) -> CompressorBase:
    """``compressor`` as a :class:`CompressorBase`: itself where it is one, else wrapped with
    the defaults; TypeError where it has members of declarations it would lose that way."""
    if isinstance(compressor, CompressorBase):
        return compressor
    missing = [
        m for m in ("name", "summable", "compress", "decompress") if not hasattr(compressor, m)
    ]
    if missing:
        raise TypeError(
            f"{type(compressor).__name__} is not a compressor: it lacks {', '.join(missing)} "
            "(commlayer.compression.Compressor)"
        )
    unread = [m for m in _DECLARATIONS if hasattr(compressor, m)]
    if unread:
        raise TypeError(
            f"compressor {type(compressor).__name__} declares {', '.join(unread)}, which are read "
            "from subclasses of commlayer.compression.CompressorBase only: subclass it"
        )
    return _Minimal(compressor)


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


def hierarchy_of(compressor: CompressorBase, default: str) -> str:
    """Where ``compressor``'s buckets are compressed across hosts: its spec's ``hierarchy=``,
    else ``default`` (the setting)."""
    return compressor.hierarchy or default


def costed(compressor: CompressorBase) -> bool:
    """Whether ``compressor`` declares its payload's size (``payload_bytes`` answers)."""
    return bool(compressor.capabilities & {WIRE_BYTES, ROUND_BYTES})


def payload_bytes(compressor: CompressorBase, shape: torch.Size, element_bytes: int) -> list[int]:
    """Bytes of each round's payload one rank sends for a tensor of ``shape`` with
    ``element_bytes`` an element, as ``compressor`` declares them: ``round_bytes``, else
    ``wire_bytes`` (one round); ValueError where it declares neither."""
    if ROUND_BYTES in compressor.capabilities:
        return list(cast(RoundBytes, compressor).round_bytes(shape, element_bytes))
    if WIRE_BYTES not in compressor.capabilities:
        raise ValueError(
            f"compressor {compressor.name!r} declares no wire_bytes: its cost is unknown"
        )
    return [cast(WireBytes, compressor).wire_bytes(shape.numel(), element_bytes)]


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
