"""The alpha-beta-gamma cost model of the allreduce algorithms (pure: no communication).

A schedule (algorithms/schedule.py) is costed step by step:

    step time = T(max(bytes sent, bytes received)) + (m - 1) alpha + (gamma | copy) * bytes received
                - overlap * min(T + (m - 1) alpha, (m - 1)/m * (gamma | copy) * bytes received)

with gamma when the step reduces what it receives and copy when it overwrites; m is the number of
messages each way (a chunked ring step sends its block in m pieces, and the executor reduces a
piece while later ones are in flight, so up to (m - 1)/m of the local work can hide behind the
transfers). ``overlap`` in [0, 1], T(n) (the time of one message each way, read off a measured
curve: MPI's eager and rendezvous protocols have different alphas and betas, which one line
cannot follow) and the local gamma and copy curves come from a ``Calibration``
(calibration.py, measured by launch/calibrate.py). An algorithm's time is the largest sum over the
ranks' schedules (ranks are sampled at large sizes). The two native algorithms (``native``,
the backend's own allreduce, and ``shm``) are not schedules: their measured times are
interpolated (log-log) between the measured sizes and extrapolated at constant bandwidth beyond
them.

Every registered schedule algorithm is a candidate (``candidates``: the registry's names), costed
from its own schedule: registering one (algorithms/registry.py) makes it a candidate of ``auto``
with no table to edit.

Several nodes (given a topology): a transfer to a rank on another node is read off a second
curve, ``exchange_inter``; a step costs the slower of its parts inside and across nodes.
Contention factor: when k ranks of a node send (receive) across nodes in the same step, that
part is costed as k times the bytes, the node's one link carrying the k flows. Its limits: the
ranks' schedules are assumed step-aligned (true of the symmetric algorithms; a rank ahead or
behind shares less), each node has one full-duplex link, and links meeting in a switch are not
shared. Without an inter curve (calibrations from before it, or of one node) every transfer is
costed on the one curve as before, and ``auto`` on several nodes keeps the backend's own
allreduce (``native``).

With a simulated table of the machine the job runs on (``Simulated``: COMMLAYER_SIM_TABLE,
commlayer/sim/learn.py), ``auto`` takes the algorithm that table predicts fastest for the job's
ranks, nodes and size, before any calibration: at hundreds of ranks the network's contention,
which only the simulation sees, decides (a 1024-rank torus at 1 MiB: SHD 0.34 ms simulated,
ring 4.3 ms learned).

Without a calibration for the job's size, ``auto`` uses ``shm`` for buffers of 1 MiB and more
when every rank is on one node (``HEURISTIC_SHM_BYTES``: what was measured), else ``native``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Protocol

from commlayer import algorithms
from commlayer.algorithms.schedule import Schedule, Step
from commlayer.common.topology import Topology
from commlayer.costmodel.calibration import Calibration

# Without a calibration, one node uses the shared-memory window from 1 MiB: it was level with
# or ahead of MPICH from 1 MiB at 2 and 4 ranks in benchmarks/results/algorithms_np*.md (1 MiB:
# 0.92-1.83x, 4-16 MiB 0.92-1.85x, 64 MiB 1.06-3.49x), and in paired training runs of the MLP
# at 2 ranks it gave 1.14-1.36 of DDP against 1.05-1.18 through MPICH below 32 MiB.
HEURISTIC_SHM_BYTES = 1 << 20
SCHEDULE_MARGIN = 1.25  # a schedule must be predicted 1.25x faster than the best native one
_SAMPLED_RANKS = 8


def message_time(nbytes: int, cal: Calibration, inter: bool = False) -> float:
    """alpha + beta n, read off the measured exchange curve where there is one (MPI switches
    protocol with the size, which one straight line cannot follow); ``inter``: across nodes,
    off ``exchange_inter`` when the calibration has it."""
    curve = cal.exchange_inter if inter and cal.has_inter else cal.exchange
    if curve:
        return _interpolate(curve, max(nbytes, 1))
    return cal.alpha_s + cal.beta_s_per_byte * nbytes


def local_time(kind: str, nbytes: int, cal: Calibration) -> float:
    """Seconds to ``kind`` ("reduce" or "copy") ``nbytes`` received bytes into the buffer: read
    off the measured curve (linear below its smallest size), else the fitted rate."""
    if nbytes <= 0:
        return 0.0
    curve = cal.local.get(kind)
    if not curve:
        return (cal.gamma_s_per_byte if kind == "reduce" else cal.copy_s_per_byte) * nbytes
    return local_curve_time(curve, nbytes)


def local_curve_time(curve: Sequence[tuple[int, float]], nbytes: int) -> float:
    """A local-work curve read at ``nbytes``: linear below its smallest size (the time of small
    copies scales with their bytes), log-log between its points."""
    smallest, seconds = min(curve)
    if nbytes < smallest:
        return seconds * nbytes / smallest
    return _interpolate(curve, nbytes)


Sharing = tuple[int, int]  # ranks of a node sending, and receiving, across nodes in one step


def step_time(
    step: Step,
    element_size: int,
    cal: Calibration,
    topology: Topology | None = None,
    rank: int = 0,
    sharing: Sharing = (1, 1),
) -> float:
    """One step of ``rank``: its transfers, then its local work less what hides behind them.
    With a ``topology`` of several nodes and an inter curve, the transfers are the slower of
    those inside the node and those across, these with ``sharing`` times the bytes each way."""
    sent = sum(t.numel for t in step.sends) * element_size
    received = sum(t.numel for t in step.recvs) * element_size
    local = local_time("reduce" if step.reduce else "copy", received, cal)
    messages = max(len(step.sends), len(step.recvs), 1)
    if topology is None or topology.nodes == 1 or not cal.has_inter:
        transfer = message_time(max(sent, received), cal) + (messages - 1) * cal.alpha_s
    else:
        transfer = max(
            _part_time(step, element_size, cal, topology, rank, False, (1, 1)),
            _part_time(step, element_size, cal, topology, rank, True, sharing),
        )
    hidden = 0.0
    if messages > 1 and step.early and cal.overlap > 0:
        hidden = cal.overlap * min(transfer, local * (messages - 1) / messages)
    return transfer + local - hidden


def _part_time(
    step: Step,
    element_size: int,
    cal: Calibration,
    topology: Topology,
    rank: int,
    inter: bool,
    sharing: Sharing,
) -> float:
    """The transfers of a step inside ``rank``'s node (or across nodes: ``inter``); 0 if none.
    An extra piece costs the fitted alpha inside a node, the smallest measured exchange across."""
    node = topology.node_of[rank]
    sends = [t.numel for t in step.sends if (topology.node_of[t.peer] != node) == inter]
    recvs = [t.numel for t in step.recvs if (topology.node_of[t.peer] != node) == inter]
    if not sends and not recvs:
        return 0.0
    nbytes = max(sharing[0] * sum(sends), sharing[1] * sum(recvs)) * element_size
    alpha = min(cal.exchange_inter)[1] if inter else cal.alpha_s
    return message_time(nbytes, cal, inter) + (max(len(sends), len(recvs)) - 1) * alpha


def schedule_time(
    schedule: Schedule,
    element_size: int,
    cal: Calibration,
    topology: Topology | None = None,
    rank: int = 0,
    sharing: Sequence[Sharing] = (),
) -> float:
    """The sum of ``rank``'s steps; ``sharing``: per step index (1, 1) when not given."""
    return sum(
        step_time(s, element_size, cal, topology, rank, sharing[i] if i < len(sharing) else (1, 1))
        for i, s in enumerate(schedule)
    )


def _sampled_ranks(size: int) -> list[int]:
    if size <= _SAMPLED_RANKS:
        return list(range(size))
    picks = {0, 1, 2, size - 1, size // 2, size // 2 + 1, size // 3, 2 * size // 3}
    return sorted(picks)


@functools.lru_cache(maxsize=256)
def _link_sharing(
    name: str, numel: int, topology: Topology, node: int, generation: int = 0
) -> tuple[Sharing, ...]:
    """Per step index, how many ranks of ``node`` send across nodes and how many receive (at
    least 1 each): the contention factor, from the schedules of all the node's ranks, which are
    assumed step-aligned. Cached: ``choose`` and ``table`` ask for every algorithm and size;
    ``generation``, the registry's, keeps a name registered again from its predecessor's entry."""
    schedules = [
        algorithms.schedule(name, r, topology.size, numel, topology) for r in topology.members(node)
    ]
    counts = [[0, 0] for _ in range(max((len(s) for s in schedules), default=0))]
    for schedule in schedules:
        for i, step in enumerate(schedule):
            for way, transfers in enumerate((step.sends, step.recvs)):
                counts[i][way] += any(topology.node_of[t.peer] != node for t in transfers)
    return tuple((max(k_send, 1), max(k_recv, 1)) for k_send, k_recv in counts)


def predict(
    name: str, numel: int, element_size: int, cal: Calibration, topology: Topology | None = None
) -> float | None:
    """Predicted seconds for one allreduce of ``numel`` elements (one node unless
    ``topology`` says otherwise); None when ``name`` is a native algorithm the calibration did
    not measure."""
    if cal.size == 1 or numel == 0:
        return 0.0
    name = algorithms.canonical(name)
    if name in algorithms.NATIVE:
        curve = cal.native.get(name)
        return _interpolate(curve, numel * element_size) if curve else None
    links = topology if topology is not None and topology.nodes > 1 and cal.has_inter else None
    slowest = 0.0
    for r in _sampled_ranks(cal.size):
        schedule = algorithms.schedule(name, r, cal.size, numel, topology)
        sharing = (
            _link_sharing(name, numel, links, links.node_of[r], algorithms.generation())
            if links
            else ()
        )
        slowest = max(slowest, schedule_time(schedule, element_size, cal, topology, r, sharing))
    return slowest


def log_line(low: tuple[float, float], high: tuple[float, float], x: float) -> float:
    """y at ``x`` on the straight line through two (x, y) points in log-log space (a time at
    a size between, or beyond, two measured or simulated sizes)."""
    (x0, y0), (x1, y1) = low, high
    frac = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + frac * (math.log(y1) - math.log(y0)))


def _interpolate(curve: Sequence[tuple[int, float]], nbytes: int) -> float:
    points = sorted(curve)
    if nbytes <= points[0][0]:
        return points[0][1]
    if nbytes >= points[-1][0]:
        size, seconds = points[-1]
        return seconds * nbytes / size  # constant bandwidth beyond the largest measured size
    for low, high in zip(points, points[1:]):
        if low[0] <= nbytes <= high[0]:
            return log_line(low, high, nbytes)
    raise AssertionError("unreachable")


class Simulated(Protocol):
    """Predicted times from simulation for a job (sim/learn.py ``Job``): (algorithm, seconds,
    source) fastest first, or None when the table is not of this job's machine and size."""

    def times(self, ranks: int, nodes: int, nbytes: int) -> list[tuple[str, float, str]] | None: ...


def _simulated(
    simulated: Simulated | None, numel: int, element_size: int, size: int, nodes: int
) -> list[tuple[str, float]]:
    if simulated is None or size == 1:
        return []
    rows = simulated.times(size, nodes, numel * element_size) or []
    return [(name, seconds) for name, seconds, _ in rows]


def candidates(single_node: bool) -> list[str]:
    """What ``auto`` chooses among: the native algorithms (on several nodes, those that need
    no single node), then every registered schedule, from the registry."""
    natives = [n for n in algorithms.NATIVE if single_node or n not in algorithms.ONE_NODE]
    return [*natives, *algorithms.schedules()]


def node_major(cal: Calibration) -> Topology | None:
    """The topology a calibration of several nodes is assumed to have when none is given: equal
    nodes, rank r on node r // (size / nodes); None on one node or when the nodes cannot be
    equal."""
    if cal.nodes <= 1 or cal.size % cal.nodes:
        return None
    local = cal.size // cal.nodes
    return Topology(tuple(r // local for r in range(cal.size)))


def table(
    nbytes: int, cal: Calibration, element_size: int = 4, topology: Topology | None = None
) -> list[tuple[str, float]]:
    """(algorithm, predicted seconds) for a buffer of ``nbytes``, fastest first; on the given
    topology, else ``node_major(cal)``."""
    numel = max(nbytes // element_size, 1)
    topology = topology if topology is not None else node_major(cal)
    rows = []
    for name in candidates(cal.nodes == 1):
        seconds = predict(name, numel, element_size, cal, topology)
        if seconds is not None:
            rows.append((name, seconds))
    return sorted(rows, key=lambda row: (row[1], row[0]))


def choose(
    numel: int,
    element_size: int,
    size: int,
    nodes: int,
    cal: Calibration | None,
    topology: Topology | None = None,
    simulated: Simulated | None = None,
) -> str:
    """``auto``'s pick: with a ``simulated`` table that fits the job, its fastest; with a
    calibration for this size and node count (on several nodes: one with an inter curve), the
    lowest predicted time on ``topology`` (else ``node_major``), except that a schedule must
    beat the best native algorithm (whose time is measured) by SCHEDULE_MARGIN; else the
    measured rule of thumb. Every rank computes the same."""
    if size == 1:
        return algorithms.NATIVE_ALLREDUCE
    table_rows = _simulated(simulated, numel, element_size, size, nodes)
    if table_rows:
        return table_rows[0][0]
    if cal is None or cal.size != size or cal.nodes != nodes:
        if nodes == 1 and numel * element_size >= HEURISTIC_SHM_BYTES:
            return "shm"
        return algorithms.NATIVE_ALLREDUCE
    if nodes > 1 and not cal.has_inter:
        return algorithms.NATIVE_ALLREDUCE
    if topology is not None and (topology.size != size or topology.nodes != nodes):
        topology = None
    rows = table(numel * element_size, cal, element_size, topology)
    native = [(name, t) for name, t in rows if name in algorithms.NATIVE]
    if not native:
        return rows[0][0]
    best_native = native[0]
    best = rows[0]
    # A native algorithm's time is measured, a schedule's predicted (56-80% accurate here):
    # leave the measured one only for a clear predicted gain.
    if best[0] not in algorithms.NATIVE and best[1] * SCHEDULE_MARGIN > best_native[1]:
        return best_native[0]
    return best[0]


def _distinct(rows: list[tuple[str, float]]) -> list[str]:
    """The names of ``rows`` (fastest first), less those predicted exactly as fast as a faster
    one: the model sees the same steps there (with one rank per node, ``shd`` is
    ``rabenseifner`` across the nodes, and ``hierarchical``, ``ring`` and ``torus2d`` all ring
    through them), so its ranking cannot tell them apart and measuring the first of them is
    what tuning learns from the tie; the next distinct schedule takes the second place. Across
    4 hosts x 1 rank at 1 Gbit/s the two best were rabenseifner and shd, tied, 1% ahead of the
    ring-like three; measured, those were 1.5-1.8x faster at 64-256 MiB, and tuning, measuring
    only the twins, kept MPI's own at 0.55-0.65x of the best
    (benchmarks/results/network_1gbit_4x1_large_run1.md; run2 after this: 0.95-1.05x). A tie
    is alike only in the model: hierarchical runs its shared-memory form even with one rank
    per node, and where the cores are the limit (10 Gbit/s) it was 1.7x slower than ring."""
    names: list[str] = []
    seen: set[float] = set()
    for name, seconds in rows:
        if seconds not in seen:
            names.append(name)
            seen.add(seconds)
    return names


def ranked(
    numel: int,
    element_size: int,
    size: int,
    nodes: int,
    cal: Calibration | None,
    topology: Topology | None = None,
    count: int = 4,
    simulated: Simulated | None = None,
) -> list[str]:
    """What online tuning (algorithms/autotune.py) measures against each other, at most ``count``
    names: ``auto``'s pick (``choose``), then the native algorithms (``shm`` on one node,
    ``native``), then the two schedules with the lowest predicted times (with a calibration that
    fits; else ``rabenseifner``, bandwidth-optimal, or below 64 KiB ``recursive_doubling``,
    latency-optimal; ties count once: ``_distinct``). The natives always take part: they are the
    fastest where they are, and a calibration taken while the machine ran in another state can
    rank them last (at 2 ranks here the window is 3x MPICH in one state and level with it in the
    other). Two schedules, not one: the best ones are often predicted within a few percent of
    each other, closer than the model's accuracy (at 4 ranks, 256 MiB: rabenseifner 252 ms, ring
    256 ms; ring measured up to 1.19x faster, and tuning, measuring rabenseifner alone, kept it
    at 0.82x of ring in turn). With a ``simulated`` table that fits the job, the two schedules
    are its fastest. Every rank computes the same."""
    pick = choose(numel, element_size, size, nodes, cal, topology, simulated)
    if size == 1:
        return [pick]
    native = algorithms.NATIVE_ALLREDUCE
    natives = ["shm", native] if nodes == 1 else [native]
    table_rows = _simulated(simulated, numel, element_size, size, nodes)
    if table_rows:
        schedules = _distinct(table_rows)
    elif (
        cal is not None
        and cal.size == size
        and cal.nodes == nodes
        and (nodes == 1 or cal.has_inter)
    ):
        if topology is not None and (topology.size != size or topology.nodes != nodes):
            topology = None
        rows = table(numel * element_size, cal, element_size, topology)
        schedules = _distinct([row for row in rows if row[0] not in algorithms.NATIVE])
    else:
        schedules = ["rabenseifner" if numel * element_size >= 64 << 10 else "recursive_doubling"]
    return list(dict.fromkeys([pick, *natives, *schedules[:2]]))[:count]
