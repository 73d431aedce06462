"""Cost model of the sparse allreduce algorithms; it decides ``auto``.

alpha-beta-gamma per step as for the dense schedules (costmodel/model.py), with the bytes a step
moves predicted from the density: with every rank holding ``nnz`` of ``numel`` indices at
random, a range of L elements holding m ranks' entries holds L (1 - (1 - nnz/numel)^m) of them
(the fill-in). Any registered schedule is costed from its steps and its policy, with no
per-algorithm formula: ``_shapes`` runs every rank's schedule once without data, matching the
k-th send from a to b with the k-th receive of b from a as MPI does, and records for each
transfer how many ranks' entries each part of its range carries (and, for a receive, how many
the receiver's own range held before it). A stream of e entries over L elements costs
e (index + value bytes), or L value bytes once the policy switches to dense and that is
smaller; a step costs alpha + beta max(bytes sent, received); with several ranks per node
(a topology), the slower of its node's link (alpha + beta times the bytes the streams of all
the node's ranks to or from other nodes carry in that step, the ranks assumed step-aligned as
in the dense model) and the rank's own bytes at the intra-node alpha and beta (``Rates``,
default the same); a reducing step merges the
rank's own entries of each received range with the stream, in order (``merge_s_per_pair`` per
pair, own + received; nothing once the range is dense: an add), a copying step only moves
bytes; a selecting step (gtopk) then runs a top-k (~two merge passes) and keeps k entries.
The time is the slowest rank's, the bytes sent the most any rank sends. ``allgather`` is not a
schedule: the p - 1 others' lists arrive through MPI's allgatherv (log2 p rounds) and are merged
one after another, or scatter-added into a dense buffer once they would be larger sparse
(``scatter_s_per_entry``).

alpha and beta come from the dense calibration when one exists (``commlayer calibrate``), else
from the defaults below (measured on the 2-core development machine: ~60 us per executor step,
~3 GB/s point to point between two ranks); the merge and scatter rates from ``commlayer
calibrate`` too (:func:`calibrate_local`, saved beside the dense calibration), else the defaults
(numba, measured by benchmarks/kernels.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import platform
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import torch

from commlayer import kernels
from commlayer.algorithms import sparse
from commlayer.algorithms.schedule import Schedule, Step, Transfer
from commlayer.common import config
from commlayer.common.topology import Topology
from commlayer.costmodel.calibration import Calibration, load


@dataclass(frozen=True)
class Rates:
    alpha_s: float = 60e-6
    beta_s_per_byte: float = 1 / 3e9
    merge_s_per_pair: float = 1 / 150e6  # numba merge, 1%+1% of 4M: ~150 M pairs/s (own + in)
    scatter_s_per_entry: float = 1 / 300e6
    # between ranks of one node, where the topology has several nodes (None: alpha_s, beta);
    # alpha_s and beta_s_per_byte are then the node link's
    intra_alpha_s: float | None = None
    intra_beta_s_per_byte: float | None = None

    @classmethod
    def of(cls, cal: Calibration | None, path: Path | None = None) -> Rates:
        """The dense calibration's alpha and beta, and the saved merge/scatter rates."""
        local = load_local(path)
        base = cls() if cal is None else cls(cal.alpha_s, cal.beta_s_per_byte)
        return dataclasses.replace(base, **local)


@functools.lru_cache(maxsize=16)
def calibrated(size: int) -> Rates:
    """Rates for ``size`` ranks on one node from what ``commlayer calibrate`` saved (read
    once per process), defaults where nothing was measured."""
    return Rates.of(load(size, 1))


def local_path() -> Path:
    return config.cache_dir() / "sparse_calibration.json"


def load_local(path: Path | None = None) -> dict[str, float]:
    """Saved merge and scatter rates ({} when none were measured)."""
    path = path or local_path()
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {k: float(data[k]) for k in ("merge_s_per_pair", "scatter_s_per_entry") if k in data}


def calibrate_local(quick: bool = False, path: Path | None = None) -> dict[str, float]:
    """Measure this process's merge and scatter-add rates with the configured kernels (two
    random 1% lists of 4M elements, median of 5 after a warm-up) and save them."""
    n = 1 << (20 if quick else 22)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randperm(n, generator=g)[: n // 100].sort().values.int() for _ in range(2))
    va, vb = torch.randn(a.numel(), generator=g), torch.randn(b.numel(), generator=g)
    dense = torch.zeros(n)

    def seconds(fn: object) -> float:
        samples = []
        for rep in range(6):
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            if rep:
                samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]

    rates = {
        "merge_s_per_pair": seconds(lambda: kernels.merge_sum(a, va, b, vb)) / (2 * a.numel()),
        "scatter_s_per_entry": seconds(lambda: kernels.scatter_add_(dense, a, va)) / a.numel(),
    }
    stored = dict(rates, kernels=kernels.configured(), host=platform.node(),
                  date=datetime.date.today().isoformat())  # fmt: skip
    path = path or local_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1, sort_keys=True))
    return rates


@dataclass(frozen=True)
class Prediction:
    seconds: float
    bytes_sent: float  # by one rank


Pieces = tuple[tuple[int, int], ...]  # (elements, ranks whose entries they hold), by ranks
_Stream = tuple[int, int, Pieces]  # (peer, length, pieces) of one transfer


@dataclass(frozen=True, slots=True)
class _Receive:
    length: int
    received: Pieces  # what the stream carries
    own: Pieces  # what the receiver held of the range just before applying it


@dataclass(frozen=True, slots=True)
class _Shape:
    """One step of one rank, as the cost model sees it."""

    sends: tuple[tuple[int, int, Pieces], ...]  # (streams, length, pieces): alike streams once
    receives: tuple[_Receive, ...]
    reduce: bool
    select: bool  # keeps the top k afterwards (policy ``select``, a step both ways)
    # with several ranks per node: what the rank's node link carries in this step, out and in
    # (every stream of the node's ranks to or from another node, as ``sends``)
    shared: bool = False
    link_out: tuple[tuple[int, int, Pieces], ...] = ()
    link_in: tuple[tuple[int, int, Pieces], ...] = ()


class _DryRun:
    """Every rank's schedule run without data: per part of the buffer (the finest partition the
    schedules' ranges make), how many ranks' entries each rank holds, step by step. The k-th
    send from a to b meets the k-th receive of b from a, as in MPI."""

    def __init__(
        self, schedules: list[Schedule], numel: int, policy: sparse.Policy, record: bool = False
    ) -> None:
        ends = {e for s in schedules for st in s for t in (*st.sends, *st.recvs)
                for e in (t.start, t.stop)}  # fmt: skip
        edges = sorted({0, numel, *ends})
        self._at = {e: i for i, e in enumerate(edges)}
        self._lengths = [b - a for a, b in zip(edges, edges[1:])]
        self._schedules, self._policy = schedules, policy
        self._held = [[1] * len(self._lengths) for _ in schedules]
        self._sent: dict[tuple[int, int], deque[list[int]]] = {}  # (src, dst): counts in order
        self._posted: list[tuple[tuple[int, int, Pieces], ...] | None] = [None] * len(schedules)
        self.shapes: list[list[_Shape]] = [[] for _ in schedules]
        # with ``record``: per rank and step, the (peer, length, pieces) of every send and
        # receive (``streams``: what a simulator replays)
        self.streams: list[list[tuple[list[_Stream], list[_Stream]]]] | None = (
            [[] for _ in schedules] if record else None
        )
        self._sending: list[list[_Stream]] = [[] for _ in schedules]

    def run(self, name: str) -> None:
        left = [r for r in range(len(self._schedules)) if self._schedules[r]]
        while left:
            if not any([self._advance(r) for r in left]):
                raise ValueError(f"sparse schedule {name!r} deadlocks: ranks {left} wait")
            left = [r for r in left if len(self.shapes[r]) < len(self._schedules[r])]

    def _pieces(self, t: Transfer, counts: list[int]) -> Pieces:
        by_count: Counter[int] = Counter()
        for i, m in enumerate(counts, self._at[t.start]):
            by_count[m] += self._lengths[i]
        return tuple(sorted((length, m) for m, length in by_count.items()))

    def _advance(self, r: int) -> bool:
        """Post rank ``r``'s next step, or complete it once every stream it receives was sent;
        whether anything happened."""
        st = self._schedules[r][len(self.shapes[r])]
        sends = self._posted[r]
        if sends is None:
            posted: Counter[tuple[int, Pieces]] = Counter()
            for t in st.sends:
                counts = self._held[r][self._at[t.start] : self._at[t.stop]]
                self._sent.setdefault((r, t.peer), deque()).append(counts)
                pieces = self._pieces(t, counts)
                posted[t.numel, pieces] += 1
                if self.streams is not None:
                    self._sending[r].append((t.peer, t.numel, pieces))
            self._posted[r] = tuple((n, length, p) for (length, p), n in posted.items())
            return True
        wanted = Counter(t.peer for t in st.recvs)
        if any(len(self._sent.get((p, r), ())) < n for p, n in wanted.items()):
            return False
        held, receives, received = self._held[r], [], []
        for t in st.recvs:
            got, lo = self._sent[(t.peer, r)].popleft(), self._at[t.start]
            own = self._pieces(t, held[lo : self._at[t.stop]])
            receives.append(_Receive(t.numel, self._pieces(t, got), own))
            if self.streams is not None:
                received.append((t.peer, t.numel, receives[-1].received))
            for i, m in enumerate(got, lo):
                held[i] = held[i] + m if st.reduce else m
        select = self._policy.select and st.reduce and bool(st.sends) and bool(st.recvs)
        if select:  # k entries kept: one rank's worth
            held[:] = [1] * len(held)
        self.shapes[r].append(_Shape(sends, tuple(receives), st.reduce, select))
        if self.streams is not None:
            self.streams[r].append((self._sending[r], received))
            self._sending[r] = []
        self._posted[r] = None
        return True


def _coalesced(schedule: Schedule) -> Schedule:
    """Each step's adjacent pieces to or from one peer as one stream: a chunked ring step moves
    a block in pieces of RING_CHUNK_ELEMENTS, the same entries and bytes as one stream, and the
    step costs one alpha either way. Both ends of a transfer join the same pieces."""

    def joined(transfers: tuple[Transfer, ...]) -> tuple[Transfer, ...]:
        out: list[Transfer] = []
        for t in transfers:
            if out and out[-1].peer == t.peer and out[-1].stop == t.start:
                out[-1] = Transfer(t.peer, out[-1].start, t.stop)
            else:
                out.append(t)
        return tuple(out)

    return [Step(joined(st.sends), joined(st.recvs), st.reduce) for st in schedule]


@functools.lru_cache(maxsize=64)
def _shapes(
    name: str, size: int, numel: int, topology: Topology | None, generation: int
) -> tuple[tuple[_Shape, ...], ...]:
    """The distinct step lists of the ranks under schedule ``name`` (``_DryRun``); cached per
    buffer, ``generation`` (the registry's) keeping a name registered again from the cache."""
    schedules = [_coalesced(sparse.schedule(name, r, size, numel, topology)) for r in range(size)]
    shared = topology is not None and 1 < topology.nodes < size
    run = _DryRun(schedules, numel, sparse.policy(name), record=shared)
    run.run(name)
    shapes = run.shapes
    if shared and topology is not None and run.streams is not None:
        shapes = _with_node_links(shapes, run.streams, topology)
    return tuple(dict.fromkeys(tuple(steps) for steps in shapes))


def _with_node_links(
    shapes: list[list[_Shape]],
    streams: list[list[tuple[list[_Stream], list[_Stream]]]],
    topology: Topology,
) -> list[list[_Shape]]:
    """Each step told what its node's link carries then: the streams of all the node's ranks
    to (from) other nodes in the same step, the ranks assumed step-aligned as in the dense
    model (costmodel/model.py). Four GPUs of a node sending across at once share one link."""
    node_of = topology.node_of
    out: dict[tuple[int, int], Counter[tuple[int, Pieces]]] = {}
    into: dict[tuple[int, int], Counter[tuple[int, Pieces]]] = {}
    for r, steps in enumerate(streams):
        for i, (sends, recvs) in enumerate(steps):
            for found, transfers in ((out, sends), (into, recvs)):
                counter = found.setdefault((node_of[r], i), Counter())
                for peer, length, pieces in transfers:
                    if node_of[peer] != node_of[r]:
                        counter[length, pieces] += 1

    def carried(found: Counter[tuple[int, Pieces]]) -> tuple[tuple[int, int, Pieces], ...]:
        return tuple(sorted((n, length, p) for (length, p), n in found.items()))

    return [
        [
            dataclasses.replace(
                shape,
                shared=True,
                link_out=carried(out[node_of[r], i]),
                link_in=carried(into[node_of[r], i]),
            )
            for i, shape in enumerate(steps)
        ]
        for r, steps in enumerate(shapes)
    ]


class _Density:
    """Entries and bytes of streams when every rank holds ``nnz`` of ``numel`` at random."""

    def __init__(self, numel: int, nnz: int, value_bytes: int, index_bytes: int, switch: bool):
        self._absent = 1 - min(nnz / max(numel, 1), 1.0)  # an index missing from one rank
        self.vb, self.pair, self.switch = value_bytes, value_bytes + index_bytes, switch
        self._entries: dict[Pieces, float] = {}  # the same ranges recur in step after step

    def entries(self, pieces: Pieces) -> float:
        found = self._entries.get(pieces)
        if found is None:
            found = self._entries[pieces] = sum(
                length * (1 - self._absent**m) for length, m in pieces
            )
        return found

    def wire(self, entries: float, length: int) -> float:
        sparse_bytes = entries * self.pair
        return min(sparse_bytes, length * self.vb) if self.switch else sparse_bytes

    def merged(self, own: float, received: float, length: int) -> float:
        """Pairs a reducing step merges (none once a switching range is dense: an add)."""
        dense = self.switch and (own + received) * self.pair >= length * self.vb
        return 0.0 if dense else own + received


def _rank_cost(steps: tuple[_Shape, ...], d: _Density, r: Rates) -> tuple[float, float]:
    """(seconds, bytes sent) of one rank's steps."""
    entries, wire = d.entries, d.wire
    seconds = total_sent = 0.0
    for st in steps:
        sent = received = merged = 0.0
        for n, length, pieces in st.sends:
            sent += n * wire(entries(pieces), length)
        for x in st.receives:
            got = entries(x.received)
            received += wire(got, x.length)
            if st.reduce:
                merged += d.merged(entries(x.own), got, x.length)
        seconds += _transfer_time(st, max(sent, received), d, r)
        # a selecting step then runs torch.topk of the merged vector: ~ a merge pass or two
        seconds += (3 if st.select else 1) * r.merge_s_per_pair * merged
        total_sent += sent
    return seconds, total_sent


def _transfer_time(st: _Shape, own_bytes: float, d: _Density, r: Rates) -> float:
    """The step's transfers: the rank's own bytes each way, or on a node of several ranks
    (``st.shared``), the slower of the node link (its ranks' streams to and from other nodes)
    and the rank's own bytes at the intra-node rate (what it sends across is in the link's)."""
    if not st.shared:
        return r.alpha_s + r.beta_s_per_byte * own_bytes
    link = max(
        sum(n * d.wire(d.entries(pieces), length) for n, length, pieces in carried)
        for carried in (st.link_out, st.link_in)
    )
    intra_alpha = r.alpha_s if r.intra_alpha_s is None else r.intra_alpha_s
    intra_beta = r.beta_s_per_byte if r.intra_beta_s_per_byte is None else r.intra_beta_s_per_byte
    if not (st.link_out or st.link_in):
        return intra_alpha + intra_beta * own_bytes
    return max(r.alpha_s + r.beta_s_per_byte * link, intra_alpha + intra_beta * own_bytes)


def _allgather(
    size: int, numel: int, nnz: int, d: _Density, r: Rates, topology: Topology | None = None
) -> Prediction:
    """The native allgather: p - 1 lists in log2 p rounds, merged one after another, or
    scatter-added into a dense buffer once p lists would be larger sparse. By recursive
    doubling (MPI's on a power of two, and the simulator's trace) on nodes of g ranks each
    (g a power of two, rank r on node r // g), the first log2 g rounds bring g - 1 lists
    inside the node (intra-node rates), and in every later round all g ranks send across at
    once: the node's link carries g (p - g) lists, not p - g (16 ranks, 4 per node: 48)."""
    sent = (size - 1) * nnz * d.pair
    g = _ranks_per_node(topology)
    if g > 1 and size & (size - 1) == 0:
        intra_alpha = r.alpha_s if r.intra_alpha_s is None else r.intra_alpha_s
        intra_beta = (
            r.beta_s_per_byte if r.intra_beta_s_per_byte is None else r.intra_beta_s_per_byte
        )
        inside = math.log2(g) * intra_alpha + intra_beta * (g - 1) * nnz * d.pair
        across = (
            math.log2(size // g) * r.alpha_s + r.beta_s_per_byte * g * (size - g) * nnz * d.pair
        )
        seconds = inside + across
    else:
        seconds = math.ceil(math.log2(size)) * r.alpha_s + r.beta_s_per_byte * sent
    if size * nnz * d.pair >= numel * d.vb:
        seconds += r.scatter_s_per_entry * size * nnz
    else:
        merged = sum(d.entries(((numel, j),)) + nnz for j in range(1, size))
        seconds += r.merge_s_per_pair * merged
    return Prediction(seconds, sent)


def _ranks_per_node(topology: Topology | None) -> int:
    """g when the topology is several nodes of g ranks each, g a power of two, rank r on node
    r // g (how recursive doubling meets the nodes); 1 otherwise."""
    if topology is None or not 1 < topology.nodes < topology.size:
        return 1
    g = topology.size // topology.nodes
    node_major = topology.node_of == tuple(r // g for r in range(topology.size))
    return g if node_major and g & (g - 1) == 0 else 1


def predict(
    name: str,
    size: int,
    numel: int,
    nnz: int,
    topology: Topology | None = None,
    value_bytes: int = 4,
    index_bytes: int = 4,
    rates: Rates | None = None,
) -> Prediction:
    """Predicted time (the slowest rank's) and bytes sent (the most by one rank) of sparse
    algorithm ``name`` (not auto): ``allgather``'s own model, or any registered schedule costed
    from its steps."""
    if name == sparse.AUTO or name not in sparse.available():
        raise ValueError(f"no cost model for sparse algorithm {name!r}")
    if size == 1:
        return Prediction(0.0, 0.0)
    r = rates or calibrated(size)
    d = _Density(numel, nnz, value_bytes, index_bytes, sparse.policy(name).switch)
    if name in sparse.NATIVE:
        return _allgather(size, numel, nnz, d, r, topology)
    seconds = sent = 0.0
    for steps in _shapes(name, size, numel, topology, sparse.generation()):
        rank_seconds, rank_sent = _rank_cost(steps, d, r)
        seconds, sent = max(seconds, rank_seconds), max(sent, rank_sent)
    return Prediction(seconds, sent)


def streams(
    name: str,
    size: int,
    numel: int,
    nnz: int,
    topology: Topology | None = None,
    value_bytes: int = 4,
    index_bytes: int = 4,
) -> list[list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]]:
    """Every rank's steps of sparse schedule ``name`` as the network sees them, each rank
    holding ``nnz`` of ``numel`` indices at random: per step, the (peer, expected bytes) of each
    send and each receive in the schedule's order (the fill-in and dense switch ``predict``
    costs; a send and its matching receive carry the same number). sim/export.py writes these
    as traces for SimGrid."""
    if name not in sparse.available() or name == sparse.AUTO or name in sparse.NATIVE:
        names = [n for n in sparse.available() if n != sparse.AUTO and n not in sparse.NATIVE]
        raise ValueError(f"{name!r} is not a sparse schedule; schedules: {', '.join(names)}")
    schedules = [_coalesced(sparse.schedule(name, r, size, numel, topology)) for r in range(size)]
    run = _DryRun(schedules, numel, sparse.policy(name), record=True)
    run.run(name)
    d = _Density(numel, nnz, value_bytes, index_bytes, sparse.policy(name).switch)

    def wire(transfers: list[_Stream]) -> list[tuple[int, float]]:
        return [(peer, d.wire(d.entries(pieces), length)) for peer, length, pieces in transfers]

    return [[(wire(sends), wire(recvs)) for sends, recvs in rank] for rank in run.streams or []]


def choose(
    size: int,
    numel: int,
    nnz: int,
    topology: Topology | None = None,
    value_bytes: int = 4,
    index_bytes: int = 4,
    rates: Rates | None = None,
) -> str:
    """The exact algorithm predicted fastest (ties: the first in ``sparse.exact()``); every
    registered exact schedule takes part. Cached: a gradient's (numel, nnz) repeats each step."""
    rates = rates or calibrated(size)
    args = (size, numel, nnz, topology, value_bytes, index_bytes, rates)
    return _choose(*args, sparse.generation())


@functools.lru_cache(maxsize=1024)
def _choose(
    size: int,
    numel: int,
    nnz: int,
    topology: Topology | None,
    value_bytes: int,
    index_bytes: int,
    rates: Rates,
    generation: int,
) -> str:
    args = (size, numel, nnz, topology, value_bytes, index_bytes, rates)
    names = sparse.exact()
    seconds = [predict(name, *args).seconds for name in names]
    # equal algorithms (dsar and topo_sparse at 2 ranks) tie up to rounding: the first wins
    best = min(seconds) * (1 + 1e-9)
    return next(name for name, t in zip(names, seconds) if t <= best)
