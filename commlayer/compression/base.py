"""Compressor contract: what a compressor is, and the registry that finds one by name.

``Compressor.compress(tensor, name) -> Compressed(payload, ctx)`` and
``decompress(Compressed) -> tensor``. The class attribute ``summable`` tells the engine how to
communicate: True when the payloads of all ranks can be allreduced (FP16, BF16, ...), False
when they must be gathered. Users add their own with ``@commlayer.compression.register("name")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

import torch


@dataclasses.dataclass
class Compressed:
    """What goes on the wire (payload tensors) and what stays home to decode it (ctx)."""

    payload: list[torch.Tensor]
    ctx: Any = None


class Compressor(Protocol):
    """A (possibly lossy) encoding of a gradient for communication."""

    name: ClassVar[str]
    summable: ClassVar[bool]

    def compress(self, tensor: torch.Tensor, name: str) -> Compressed: ...

    def decompress(self, compressed: Compressed) -> torch.Tensor: ...


_REGISTRY: dict[str, Callable[..., Compressor]] = {}
C = TypeVar("C", bound=Callable[..., Any])


def register(name: str) -> Callable[[C], C]:
    """Class decorator: make a compressor available as ``name`` (and in COMMLAYER_COMPRESSION)."""

    def decorate(factory: C) -> C:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"a compressor named {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorate


def available() -> list[str]:
    return sorted(_REGISTRY)


def create(spec: str | Compressor) -> Compressor:
    """A compressor from ``"name"`` or ``"name:key=value,key=value"`` (or one passed through)."""
    if not isinstance(spec, str):
        return spec
    name, _, params = spec.partition(":")
    factory = _REGISTRY.get(name.strip())
    if factory is None:
        raise ValueError(f"unknown compressor {name!r}; available: {', '.join(available())}")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"compressor parameter {item!r} in {spec!r} must be key=value")
        kwargs[key.strip()] = _number(value.strip())
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"compressor {name!r} does not take parameters {kwargs}: {exc}") from None


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
