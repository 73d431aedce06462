"""Bucketer: which gradients travel together, and when (commlayer's one bucket policy).

DistributedOptimizer asks it, for each gradient backward has made final, what to send now:

1. Before a plan (the first step, or after the world was re-formed), gradients wait outside
   buckets until ``bucket_bytes`` of them are ready (or the step's last one is), then go
   together (the engine negotiates and fuses what arrives together). The order in which
   backward made them ready is recorded.
2. After the first complete step the optimizer makes a plan from rank 0's recorded order (a
   collective: the same plan on every rank) with :func:`plan`, cut by :func:`cut`:
   ``bucket_bytes`` of gradients of one dtype and one compressor, in that order; each bucket
   made by :func:`bucket`. From then on a bucket is sent as soon as its
   last gradient is ready, as DDP's are; a hook is a counter (on the ResNet of
   benchmarks/train.py, 47 per-gradient submissions cost ~5 ms a step).
3. ``groups`` (Horovod's ``DistributedOptimizer(groups=...)``) are buckets fixed from the start:
   a group's gradients are sent together once all are ready, one collective per dtype and
   compressor among them (a grouped allreduce holds one dtype), submitted in one batch.
   Parameters outside every group follow 1. and 2.

The DDP hook (integrations/ddp.py) has no policy of its own to merge here: torch's DDP Reducer
makes its buckets and hands the hook each one's flat buffer.

The Bucketer keeps no tensors and moves nothing: the optimizer sends what it is told to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from commlayer.compression import CompressorBase

Param = torch.nn.Parameter


class Part(NamedTuple):
    """Gradients of one dtype and one compressor: one collective, named ``name``; compressed
    once per host where ``per_host`` (comm/hierarchy.py)."""

    params: list[Param]
    name: str
    compressor: CompressorBase
    per_host: bool = False


class Bucket:
    """Gradients sent together once the last of them is ready: one collective per part."""

    __slots__ = ("params", "parts", "ready", "handles")

    def __init__(self, parts: list[Part]) -> None:
        self.params = [p for part in parts for p in part.params]
        self.parts = parts
        self.ready = 0  # parameters whose gradient is final this step
        self.handles: list[Any] = []  # one future a part while in flight

    @property
    def compressors(self) -> list[CompressorBase]:
        return [part.compressor for part in self.parts]


def cut(
    params: list[Param],
    bucket_bytes: float,
    compressor_of: dict[Param, CompressorBase] | None = None,
) -> list[list[Param]]:
    """``params`` in order, per dtype and compressor, cut into buckets of at least
    ``bucket_bytes`` (the last of each kind may be smaller; 0: one parameter a bucket)."""
    buckets: list[list[Param]] = []
    filling: dict[tuple[torch.dtype, int], list[Param]] = {}
    filled: dict[tuple[torch.dtype, int], int] = {}
    for p in params:
        key = (p.dtype, id(compressor_of[p]) if compressor_of else 0)
        filling.setdefault(key, []).append(p)
        filled[key] = filled.get(key, 0) + p.numel() * p.element_size()
        if filled[key] >= bucket_bytes:
            buckets.append(filling.pop(key))
            del filled[key]
    return buckets + list(filling.values())


def plan(
    names: list[str],
    split: int,
    by_name: dict[str, Param],
    bucket_bytes: float,
    compressor_of: dict[Param, CompressorBase],
) -> list[list[Param]]:
    """The buckets of a plan (2.), from the gradients' names in rank 0's order: the gradients
    backward made ready (``names[:split]``), then the late ones, each part ``cut``."""
    buckets: list[list[Param]] = []
    for part in (names[:split], names[split:]):
        members = [by_name[name] for name in part]
        buckets += cut(members, bucket_bytes, compressor_of)
    return buckets


def bucket(
    params: list[Param],
    compressor_of: dict[Param, CompressorBase],
    names: dict[Param, str],
    per_host: Callable[[CompressorBase], bool],
) -> Bucket:
    """``params`` as one bucket, a part (one collective) per dtype and compressor, each named
    ``grad.bucket[first..last]`` after its first and last gradients (``names``: each
    parameter's operation name); compressed once per host where ``per_host`` says for the
    part's compressor."""
    parts = []
    for members in cut(params, math.inf, compressor_of):
        first, last = (names[p].removeprefix("grad.") for p in (members[0], members[-1]))
        compressor = compressor_of[members[0]]
        parts.append(
            Part(members, f"grad.bucket[{first}..{last}]", compressor, per_host(compressor))
        )
    return Bucket(parts)


def checked_groups(
    groups: Sequence[Sequence[torch.Tensor]], names: dict[Param, str]
) -> list[list[Param]]:
    """``groups=`` given as lists (3.), checked: each a list of the optimizer's parameters
    (those ``names`` names), each parameter in one group only."""
    grouped: dict[int, int] = {}  # id of a parameter: its group
    lists = []
    for index, members in enumerate(groups):
        if not isinstance(members, (list, tuple)) or not all(
            isinstance(p, torch.Tensor) for p in members
        ):
            raise ValueError(
                f"groups[{index}] must be a list of parameters (tensors), got {members!r}"
            )
        for position, p in enumerate(members):
            if p not in names:
                raise ValueError(
                    f"groups[{index}][{position}] (shape {tuple(p.shape)}) is not a "
                    "parameter of the optimizer; a group lists parameters of its "
                    "param_groups"
                )
            first = grouped.setdefault(id(p), index)
            if first != index or sum(q is p for q in members) > 1:
                raise ValueError(
                    f"groups: {names[p].removeprefix('grad.')!r} is in groups[{first}] "
                    f"and groups[{index}]; a parameter may be in one group only, once"
                )
        lists.append(list(members))
    return lists


def split_groups(params: list[Param], count: int) -> list[list[Param]]:
    """``params`` cut into ``count`` consecutive groups of sizes differing by at most one (the
    first ones larger), as Horovod's ``split_list``; empty groups are dropped."""
    size, extra = divmod(len(params), count)
    bounds = [i * size + min(i, extra) for i in range(count + 1)]
    return [params[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


class Bucketer:
    """Which gradients travel together (module docstring): buckets fixed by ``groups``, those
    planned after the first step, and the gradients waiting outside buckets."""

    __slots__ = (
        "bucket_bytes",
        "groups",
        "buckets",
        "bucket_of",
        "unsent",
        "unsent_bytes",
        "order",
    )

    def __init__(self, bucket_bytes: int, groups: list[Bucket] | None = None) -> None:
        self.bucket_bytes = bucket_bytes
        self.groups = list(groups or [])
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[Param, Bucket] = {}
        self.unsent: list[Param] = []  # ready, waiting outside buckets
        self.unsent_bytes = 0
        self.order: list[Param] | None = None
        self.restart()

    def install(self, planned: list[Bucket]) -> None:
        """Use ``planned`` (after the groups) from the next gradient on; stop recording."""
        self.buckets = self.groups + planned
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.order = None

    def ready(self, p: Param) -> Bucket | list[Param] | None:
        """Count ``p``'s gradient as final: its bucket if that is now complete, the gradients
        waiting outside buckets once they hold ``bucket_bytes``, else None (nothing to send)."""
        bucket = self.bucket_of.get(p)
        if bucket is not None:
            bucket.ready += 1
            return bucket if bucket.ready == len(bucket.params) else None
        if self.order is not None:
            self.order.append(p)
        self.unsent.append(p)
        self.unsent_bytes += p.numel() * p.element_size()
        return self.take_unsent() if self.unsent_bytes >= self.bucket_bytes else None

    def take_unsent(self) -> list[Param]:
        """The gradients waiting outside buckets, which are then sent together."""
        unsent, self.unsent, self.unsent_bytes = self.unsent, [], 0
        return unsent

    def step_done(self, failed: bool) -> list[Param] | None:
        """The step's reductions are all waited for: the recorded order to plan from (None if a
        plan exists, or the step failed: the next step's order is recorded instead)."""
        for bucket in self.buckets:
            bucket.ready, bucket.handles = 0, []
        order = self.order
        if order is not None:
            self.order = []  # until a plan is installed: the next step's order
        return None if failed else order

    def restart(self) -> None:
        """Start over (at first, and when the world was re-formed): no plan, the next step's
        order recorded to make one from (the groups stay: they are the user's)."""
        self.install([])
        self.order = []  # ready order of the gradients outside buckets, until a plan is made
        self.unsent, self.unsent_bytes = [], 0
        for bucket in self.buckets:
            bucket.ready, bucket.handles = 0, []
