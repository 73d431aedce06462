"""Bucketer: which gradients travel together, and when (commlayer's one bucket policy).

DistributedOptimizer asks it, for each gradient backward has made final, what to send now:

1. Before a plan (the first step, or after the world was re-formed), gradients wait outside
   buckets until ``bucket_bytes`` of them are ready (or the step's last one is), then go
   together (the engine negotiates and fuses what arrives together). The order in which
   backward made them ready is recorded.
2. After the first complete step the optimizer makes a plan from rank 0's recorded order (a
   collective: the same plan on every rank) with :func:`plan_buckets`: :func:`plan`, cut by
   :func:`cut`: ``bucket_bytes`` of gradients of one dtype and one compressor, in that order;
   each bucket made by :func:`bucket`, with compression=auto's decisions where a bucket's
   compressor or level is auto. From then on a bucket is sent as soon as its last gradient is
   ready, as DDP's are; a hook is a counter (on the ResNet of benchmarks/train.py, 47
   per-gradient submissions cost ~5 ms a step).
3. ``groups`` (Horovod's ``DistributedOptimizer(groups=...)``) are buckets fixed from the start:
   a group's gradients are sent together once all are ready, one collective per dtype and
   compressor among them (a grouped allreduce holds one dtype), submitted in one batch.
   Parameters outside every group follow 1. and 2.

The DDP hook (integrations/ddp.py) has no policy of its own to merge here: torch's DDP Reducer
makes its buckets and hands the hook each one's flat buffer.

4. A planned bucket's uncompressed part (compressor ``none``, the common case) owns its
   memory, as DDP's ``gradient_as_bucket_view``: one flat buffer of its parameters' dtype and
   device (``Part.flat``), allocated at the plan, of which each gradient is a view (``Part.views``,
   shaped as the parameter). At the plan the gradients are copied in and ``p.grad`` re-pointed to
   its view; from then on backward accumulates into the view in place. Where ``p.grad`` is
   anything else when the part is sent (``zero_grad(set_to_none=True)`` left it None and
   backward made a new tensor; the user assigned one) it is copied in once and ``p.grad``
   re-pointed (``Part.gather``, one copy call for the part): at most one copy a gradient a
   step. The part travels as that
   one tensor, which the engine reduces where it lies (a lone tensor is not packed), so the
   reduced buffer is the gradients: no unpack. Compressed parts, the groups' buckets (made
   before any shape is known to agree) and the gradients outside buckets keep the gradients
   where backward made them and travel as a grouped operation.
5. With COMMLAYER_PLANNED_SKIP_NEGOTIATION (opt-in, default off) a plan's owned parts in
   host memory of a floating dtype travel on a lane (core/planned.py): in plan order, with no
   negotiation, on a communicator of the plan's own. Their flat buffer then has ``Part.tail``
   elements after the gradients (4 a rank), where each rank writes which step and part it sends
   and every rank checks, in the reduced tail, that all sent the same.
6. With COMMLAYER_WINDOW_BUCKETS the parts of 4. that are in host memory are moved, at the
   plan, into a shared-memory window every rank of the process set maps (``house_in_window``;
   on several machines one per machine, the slices of a part allreduced across):
   the flat buffers are slices of this rank's segment, at the same offsets on every rank, and
   the engine reduces them there (backends/shm.py's BucketWindow). Lanes (5.) are then not
   used: the window is the faster of the two where it applies.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from commlayer.compression import CompressorBase
from commlayer.compression.auto import AutoCompressor

if TYPE_CHECKING:
    from commlayer.comm.auto_plan import AutoPlanner
    from commlayer.comm.hierarchy import HostLevels
    from commlayer.compression.auto import Hosts, Link

Param = torch.nn.Parameter


class Part(NamedTuple):
    """Gradients of one dtype and one compressor: one collective, named ``name``; compressed
    once per host where ``per_host`` (comm/hierarchy.py). A planned uncompressed part owns its
    memory (module docstring, 4.): ``flat``, of which ``views`` are the gradients."""

    params: list[Param]
    name: str
    compressor: CompressorBase
    per_host: bool = False
    flat: torch.Tensor | None = None
    views: tuple[torch.Tensor, ...] = ()
    tail: int = 0  # elements of ``flat`` after the gradients: a planned lane's check (5.)

    def gather(self) -> list[Param] | None:
        """Make ``flat`` hold this step's gradients before it is sent: each parameter's that
        is not its view already copied in (zeros where it has none) and ``p.grad`` re-pointed
        to the view, zeros for one that no longer requires grad (its ``p.grad``, if the view,
        detached first: it stays as it was). The dense gradients are copied in one
        ``_foreach_copy_`` (a torch call a gradient would give the engine thread the GIL a
        gradient: on a model of 161 small gradients that was ~20 us each). Returns the
        parameters whose gradient was sparse (reduced dense); None where a parameter no longer
        fits its view (its dtype, device or shape changed since the plan): the part then
        travels as its gradients are, as an unplanned one, and negotiation names what differs
        across ranks."""
        if not all(map(fits, self.params, self.views)):
            return None
        sparse = []
        into: list[torch.Tensor] = []
        taken: list[torch.Tensor] = []
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is view:
                if not p.requires_grad:
                    p.grad = view.clone()
                    view.zero_()
                continue
            if not p.requires_grad:
                view.zero_()
            elif grad is not None and not grad.is_sparse:
                into.append(view)
                taken.append(grad)
                p.grad = view
            elif take_in(p, view):
                sparse.append(p)
        if into:
            torch._foreach_copy_(into, taken)
        return sparse


def fits(p: Param, view: torch.Tensor) -> bool:
    """Whether ``view`` (planned for ``p``) can still be its gradient."""
    return p.dtype == view.dtype and p.shape == view.shape and p.device == view.device


def take_in(p: Param, view: torch.Tensor) -> bool:
    """``view`` as ``p``'s gradient: ``p.grad`` copied in (zeros where None) and re-pointed to
    the view (module docstring, 4.); True where the gradient was sparse (it is reduced dense)."""
    grad = p.grad
    sparse = grad is not None and grad.is_sparse
    if grad is None:
        view.zero_()
    elif sparse:
        view.zero_()
        view.add_(grad)
    else:
        view.copy_(grad)
    p.grad = view
    return sparse


def owned_memory(
    params: list[Param], compressor: CompressorBase, tail: int = 0
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...], int]:
    """(flat buffer, views, tail) for a part of ``params`` (one dtype) reduced uncompressed,
    on one device; (None, (), 0) for a compressed one, which keeps the gradients where they
    are. ``tail``: elements after the gradients for a planned lane's check (5.), kept where
    the part can travel on a lane (host memory, a floating dtype), else 0."""
    devices = {p.device for p in params}
    if not compressor.identity or isinstance(compressor, AutoCompressor) or len(devices) != 1:
        return None, (), 0
    device = devices.pop()
    dtype = params[0].dtype
    if device.type != "cpu" or not dtype.is_floating_point:
        tail = 0
    numels = [p.numel() for p in params]
    flat = torch.zeros(sum(numels) + tail, dtype=dtype, device=device)
    pieces = flat.split([*numels, tail])[: len(numels)]
    views = tuple(piece.view(p.shape) for piece, p in zip(pieces, params, strict=True))
    return flat, views, tail


def house_in_window(buckets: list[Bucket], make: Callable[[int], Any]) -> Any:
    """Move the parts that own host memory (4.) into a shared-memory window of their own
    (COMMLAYER_WINDOW_BUCKETS): ``make(nbytes)`` makes it (collective: every rank of the
    process set passes the same bytes, the plan being the same) and returns it, or None
    where it does not apply (then nothing changes). Each part's ``flat`` becomes a slice of
    this rank's segment (cache-line aligned, in plan order: the same offsets on every rank)
    and its ``views`` views of that; the window (backends/shm.py's BucketWindow), or None."""
    homed = [
        (bucket, index, part)
        for bucket in buckets
        for index, part in enumerate(bucket.parts)
        if part.flat is not None and part.flat.device.type == "cpu"
    ]
    offsets, end = [], 0
    for _, _, part in homed:
        assert part.flat is not None
        end = -(-end // _WINDOW_ALIGN) * _WINDOW_ALIGN
        offsets.append(end)
        end += part.flat.numel() * part.flat.element_size()
    if not homed:
        return None
    window = make(end)
    if window is None:
        return None
    for (bucket, index, part), offset in zip(homed, offsets):
        assert part.flat is not None
        nbytes = part.flat.numel() * part.flat.element_size()
        flat = window.memory[offset : offset + nbytes].view(part.flat.dtype)
        flat.zero_()
        numels = [p.numel() for p in part.params]
        views = tuple(piece.view(p.shape) for piece, p in zip(flat.split(numels), part.params))
        bucket.parts[index] = part._replace(flat=flat, views=views)
    return window


_WINDOW_ALIGN = 64  # a part starts on a cache line of the window


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
    own: bool = False,
    tail: int = 0,
) -> Bucket:
    """``params`` as one bucket, a part (one collective) per dtype and compressor, each named
    ``grad.bucket[first..last]`` after its first and last gradients (``names``: each
    parameter's operation name); compressed once per host where ``per_host`` says for the
    part's compressor. ``own``: uncompressed parts own their memory (module docstring, 4.),
    with ``tail`` elements after the gradients where they can travel on a lane (5.)."""
    parts = []
    for members in cut(params, math.inf, compressor_of):
        first, last = (names[p].removeprefix("grad.") for p in (members[0], members[-1]))
        compressor = compressor_of[members[0]]
        flat, views, kept = owned_memory(members, compressor, tail) if own else (None, (), 0)
        name = f"grad.bucket[{first}..{last}]"
        parts.append(Part(members, name, compressor, per_host(compressor), flat, views, kept))
    return Bucket(parts)


def plan_buckets(
    ready: list[Param],
    late: list[Param],
    names: dict[Param, str],
    bucket_bytes: float,
    choose: Callable[[Param], CompressorBase],
    per_host: Callable[[CompressorBase], bool],
    auto: AutoPlanner,
    links: Callable[[], tuple[Link, Hosts | None]],
    share: Callable[[Any], Any],
    root: int,
    rank: int,
    tail: int = 0,
) -> list[Bucket]:
    """The plan (2.), made on every rank alike: buckets in the process set's first rank's
    ready order (``ready``, then ``late``: the gradients backward did not produce, in buckets
    of their own; sparse ones are not passed), their uncompressed parts owning their memory
    (4.). Where a bucket's compressor is auto, or its level is
    (COMMLAYER_COMPRESSION_HIERARCHY=auto), every rank times the links now (``links``:
    collectives), the first rank decides each such bucket's
    compressor and whether it is compressed per host, and its decisions travel with the plan
    (comm/auto_plan.py). ``share``: the first rank's object on every rank (a collective);
    ``root``: that rank (a global rank), ``rank``: this one. ``tail``: a planned lane's check
    elements after each owned part's gradients (5.; 0 without lanes), the first rank's
    deciding for all (a setting that differs across ranks cannot split the plan)."""
    order = [names[p] for p in ready + late]
    split = len(ready)
    by_name = {name: p for p, name in names.items()}
    compressor_of = {p: choose(p) for p in names}
    deciding = any(auto.decided(c) for c in compressor_of.values())
    measured = links() if deciding else None
    decisions = None
    if measured is not None and rank == root:
        decisions = auto.decide(plan(order, split, by_name, bucket_bytes, compressor_of), *measured)
    # the first rank's tail too: a lane is opened by every rank or none (5.)
    order, split, decisions, tail = share((order, split, decisions, tail))
    planned = []
    for index, params in enumerate(plan(order, split, by_name, bucket_bytes, compressor_of)):
        compressor = compressor_of[params[0]]
        level = per_host
        if auto.decided(compressor):
            compressor, decided = auto.resolve(index, compressor, decisions, root)
            level = functools.partial(_fixed, decided)
        compressors = dict.fromkeys(params, compressor)
        planned.append(bucket(params, compressors, names, level, own=True, tail=tail))
    return planned


def _fixed(value: bool, _: CompressorBase) -> bool:
    return value


def assign_leaders(levels: HostLevels | None, buckets: list[Bucket]) -> None:
    """The leading index of each part compressed per host, by bytes (every rank alike: the
    buckets are the same everywhere); nothing without per-host ``levels``."""
    if levels is None:
        return
    levels.assign(
        [
            (part.name, sum(p.numel() * p.element_size() for p in part.params))
            for bucket in buckets
            for part in bucket.parts
            if part.per_host
        ]
    )


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
        """Use ``planned`` (after the groups) from the next gradient on; stop recording. The
        gradients of parts that own their memory move there now (4.: copied in, ``p.grad``
        re-pointed), where they are dense; a missing or sparse one is taken in when ready."""
        self.buckets = self.groups + planned
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p, view in self.view_of.items():
            grad = p.grad
            if grad is not None and grad is not view and not grad.is_sparse and fits(p, view):
                take_in(p, view)
        self.order = None

    @property
    def view_of(self) -> dict[Param, torch.Tensor]:
        """Each gradient's place in its part's memory (parts that own theirs, 4.)."""
        return {
            p: view
            for b in self.buckets
            for part in b.parts
            for p, view in zip(part.params, part.views)
        }

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
