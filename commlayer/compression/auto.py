"""``compression="auto"``: per bucket, none, a cast or (``auto:lossy=1``) a lossy compressor,
whichever the cost model predicts fastest for this link, these ranks and this bucket (issue 39).

DistributedOptimizer decides once, when it plans its buckets after the first step (the first
step travels uncompressed, as ``none``): rank 0 decides for every bucket and its decisions
travel with the bucket plan it broadcasts already, so every rank uses the same compressor for a
bucket whatever its own measurements. Rank 0's facts:

1. The link: the time of the engine's allreduce of B bytes, ``t(B) = alpha + beta B``, from
   blocking allreduces of 16 KiB and 2 MiB (three each, the fastest kept) that every rank makes
   at that moment: the path a bucket takes (algorithm, engine, the link's rate now), measured
   on the job's own ranks. With ``auto:link=calibration``, the stored calibration
   (``commlayer calibrate``) for this rank count and node layout predicts ``t(B)`` instead
   (the cost model's fastest algorithm, plus the engine's measured op latency:
   costmodel/compressed.py ``link``, which comm/auto_plan.py calls; this package imports no cost
   model); without one that fits, the measurement. (A calibration does not know the rate a
   link has today: the measurement is the default.)
2. Each candidate's CPU cost on this machine, measured on the bucket's own gradients (step 1's,
   cloned; the candidate made as ``create`` makes it, error feedback included, its second call
   timed so the residual is there): the whole of ``Communicator.reduce`` over a transport that
   completes at once, decoding a gathered payload once per rank as a rank of the job does.
   Buckets of the same shapes and dtype share one measurement ("bucket class").
3. The prediction per candidate: CPU cost + link time of its payload: ``t(B)`` uncompressed,
   ``t(B / 2)`` for a cast, each round's ``t(bytes)`` for PowerSGD, and for a gathered payload
   of p bytes a rank ``t(n p / 2)`` (an allgather moves (n - 1) p bytes through each rank, the
   allreduce of B bytes 2 (n - 1) B / n).

4. Per host (COMMLAYER_COMPRESSION_HIERARCHY ``auto`` or ``host``, a process set over several
   hosts with more than one rank on some: comm/hierarchy.py): each compressing candidate is
   also costed compressed once per host (``<spec>@host``): two allreduces of the whole bucket
   among a host's ranks (the sum and the share; link ``Hosts.intra``), the leader's CPU
   measured as a rank of as many ranks as there are hosts, divided by the ranks a host
   (leaders rotate by bucket: each rank compresses that share of a step's buckets), and the
   payload's link time among one rank a host (``Hosts.across``). The links are measured as
   the job's is, over the host's ranks and over the first leaders. ``host`` keeps only the
   per-host forms of compressing candidates, ``auto`` weighs both.

A candidate replaces the one before it (none, then the casts, then the lossy ones) only when
predicted at most ``margin`` (``auto:margin=``, default 0.85) of its time: noise in the
measurements must not buy a cast or a lossy compressor where the link is fast. A compressor
given outright (not auto) under COMMLAYER_COMPRESSION_HIERARCHY=auto is weighed the same way,
flat against per host, the flat form kept unless the other is at most ``MARGIN`` of it
(``plan_levels``), logged as "compression hierarchy auto". Lossy
candidates (PowerSGD rank 4, top-k 1% by sampled threshold) come with error feedback and only
with ``lossy=1``; tensors under the policy's ``min_numel`` then travel uncompressed (the casts
take every tensor otherwise).
Every decision is logged once per bucket class at INFO by rank 0 and kept in ``decisions``
(``DistributedOptimizer.compression_decisions()``). Elsewhere (the DDP hook, a collective
called with ``compression=auto``) nothing decides: it sends what it is given, as ``none``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from commlayer.compression.base import (
    STATEFUL,
    Compressed,
    Compressor,
    CompressorBase,
    Stateful,
    horovod_args,
    payload_bytes,
)
from commlayer.compression.factory import create

_log = logging.getLogger("commlayer")

MARGIN = 0.85  # a candidate must be predicted at most this fraction of the one it replaces
CASTS = ("fp16", "bf16")
LOSSY = ("powersgd:rank=4", "topk:ratio=0.01")
LINK_SIZES = (16 << 10, 2 << 20)  # bytes of the timed allreduces (the link's alpha and beta)
LINK_REPEATS = 3
LINKS = ("measure", "calibration")
HOST = "@host"  # a candidate compressed once per host: "topk:ratio=0.01@host"


@dataclasses.dataclass(frozen=True)
class Link:
    """Seconds of one allreduce of ``nbytes`` over the job's ranks: ``alpha + beta nbytes``,
    or ``curve(nbytes)`` where a calibration predicts it."""

    alpha_s: float
    beta_s_per_byte: float
    ranks: int
    source: str = "measured"
    curve: Callable[[int], float] | None = dataclasses.field(default=None, compare=False)

    def allreduce_s(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        if self.curve is not None:
            return self.curve(int(nbytes))
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def allgather_s(self, nbytes_per_rank: float) -> float:
        """An allgather of ``nbytes_per_rank`` from each rank: the allreduce moving as many
        bytes through each rank."""
        return self.allreduce_s(self.ranks * nbytes_per_rank / 2)

    @staticmethod
    def fit(points: Sequence[tuple[int, float]], ranks: int) -> Link:
        """alpha and beta through the (bytes, seconds) points (least squares; beta >= 0)."""
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var = sum((b - mean_b) ** 2 for b, _ in points)
        beta = sum((b - mean_b) * (t - mean_t) for b, t in points) / var if var else 0.0
        beta = max(beta, 0.0)
        return Link(max(mean_t - beta * mean_b, 0.0), beta, ranks)

    def describe(self) -> str:
        if self.curve is not None:
            return f"{self.source} ({self.ranks} ranks)"
        rate = 8 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte else float("inf")
        return (
            f"{self.source} alpha {self.alpha_s * 1e6:.0f} us, {rate:.2f} Gbit/s of allreduce "
            f"payload ({self.ranks} ranks)"
        )


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The per-host path's links (module docstring, 4.): an allreduce among a host's ranks,
    one among a rank of each host (``across.ranks`` hosts), and the ranks a host (the
    smallest host's: as many leaders rotate)."""

    intra: Link
    across: Link
    local: int

    def describe(self) -> str:
        return f"inside a host {self.intra.describe()}; across hosts {self.across.describe()}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``auto`` chose for one bucket class, and why (seconds predicted per candidate).
    ``kind``: "compression" (which compressor) or "compression hierarchy" (flat or per host
    for a compressor given outright)."""

    choice: str
    nbytes: int
    tensors: int
    predicted_s: dict[str, float]
    cpu_s: dict[str, float]
    link: str
    kind: str = "compression"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        times = ", ".join(f"{spec} {t * 1e3:.1f} ms" for spec, t in self.predicted_s.items())
        return (
            f"{self.kind} auto: {self.choice} for buckets of {self.nbytes / 1e6:.2f} MB "
            f"({self.tensors} tensor(s)); predicted a step's reduce: {times}; link: {self.link}"
        )


def split(choice: str) -> tuple[str, bool]:
    """(spec, compressed once per host) of a candidate's label."""
    if choice.endswith(HOST):
        return choice[: -len(HOST)], True
    return choice, False


def payload_time(spec: str | Compressor, tensors: Sequence[torch.Tensor], link: Link) -> float:
    """Link seconds of ``spec``'s payload for these tensors (module docstring, 3.), from what
    its compressor declares: each round's bytes (``base.payload_bytes``), summed over the
    tensors, allreduced round by round when ``summable``, else gathered."""
    compressor = create(spec)
    rounds: list[int] = []
    for t in tensors:
        for i, nbytes in enumerate(payload_bytes(compressor, t.shape, t.element_size())):
            if i == len(rounds):
                rounds.append(0)
            rounds[i] += nbytes
    if compressor.summable:
        return sum(link.allreduce_s(nbytes) for nbytes in rounds)
    return link.allgather_s(sum(rounds))


def choose(
    predicted: dict[str, float], lossy: bool, margin: float = MARGIN
) -> str:  # fmt: skip
    """The candidate to use, from predicted seconds (module docstring): none, then each cast,
    then (``lossy``) each lossy spec replaces the pick only at ``margin`` of its time or less;
    a spec's per-host form (``<spec>@host``) stands beside it in its group."""
    pick = "none"
    for group in (CASTS, LOSSY if lossy else ()):
        present = [label for spec in group for label in (spec, spec + HOST) if label in predicted]
        if not present:
            continue
        best = min(present, key=lambda spec: predicted[spec])
        if predicted[best] <= margin * predicted[pick]:
            pick = best
    return pick


def host_time(
    spec: str | Compressor, tensors: Sequence[torch.Tensor], hosts: Hosts, cpu_s: float
) -> float:
    """Predicted seconds of ``spec`` compressed once per host (module docstring, 4.), its
    leader's measured CPU seconds ``cpu_s``."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return (
        2 * hosts.intra.allreduce_s(nbytes)
        + cpu_s / hosts.local
        + payload_time(spec, tensors, hosts.across)
    )


def decide(
    tensors: Sequence[torch.Tensor],
    link: Link,
    cpu_s: dict[str, float],
    lossy: bool,
    margin: float = MARGIN,
    hosts: Hosts | None = None,
    host_cpu_s: dict[str, float] | None = None,
    flat: bool = True,
) -> Decision:
    """The decision for a bucket of ``tensors`` given the link and each candidate's measured
    CPU seconds (``cpu_s``: the candidates; "none" costs nothing). With ``hosts``, each
    candidate of ``host_cpu_s`` (its leader's CPU seconds) is costed per host too; ``flat``
    False leaves only none flat (COMMLAYER_COMPRESSION_HIERARCHY=host). Pure:
    unit-testable with fake numbers."""
    candidates = ["none", *CASTS, *(LOSSY if lossy else ())]
    predicted = {
        spec: cpu_s.get(spec, 0.0) + payload_time(spec, tensors, link)
        for spec in candidates
        if spec == "none" or (spec in cpu_s and (flat or hosts is None))
    }
    if hosts is not None:
        for spec, seconds in (host_cpu_s or {}).items():
            predicted[spec + HOST] = host_time(spec, tensors, hosts, seconds)
    return Decision(
        choose(predicted, lossy, margin),
        sum(t.numel() * t.element_size() for t in tensors),
        len(tensors),
        predicted,
        {**cpu_s, **{spec + HOST: t for spec, t in (host_cpu_s or {}).items()}},
        link.describe() + ("" if hosts is None else f"; {hosts.describe()}"),
    )


def decide_level(
    label: str,
    compressor: Compressor,
    tensors: Sequence[torch.Tensor],
    link: Link,
    hosts: Hosts,
    cpu_s: float,
    host_cpu_s: float,
    margin: float = MARGIN,
) -> Decision:
    """Flat or per host for a compressor given outright (``label``, its name): per host where
    predicted at most ``margin`` of flat. Pure, as ``decide``."""
    predicted = {
        label: cpu_s + payload_time(compressor, tensors, link),
        label + HOST: host_time(compressor, tensors, hosts, host_cpu_s),
    }
    per_host = predicted[label + HOST] <= margin * predicted[label]
    return Decision(
        label + HOST if per_host else label,
        sum(t.numel() * t.element_size() for t in tensors),
        len(tensors),
        predicted,
        {label: cpu_s, label + HOST: host_cpu_s},
        f"{link.describe()}; {hosts.describe()}",
        "compression hierarchy",
    )


class AutoCompressor(CompressorBase):
    """Placeholder DistributedOptimizer resolves per bucket (module docstring); until then, and
    anywhere nothing resolves it, it sends tensors as they are."""

    name = "auto"
    summable = True
    capabilities = frozenset({STATEFUL})
    identity = True  # until resolved: the tensors as they are

    def __init__(self, lossy: int = 0, link: str = "measure", margin: float = MARGIN) -> None:
        if lossy not in (0, 1) or isinstance(lossy, bool):
            raise ValueError(f"auto: lossy must be 0 or 1, got {lossy!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin <= 0:
            raise ValueError(f"auto: margin must be a number > 0, got {margin!r}")
        self.margin = float(margin)
        if link not in LINKS:
            raise ValueError(f"auto: link must be one of {', '.join(LINKS)}, got {link!r}")
        self.lossy = bool(lossy)
        self.link = link
        # Lossy candidates skip small tensors (Policy's min_numel); casts take every tensor.
        self.compresses_small_tensors = not self.lossy
        self.decisions: list[dict[str, Any]] = []  # one per bucket class, in plan order
        self.chosen: dict[str, CompressorBase] = {}  # spec -> the compressor buckets share

    def __repr__(self) -> str:
        return f"AutoCompressor(lossy={int(self.lossy)}, link={self.link!r}, margin={self.margin})"

    def compressor(self, spec: str, rank: int) -> CompressorBase:
        """The one compressor of ``spec`` every bucket given it shares (its state: residuals;
        a bucket compressed per host shares it too: its residual is keyed by its name)."""
        if spec not in self.chosen:
            self.chosen[spec] = create(spec, rank=rank)
        return self.chosen[spec]

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        return Compressed([tensor])

    def decompress(self, compressed: Compressed | torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return horovod_args(compressed, ctx).payload[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            spec: cast(Stateful, c).state_dict()
            for spec, c in self.chosen.items()
            if STATEFUL in c.capabilities
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for spec, value in state.items():
            target = self.chosen.get(spec)
            if target is None:  # restored before the plan: kept for when it is chosen
                target = self.chosen[spec] = create(spec)
            if STATEFUL not in target.capabilities:
                raise ValueError(
                    f"auto: the state for {spec!r} has no stateful compressor to load into"
                )
            cast(Stateful, target).load_state_dict(value)


Measure = Callable[[Any, Sequence[torch.Tensor], int], float]


def _bucket_class(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def plan(
    auto: AutoCompressor,
    buckets: Sequence[Sequence[torch.Tensor]],
    link: Link,
    ranks: int,
    measure: Measure,
    hosts: Hosts | None = None,
    flat: bool = True,
) -> list[str]:
    """Rank 0: the choice for each bucket (tensors: step 1's gradients; a spec, or
    ``<spec>@host`` with ``hosts``: ``split`` it), logging each bucket class's decision once and
    recording it in ``auto.decisions``. ``measure(spec, tensors, ranks)``: the CPU seconds of a
    candidate (communicator.measure_cpu); per host, as a rank of ``hosts.across.ranks``.
    ``flat`` False: only none stays flat (``decide``)."""
    by_class: dict[tuple[Any, ...], str] = {}
    out = []
    for tensors in buckets:
        key = _bucket_class(tensors)
        if key not in by_class:
            candidates = [*CASTS, *(LOSSY if auto.lossy else ())]
            floating = all(t.is_floating_point() for t in tensors)
            cpu = {spec: measure(spec, tensors, ranks) for spec in candidates} if floating else {}
            host_cpu = None
            if hosts is not None and floating:
                host_cpu = {spec: measure(spec, tensors, hosts.across.ranks) for spec in candidates}
            decision = decide(tensors, link, cpu, auto.lossy, auto.margin, hosts, host_cpu, flat)
            by_class[key] = decision.choice
            auto.decisions.append(decision.as_dict())
            _log.info("commlayer: %s", decision.describe())
        out.append(by_class[key])
    return out


def plan_levels(
    compressor: Compressor,
    buckets: Sequence[Sequence[torch.Tensor]],
    link: Link,
    ranks: int,
    measure: Measure,
    hosts: Hosts,
    decisions: list[dict[str, Any]],
) -> list[bool]:
    """Rank 0: for a compressor given outright, whether each bucket is compressed per host
    (``decide_level``), each bucket class's decision logged once and appended to
    ``decisions``. ``measure`` as ``plan``'s, given the compressor itself."""
    by_class: dict[tuple[Any, ...], bool] = {}
    out = []
    for tensors in buckets:
        key = _bucket_class(tensors)
        if key not in by_class:
            cpu = measure(compressor, tensors, ranks)
            leader = measure(compressor, tensors, hosts.across.ranks)
            decision = decide_level(compressor.name, compressor, tensors, link, hosts, cpu, leader)
            by_class[key] = split(decision.choice)[1]
            decisions.append(decision.as_dict())
            _log.info("commlayer: %s", decision.describe())
        out.append(by_class[key])
    return out
