"""A compressed reduction's cost, flat or once per host (issue 51): its transfers phase by
phase, the bytes a host sends to the others and the time the alpha-beta model gives (pure).

A reduction of one bucket of ``numel`` float32 elements under a compressor (its payload's size
from what it declares: ``base.payload_bytes``, the bucket taken as the squarest matrix of its
elements for PowerSGD's shape-dependent rounds) is a list of phases; each phase is every rank's
steps, a step its sends and receives as (peer, bytes):

- flat (communicator.py 1.-2.): a summable payload is allreduced over all ranks, round by
  round, with the schedule the cost model picks for the job (``model.table``); a gathered one
  is allgathered (recursive doubling on a power of two, else a ring: what MPI libraries do);
- per host (comm/hierarchy.py): the bucket allreduced among each host's ranks (all hosts at
  once), the payload moved among one leader a host (index 0: one bucket has one leader a
  host) as above, and the bucket allreduced among each host's ranks again (the share).

``seconds`` costs a phase step by step, every rank's transfers at once: a step takes its
slowest rank's time, the larger of its transfers inside the node (``model.message_time``) and
across (the inter curve, its bytes times the ranks of its node that send across in that step:
they share the node's link), as model.py's contention factor; local work (reducing,
compressing) is not counted: the simulation (sim/compressed.py) replays the same phases and
times the network alone. ``cross_bytes`` is the most any host sends to the others.

``link`` is the link ``compression=auto`` weighs its candidates over when told to read it from
a stored calibration (``auto:link=calibration``): the compressors know no cost model, the cost
model knows the compressors.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from commlayer import algorithms
from commlayer.common.topology import Topology
from commlayer.compression import create
from commlayer.compression.auto import Link
from commlayer.compression.base import payload_bytes
from commlayer.costmodel.calibration import Calibration
from commlayer.costmodel.model import message_time, table

Transfers = list[tuple[int, float]]  # (peer, bytes)
Steps = list[tuple[Transfers, Transfers]]  # a rank's steps: (sends, receives)
Phase = list[Steps]  # every rank of the job (empty where a rank takes no part)


def link(cal: Calibration, op_latency: bool = True) -> Link:
    """``t(B)`` from a stored calibration: the cost model's fastest algorithm for B bytes
    (``model.table``) plus the engine's measured latency per call."""

    def curve(nbytes: int) -> float:
        rows = table(max(nbytes, 4), cal)
        return (rows[0][1] if rows else 0.0) + (cal.op_latency_s if op_latency else 0.0)

    return Link(cal.alpha_s, cal.beta_s_per_byte, cal.size, "calibration", curve)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A compressed reduction of one bucket: its phases in order, named."""

    compressor: str
    per_host: bool
    phases: list[tuple[str, Phase]]

    def streams(self) -> Phase:
        """Every rank's steps of every phase, in order (what a replay posts)."""
        ranks = len(self.phases[0][1]) if self.phases else 0
        return [[step for _, phase in self.phases for step in phase[r]] for r in range(ranks)]


@dataclasses.dataclass(frozen=True)
class Cost:
    seconds: float
    cross_bytes: int  # the most any host sends to the others


def matrix(numel: int) -> torch.Size:
    """The squarest rows x columns of ``numel`` elements (rows a power of two dividing it)."""
    rows = 1 << (max(numel, 1).bit_length() - 1) // 2
    while numel % rows:
        rows //= 2
    return torch.Size((rows, numel // rows))


def payload(spec: str | Any, numel: int, element_size: int = 4) -> tuple[bool, list[int]]:
    """(summable, bytes of each round) of one rank's payload for a bucket of ``numel``."""
    compressor = create(spec)
    return compressor.summable, payload_bytes(compressor, matrix(numel), element_size)


def _group(ranks: Sequence[int], topology: Topology) -> Topology:
    """The topology of ``ranks`` alone, nodes renumbered in order of first appearance."""
    first: dict[int, int] = {}
    return Topology(tuple(first.setdefault(topology.node_of[r], len(first)) for r in ranks))


def pick(nbytes: int, ranks: Sequence[int], topology: Topology, cal: Calibration | None) -> str:
    """The schedule the cost model predicts fastest for an allreduce of ``nbytes`` among
    ``ranks`` (ring without a calibration: a platform read from a file)."""
    if cal is None or len(ranks) < 2:
        return "ring"
    group = _group(ranks, topology)
    sub = dataclasses.replace(cal, size=len(ranks), nodes=group.nodes, native={})
    rows = [row for row in table(nbytes, sub, 4, group) if row[0] in algorithms.schedules()]
    return rows[0][0] if rows else "ring"


def allreduce(
    ranks: Sequence[int], nbytes: int, size: int, topology: Topology, cal: Calibration | None
) -> Phase:
    """An allreduce of ``nbytes`` among ``ranks`` (of a job of ``size``) with ``pick``'s
    schedule, its steps as transfers between the ranks."""
    phase: Phase = [[] for _ in range(size)]
    if len(ranks) < 2 or nbytes <= 0:
        return phase
    numel = max(math.ceil(nbytes / 4), 1)
    name = pick(nbytes, ranks, topology, cal)
    group = _group(ranks, topology)
    for index, rank in enumerate(ranks):
        for step in algorithms.schedule(name, index, len(ranks), numel, group):
            sends: Counter[int] = Counter()
            recvs: Counter[int] = Counter()
            for t in step.sends:
                sends[ranks[t.peer]] += 4 * t.numel
            for t in step.recvs:
                recvs[ranks[t.peer]] += 4 * t.numel
            phase[rank].append((list(sends.items()), list(recvs.items())))
    return phase


def allgather(ranks: Sequence[int], nbytes: float, size: int) -> Phase:
    """Every one of ``ranks``' ``nbytes`` to all of them: recursive doubling on a power of two
    (step k: 2^k payloads with the partner at index XOR 2^k), a ring otherwise."""
    phase: Phase = [[] for _ in range(size)]
    n = len(ranks)
    if n < 2:
        return phase
    for i, rank in enumerate(ranks):
        if n & (n - 1) == 0:
            pairs = [(ranks[i ^ (1 << k)], nbytes * (1 << k)) for k in range(n.bit_length() - 1)]
            phase[rank] = [([pair], [pair]) for pair in pairs]
        else:
            ahead, behind = ranks[(i + 1) % n], ranks[(i - 1) % n]
            phase[rank] = [([(ahead, nbytes)], [(behind, nbytes)])] * (n - 1)
    return phase


def plan(
    spec: str | Any,
    numel: int,
    topology: Topology,
    cal: Calibration | None,
    per_host: bool,
) -> Plan:
    """The phases of one bucket's reduction (module docstring); ``per_host`` where the
    topology has several nodes (else it is the flat one)."""
    summable, rounds = payload(spec, numel)
    name = create(spec).name
    size = topology.size
    bucket = 4 * numel
    hosts = [topology.members(node) for node in sorted(set(topology.node_of))]
    per_host = per_host and len(hosts) > 1 and any(len(h) > 1 for h in hosts)
    movers = [host[0] for host in hosts] if per_host else list(range(size))

    def exchange() -> list[tuple[str, Phase]]:
        if not summable:
            return [("allgather", allgather(movers, sum(rounds), size))]
        return [
            (f"allreduce round {k + 1}", allreduce(movers, nbytes, size, topology, cal))
            for k, nbytes in enumerate(rounds)
        ]

    if not per_host:
        return Plan(name, False, exchange())
    inside = _merged([allreduce(h, bucket, size, topology, cal) for h in hosts])
    return Plan(name, True, [("host sum", inside), *exchange(), ("share", inside)])


def _merged(phases: list[Phase]) -> Phase:
    """Phases of disjoint ranks as one (the hosts' sums run at once)."""
    return [[step for phase in phases for step in phase[r]] for r in range(len(phases[0]))]


def seconds(plan: Plan, cal: Calibration, topology: Topology) -> float:
    """The plan's time on ``cal``'s links (module docstring)."""
    return sum(_phase_seconds(phase, cal, topology) for _, phase in plan.phases)


def _phase_seconds(phase: Phase, cal: Calibration, topology: Topology) -> float:
    total = 0.0
    inter_ok = topology.nodes > 1 and cal.has_inter
    for k in range(max((len(steps) for steps in phase), default=0)):
        sending: Counter[int] = Counter()
        receiving: Counter[int] = Counter()
        for rank, steps in enumerate(phase):
            if k < len(steps):
                node = topology.node_of[rank]
                sends, recvs = steps[k]
                sending[node] += any(topology.node_of[p] != node for p, _ in sends)
                receiving[node] += any(topology.node_of[p] != node for p, _ in recvs)
        worst = 0.0
        for rank, steps in enumerate(phase):
            if k >= len(steps):
                continue
            sends, recvs = steps[k]
            node = topology.node_of[rank]
            if not inter_ok:
                nbytes = max(sum(b for _, b in sends), sum(b for _, b in recvs))
                messages = max(len(sends), len(recvs), 1)
                worst = max(worst, message_time(int(nbytes), cal) + (messages - 1) * cal.alpha_s)
                continue
            parts = []
            for inter in (False, True):
                out = [b for p, b in sends if (topology.node_of[p] != node) == inter]
                into = [b for p, b in recvs if (topology.node_of[p] != node) == inter]
                if not out and not into:
                    continue
                share = (sending[node], receiving[node]) if inter else (1, 1)
                nbytes = max(share[0] * sum(out), share[1] * sum(into))
                alpha = min(cal.exchange_inter)[1] if inter else cal.alpha_s
                extra = (max(len(out), len(into)) - 1) * alpha
                parts.append(message_time(int(nbytes), cal, inter) + extra)
            worst = max(worst, *parts, 0.0)
        total += worst
    return total


def cross_bytes(plan: Plan, topology: Topology) -> int:
    """The most bytes any host sends to the others over the plan."""
    sent = dict.fromkeys(topology.node_of, 0.0)
    for _, phase in plan.phases:
        for rank, steps in enumerate(phase):
            node = topology.node_of[rank]
            for sends, _ in steps:
                sent[node] += sum(b for p, b in sends if topology.node_of[p] != node)
    return round(max(sent.values(), default=0))


def predict(
    spec: str | Any, numel: int, cal: Calibration, topology: Topology, per_host: bool
) -> Cost:
    """Seconds and cross-host bytes of one bucket's reduction (flat or ``per_host``)."""
    made = plan(spec, numel, topology, cal, per_host)
    return Cost(seconds(made, cal, topology), cross_bytes(made, topology))
