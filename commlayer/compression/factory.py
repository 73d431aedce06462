"""Compressor factory: a compressor from its spec, with rank and seed passed in.

``create("topk:ratio=0.01", rank=3, seed=7)``:

1. The name is looked up in the registry (base.py: built-ins, ``register``, entry points).
2. ``key=value`` parameters go to the compressor's constructor, which checks them; a key it does
   not take is a ValueError listing the ones it does.
3. ``rank`` (this process's rank) goes to compressors whose randomness must differ per rank
   (QSGD's rounding) as ``process_rank``; ``seed`` (equal on every rank) goes to those taking
   ``seed`` unless the spec sets one. Compressors call no runtime function: the caller (the
   optimizer, the DDP hook) knows the rank.
4. Biased compressors come wrapped in :class:`ErrorFeedback` unless the spec says ``ef=0``.
5. ``hierarchy=flat|host|auto`` (any compressor) is where its buckets are compressed when a
   process set spans several hosts (COMMLAYER_COMPRESSION_HIERARCHY, which it overrides for
   this compressor): kept on the compressor as ``hierarchy`` (base.py), read by the optimizer
   and the DDP hook (comm/hierarchy.py).

Here, not in base.py, because it needs ErrorFeedback, which needs the contract: base.py imports
neither, so the import graph has no cycle.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from commlayer.common.config import HIERARCHIES
from commlayer.compression.base import Compressor, CompressorBase, available, declared, lookup
from commlayer.compression.error_feedback import ErrorFeedback

# Constructor keywords create() fills itself; a spec may not set them.
_PASSED_IN = ("process_rank",)


def create(
    spec: str | Compressor | CompressorBase, *, rank: int | None = None, seed: int | None = None
) -> CompressorBase:
    """A compressor from ``"name"`` or ``"name:key=value,key=value"`` (or one passed through).

    ``rank``: this process's rank (None: unknown, taken as 0). ``seed``: default seed, equal on
    every rank, for compressors that take one (None: the compressor's own default). A
    compressor passed in that was made without a rank (``QSGDCompressor()``) gets ``rank``
    (``bind_rank``). The compressor is a :class:`CompressorBase` (``declared``: one with the
    minimum only is given the defaults).
    """
    if not isinstance(spec, str):
        compressor = declared(spec)
        if rank is not None:
            compressor.bind_rank(rank)
        return compressor
    name, kwargs = split_spec(spec)
    factory = lookup(name)
    error_feedback = kwargs.pop("ef", None)
    hierarchy = kwargs.pop("hierarchy", None)
    allowed = _parameters(factory)
    unknown = sorted(set(kwargs) - set(allowed)) if allowed is not None else []
    if unknown:
        raise ValueError(
            f"compressor {name!r} does not take parameter(s) {unknown}; allowed: "
            f"{', '.join([*allowed, 'ef', 'hierarchy'] if allowed else ['ef', 'hierarchy'])}"
        )
    _pass_in(kwargs, factory, process_rank=rank, seed=seed)
    try:
        made = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"compressor {name!r} does not take parameters {kwargs}: {exc}") from None
    if error_feedback not in (None, 0, 1):
        raise ValueError(f"ef={error_feedback!r} in {spec!r}: allowed 0 (off) or 1 (on)")
    if hierarchy is not None and hierarchy not in HIERARCHIES:
        raise ValueError(f"hierarchy={hierarchy!r} in {spec!r}: allowed {', '.join(HIERARCHIES)}")
    compressor = declared(made)
    if error_feedback if error_feedback is not None else compressor.biased:
        compressor = ErrorFeedback(compressor)
    if hierarchy is not None:
        _set_hierarchy(compressor, hierarchy, spec)
    return compressor


def _set_hierarchy(compressor: CompressorBase, hierarchy: str, spec: str) -> None:
    try:
        compressor.hierarchy = hierarchy
    except AttributeError:
        raise ValueError(
            f"hierarchy= in {spec!r}: {type(compressor).__name__} has no attribute to keep it "
            "in (a class with __slots__ needs a 'hierarchy' slot)"
        ) from None


def spec_help() -> str:
    """What COMMLAYER_COMPRESSION allows (commlayer.core.registries): the registered names now."""
    return (
        f"a compressor 'name' or 'name:key=value,...' with a valid name ({', '.join(available())})"
        " and valid parameters, e.g. 'topk:ratio=0.01' or 'auto:lossy=1'"
    )


def check_spec(text: str) -> str:
    """COMMLAYER_COMPRESSION's validator (commlayer.core.registries): the spec, stripped, when
    ``create`` accepts it; ValueError otherwise."""
    spec = text.strip()
    create(spec)
    return spec


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,..."`` as (name, {key: value}), numbers as int or float."""
    name, _, params = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"compressor parameter {item!r} in {spec!r} must be key=value")
        kwargs[key.strip()] = _number(value.strip())
    return name.strip(), kwargs


def _pass_in(kwargs: dict[str, Any], factory: Callable[..., Any], **given: int | None) -> None:
    """Add each given value the factory names as a parameter (rank, seed) unless the spec set
    it (a factory taking ``**kwargs`` gets none: it may not expect them)."""
    takes = _parameters(factory, include_passed_in=True) or []
    for key, value in given.items():
        if value is not None and key not in kwargs and key in takes:
            kwargs[key] = value


def _parameters(factory: Callable[..., Any], include_passed_in: bool = False) -> list[str] | None:
    """Keyword parameters ``factory`` takes (a spec may set: not ``process_rank``), or None when
    it takes ``**kwargs``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and (include_passed_in or p.name not in _PASSED_IN)
    ]


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
