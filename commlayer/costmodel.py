"""Cost model of the allreduce algorithms, calibrated on this machine; it decides ``auto``.

A schedule (algorithms/schedule.py) is costed step by step with the alpha-beta-gamma model:

    step time = T(max(bytes sent, bytes received)) + (m - 1) alpha + (gamma | copy) * bytes received
                - overlap * min(T + (m - 1) alpha, (m - 1)/m * (gamma | copy) * bytes received)

with gamma when the step reduces what it receives and copy when it overwrites; m is the number of
messages each way (a chunked ring step sends its block in m pieces, and the executor reduces a
piece while later ones are in flight, so up to (m - 1)/m of the local work can hide behind the
transfers). ``overlap`` in [0, 1] is measured by ``calibrate``: how much of a local reduction
running between posting an exchange and waiting for it is hidden. It is ~0 when the MPI library
moves data only inside MPI calls (MPICH between ranks of one node here), and nearer 1 with
transfers that progress on their own (RDMA NICs, progress threads). T(n), the time of
one message each way, is alpha + beta n read off a measured curve (piecewise: MPI's eager and
rendezvous protocols have different alphas and betas, which one line cannot follow; the fitted
alpha and beta are kept as its summary). An algorithm's time is the largest sum over the ranks'
schedules (ranks are sampled at large sizes). The curve is measured by ``calibrate`` with every
rank exchanging with a partner at once through the real executor, so Python's per-step
overhead and the contention of ranks sharing one memory bus are in it; the executor's copy of
the received bytes over the buffer is taken out of it (step_time adds the step's own copy or
reduction; counting it twice overpredicted every large step).
gamma and copy are measured on local buffers from 16 KiB (in cache) to 64 MiB, and read off
that curve at each step's size (linearly below it). The two native algorithms (``mpi``, ``shm``) are
not schedules; calibrate measures their time at sizes 1 KiB - 64 MiB and the model interpolates
(log-log) between the measured sizes and extrapolates at constant bandwidth beyond them.

Several nodes (given a topology): a transfer to a rank on another node is read off a second
curve, ``exchange_inter``, measured by ``calibrate`` between partners on different nodes, every
pair at once; a step costs the slower of its parts inside and across nodes. Contention factor:
when k ranks of a node send (receive) across nodes in the same step, that part is costed as k
times the bytes, the node's one link carrying the k flows. Its limits: the ranks' schedules are
assumed step-aligned (true of the symmetric algorithms; a rank ahead or behind shares less),
each node has one full-duplex link, and links meeting in a switch are not shared. Without an
inter curve (calibrations from before it, or of one node) every transfer is costed on the one
curve as before, and ``auto`` on several nodes keeps the MPI library's own allreduce.

``commlayer calibrate`` (under mpiexec) measures and saves; ``commlayer algorithms --size 64MiB``
prints the predicted table. Without a calibration for the job's size, ``auto`` uses ``shm`` for
buffers of 1 MiB and more when every rank is on one node (``HEURISTIC_SHM_BYTES``: what was
measured), else ``mpi``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from commlayer import algorithms
from commlayer.algorithms.schedule import Schedule, Step
from commlayer.algorithms.topology import Topology

# Without a calibration, one node uses the shared-memory window from 1 MiB: it was level with
# or ahead of MPICH from 1 MiB at 2 and 4 ranks in benchmarks/results/algorithms_np*.md (1 MiB:
# 0.92-1.83x, 4-16 MiB 0.92-1.85x, 64 MiB 1.06-3.49x), and in paired training runs of the MLP
# at 2 ranks it gave 1.14-1.36 of DDP against 1.05-1.18 through MPICH below 32 MiB.
HEURISTIC_SHM_BYTES = 1 << 20
SCHEDULE_MARGIN = 1.25  # a schedule must be predicted 1.25x faster than the best native one
NATIVE_SIZES = tuple(1 << k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB
_SAMPLED_RANKS = 8
# run_local_collective times loops of ~10 ms: the skew of ranks leaving its barrier is spread
# over more calls, nearer the long loops of benchmarks/algorithms.py (2 ms before; the
# difference was within this machine's noise in the one comparison made)
_LOOP_S = 10e-3


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured for ``size`` ranks on ``nodes`` node(s)."""

    size: int
    nodes: int
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    copy_s_per_byte: float
    native: dict[str, list[tuple[int, float]]]  # name -> [(bytes, seconds)], sizes ascending
    # one message each way between partners, every rank at once: (bytes, seconds); alpha and
    # beta above are its least-squares summary, the curve itself costs the steps
    exchange: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    # local work per step, "reduce" and "copy": (bytes, seconds); small buffers run in cache,
    # several times faster per byte than the gamma and copy rates of large ones
    local: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    # fraction of local work hidden behind transfers in flight (0 = none, 1 = all); 0 for
    # calibrations written before it was measured
    overlap: float = 0.0
    host: str = ""
    date: str = ""
    # as ``exchange``, between partners on different nodes (every pair at once, so a node's
    # ranks share its link); empty on one node and in calibrations from before it: see has_inter
    exchange_inter: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    @property
    def has_inter(self) -> bool:
        """Whether inter-node transfers were measured (``exchange_inter``); without it the
        model costs every transfer on the one ``exchange`` curve and ``auto`` on several nodes
        keeps ``mpi``."""
        return bool(self.exchange_inter)


# -- prediction ----------------------------------------------------------------------------------
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
    return _local_curve_time(curve, nbytes)


def _local_curve_time(curve: Sequence[tuple[int, float]], nbytes: int) -> float:
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
def _link_sharing(name: str, numel: int, topology: Topology, node: int) -> tuple[Sharing, ...]:
    """Per step index, how many ranks of ``node`` send across nodes and how many receive (at
    least 1 each): the contention factor, from the schedules of all the node's ranks, which are
    assumed step-aligned. Cached: ``choose`` and ``table`` ask for every algorithm and size."""
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
    if name in algorithms.NATIVE:
        curve = cal.native.get(name)
        return _interpolate(curve, numel * element_size) if curve else None
    links = topology if topology is not None and topology.nodes > 1 and cal.has_inter else None
    slowest = 0.0
    for r in _sampled_ranks(cal.size):
        schedule = algorithms.schedule(name, r, cal.size, numel, topology)
        sharing = _link_sharing(name, numel, links, links.node_of[r]) if links else ()
        slowest = max(slowest, schedule_time(schedule, element_size, cal, topology, r, sharing))
    return slowest


def _interpolate(curve: Sequence[tuple[int, float]], nbytes: int) -> float:
    points = sorted(curve)
    if nbytes <= points[0][0]:
        return points[0][1]
    if nbytes >= points[-1][0]:
        size, seconds = points[-1]
        return seconds * nbytes / size  # constant bandwidth beyond the largest measured size
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= nbytes <= x1:
            frac = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + frac * (math.log(y1) - math.log(y0)))
    raise AssertionError("unreachable")


def candidates(single_node: bool) -> list[str]:
    names = [n for n in algorithms.available() if n != algorithms.AUTO]
    return names if single_node else [n for n in names if n != "shm"]


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
) -> str:
    """``auto``'s pick: with a calibration for this size and node count (on several nodes: one
    with an inter curve), the lowest predicted time on ``topology`` (else ``node_major``),
    except that a schedule must beat the best native algorithm (whose time is measured) by
    SCHEDULE_MARGIN; else the measured rule of thumb. Every rank computes the same."""
    if size == 1:
        return "mpi"
    if cal is None or cal.size != size or cal.nodes != nodes:
        if nodes == 1 and numel * element_size >= HEURISTIC_SHM_BYTES:
            return "shm"
        return "mpi"
    if nodes > 1 and not cal.has_inter:
        return "mpi"
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


def ranked(
    numel: int,
    element_size: int,
    size: int,
    nodes: int,
    cal: Calibration | None,
    topology: Topology | None = None,
    count: int = 4,
) -> list[str]:
    """What online tuning (algorithms/autotune.py) measures against each other, at most
    ``count`` names: ``auto``'s pick (``choose``), then the native algorithms (``shm`` on one
    node, ``mpi``), then the two schedules with the lowest predicted times (with a calibration
    that fits; else ``rabenseifner``, bandwidth-optimal, or below 64 KiB
    ``recursive_doubling``, latency-optimal). The natives always take part: they are the
    fastest where they are, and a calibration taken while the machine ran in another state can
    rank them last (at 2 ranks here the window is 3x MPICH in one state and level with it in
    the other). Two schedules, not one: the best ones are often predicted within a few percent
    of each other, closer than the model's accuracy (at 4 ranks, 256 MiB: rabenseifner 252 ms,
    ring 256 ms; ring measured up to 1.19x faster, and tuning, measuring rabenseifner alone,
    kept it at 0.82x of ring in turn). Every rank computes the same."""
    pick = choose(numel, element_size, size, nodes, cal, topology)
    if size == 1:
        return [pick]
    natives = ["shm", "mpi"] if nodes == 1 else ["mpi"]
    if (
        cal is not None
        and cal.size == size
        and cal.nodes == nodes
        and (nodes == 1 or cal.has_inter)
    ):
        if topology is not None and (topology.size != size or topology.nodes != nodes):
            topology = None
        rows = table(numel * element_size, cal, element_size, topology)
        schedules = [name for name, _ in rows if name not in algorithms.NATIVE]
    else:
        schedules = ["rabenseifner" if numel * element_size >= 64 << 10 else "recursive_doubling"]
    return list(dict.fromkeys([pick, *natives, *schedules[:2]]))[:count]


# -- storage ---------------------------------------------------------------------------------------
def default_path() -> Path:
    from commlayer import config  # here: config imports the algorithms, which import us

    return config.cache_dir() / "calibration.json"


def _key(size: int, nodes: int) -> str:
    return f"size={size},nodes={nodes}"


def save(cal: Calibration, path: Path | None = None) -> Path:
    """Add or replace the calibration for its (size, nodes) in the file."""
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = _read(path)
    stored[_key(cal.size, cal.nodes)] = dataclasses.asdict(cal)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load(size: int, nodes: int, path: Path | None = None) -> Calibration | None:
    return _from_raw(_read(path or default_path()).get(_key(size, nodes)))


def load_all(path: Path | None = None) -> list[Calibration]:
    return [cal for raw in _read(path or default_path()).values() if (cal := _from_raw(raw))]


def to_bytes(cals: Sequence[Calibration]) -> bytes:
    """The calibrations as one payload (the engine makes every rank use rank 0's)."""
    return json.dumps([dataclasses.asdict(cal) for cal in cals], sort_keys=True).encode()


def from_bytes(payload: bytes) -> list[Calibration]:
    return [cal for raw in json.loads(payload) if (cal := _from_raw(raw))]


def _from_raw(raw: Any) -> Calibration | None:
    if not isinstance(raw, dict):
        return None
    try:
        raw["native"] = {k: [tuple(p) for p in v] for k, v in raw["native"].items()}
        raw["exchange"] = [tuple(p) for p in raw.get("exchange", [])]
        raw["exchange_inter"] = [tuple(p) for p in raw.get("exchange_inter", [])]
        raw["local"] = {k: [tuple(p) for p in v] for k, v in raw.get("local", {}).items()}
        return Calibration(**raw)
    except (TypeError, KeyError, AttributeError):
        return None  # written by another version: as if absent


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# -- calibration -----------------------------------------------------------------------------------
def _local_rate(fn: Callable[[], object], nbytes: int, repeats: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / nbytes


def calibrate(
    backend: Any, *, quick: bool = False, topology: Topology | None = None
) -> Calibration:
    """Measure this machine over ``backend`` (an MPI backend; collective: every rank calls it
    together) on its detected nodes, or on ``topology`` (COMMLAYER_TOPOLOGY: one machine as
    several nodes). Every number is the slowest rank's, so all ranks return the same."""
    from commlayer.algorithms.executor import Allreducer, ScheduleRequest, Scratch
    from commlayer.algorithms.schedule import Transfer
    from commlayer.reduce_ops import ReduceOp

    size, rank = backend.size, backend.rank
    topology = topology or Topology(tuple(backend.nodes()))
    nodes = topology.nodes
    local_sizes = [1 << k for k in range(14, 27, 4)]  # 16 KiB .. 64 MiB
    rates = torch.zeros(2, len(local_sizes), dtype=torch.float64)
    for i, nbytes in enumerate(local_sizes):
        a, b = torch.rand(nbytes // 4), torch.rand(nbytes // 4)
        repeats = 3 if nbytes > 1 << 24 else 20
        rates[0, i] = _local_rate(functools.partial(torch.Tensor.add_, a, b), nbytes, repeats)
        rates[1, i] = _local_rate(functools.partial(torch.Tensor.copy_, a, b), nbytes, repeats)
    _finish(backend.iallreduce(None, rates, ReduceOp.Max))
    gamma, copy = float(rates[0, -1]), float(rates[1, -1])
    local = {
        kind: [(n, float(rates[row, i]) * n) for i, n in enumerate(local_sizes)]
        for row, kind in enumerate(("reduce", "copy"))
    }

    # alpha, beta: every rank exchanges with a partner at once, through the executor (inside
    # its node, and on several nodes also with one on another node); and the native
    # algorithms' times. This machine's speed drifts by up to 2x within a minute: every size is
    # taken in turn (its exchanges and natives at one moment, as auto compares them), in rounds
    # over all sizes, and each point is the median of its rounds.
    scratch = Scratch()
    partners = {"exchange": _partner(topology, rank, False)}
    if nodes > 1:
        partners["exchange_inter"] = _partner(topology, rank, True)
    exchange_sizes = [8, *(1 << k for k in range(10, 27, 4 if quick else 2))]  # 8 B .. 64 MiB
    native_sizes = NATIVE_SIZES[::2] if quick else NATIVE_SIZES
    natives = {name: Allreducer(name) for name in (("mpi", "shm") if nodes == 1 else ("mpi",))}
    timed: dict[tuple[str, int], list[float]] = {}
    for _ in range(1 if quick else 3):
        for nbytes in sorted({*exchange_sizes, *native_sizes}):
            numel = max(nbytes // 4, 1)
            buf = torch.zeros(numel)
            jobs: list[tuple[str, Callable[[], None]]] = []
            if nbytes in exchange_sizes:
                for key, partner in partners.items():
                    schedule = []
                    if partner is not None:
                        both = (Transfer(partner, 0, numel),)
                        schedule.append(Step(both, both, False))

                    def exchange(buf: torch.Tensor = buf, schedule: Schedule = schedule) -> None:
                        _finish(ScheduleRequest(backend, schedule, buf, ReduceOp.Sum, scratch))

                    jobs.append((key, exchange))
            if nbytes in native_sizes:
                for name, allreducer in natives.items():

                    def allreduce(
                        buf: torch.Tensor = buf, allreducer: Allreducer = allreducer
                    ) -> None:
                        _finish(allreducer(backend, None, buf, ReduceOp.Sum))

                    jobs.append((name, allreduce))
            for key, fn in jobs:
                timed.setdefault((key, nbytes), []).append(run_local_collective(backend, fn, True))
    medians = {
        key: [(n, statistics.median(timed[key, n])) for n in exchange_sizes] for key in partners
    }
    # The executor copied each received message over the buffer, which step_time counts on its
    # own (local "copy"): the curves keep the transfer alone (at least half of what was timed).
    curves = {
        key: [(n, max(t - _local_curve_time(local["copy"], n), t / 2)) for n, t in points]
        for key, points in medians.items()
    }
    native = {
        name: [(n, statistics.median(timed[name, n])) for n in native_sizes] for name in natives
    }
    alpha, beta = _fit([(float(n), t) for n, t in curves["exchange"]])
    overlap = _measure_overlap(backend, partners["exchange"], quick)
    return Calibration(
        size=size,
        nodes=nodes,
        alpha_s=alpha,
        beta_s_per_byte=beta,
        gamma_s_per_byte=gamma,
        copy_s_per_byte=copy,
        native=native,
        exchange=curves["exchange"],
        local=local,
        overlap=overlap,
        host=platform.node(),
        date=datetime.date.today().isoformat(),
        exchange_inter=curves.get("exchange_inter", []),
    )


def _partner(topology: Topology, rank: int, inter: bool) -> int | None:
    """``rank``'s partner for the exchange curves: inside the node, local index i with i ^ 1;
    across (``inter``), the rank of the same local index on node j ^ 1 for this node j (nodes
    in order of appearance). None when there is none: the rank still joins the timing."""
    node = topology.node_of[rank]
    members = topology.members(node)
    index = members.index(rank)
    if not inter:
        return members[index ^ 1] if index ^ 1 < len(members) else None
    nodes = sorted(set(topology.node_of))
    other = nodes.index(node) ^ 1
    if other >= len(nodes):
        return None
    members = topology.members(nodes[other])
    return members[index] if index < len(members) else None


def _measure_overlap(backend: Any, partner: int | None, quick: bool) -> float:
    """How much of a 4 MiB reduction, run between posting a 4 MiB exchange with the partner
    and waiting for it, hides behind the exchange: (comm + local - both) / min(comm, local),
    clipped to [0, 1]; the slowest-to-hide rank's value, the same on every rank (collective;
    a rank without a partner, the last one of an odd size, does not vote)."""
    from commlayer.reduce_ops import ReduceOp

    numel = (4 << 20) // 4
    a, b = torch.rand(numel), torch.rand(numel)
    out, into = torch.zeros(numel), torch.zeros(numel)

    def exchange(work: bool, comm: bool = True) -> None:
        requests = []
        if comm and partner is not None:
            requests = [backend.irecv(into, partner), backend.isend(out, partner)]
        if work:
            a.add_(b)
        for request in requests:
            _finish(request)

    rounds = []  # the three timed back to back, several times: a load change between them
    for _ in range(3 if quick else 7):  # (another job, a helper) would skew one round only
        comm = run_local_collective(backend, functools.partial(exchange, False), True)
        local = run_local_collective(backend, functools.partial(exchange, True, False), True)
        both = run_local_collective(backend, functools.partial(exchange, True), True)
        rounds.append((comm + local - both) / max(min(comm, local), 1e-12))
    hidden = 1.0 if partner is None else sorted(rounds)[len(rounds) // 2]
    result = torch.tensor([min(1.0, max(0.0, hidden))], dtype=torch.float64)
    _finish(backend.iallreduce(None, result, ReduceOp.Min))
    return float(result)


def _finish(request: Any) -> None:
    """Wait for a backend request, yielding the CPU between tests (calibration runs alone)."""
    while not request.test():
        os.sched_yield()


def run_local_collective(backend: Any, fn: Callable[[], object], quick: bool) -> float:
    """Median over repetitions of the slowest rank's time for fn, all ranks starting together
    (a barrier); the same number on every rank."""
    from commlayer.reduce_ops import ReduceOp

    fn()
    t0 = time.perf_counter()
    fn()
    once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    _finish(backend.iallreduce(None, once, ReduceOp.Max))
    # Loops of ~_LOOP_S: the skew of ranks leaving the barrier is spread over many calls.
    loop = max(1, min(200, int(_LOOP_S / max(float(once), 1e-7))))
    samples = torch.zeros(3 if quick else 7, dtype=torch.float64)
    for i in range(samples.numel()):
        _finish(backend.ibarrier())
        t0 = time.perf_counter()
        for _ in range(loop):
            fn()
        samples[i] = (time.perf_counter() - t0) / loop
    _finish(backend.iallreduce(None, samples, ReduceOp.Max))
    return float(samples.median())


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising the relative error of alpha + beta * n over the points."""
    import numpy as np

    rows = np.array([[1.0 / t, n / t] for n, t in points])
    solution, *_ = np.linalg.lstsq(rows, np.ones(len(points)), rcond=None)
    alpha, beta = float(solution[0]), float(solution[1])
    if alpha <= 0 or beta <= 0:  # degenerate: smallest time for alpha, largest slope for beta
        alpha = min(t for _, t in points)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        beta = max((t1 - t0) / (n1 - n0), 1e-12)
    return alpha, beta
