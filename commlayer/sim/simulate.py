"""One simulated allreduce: an algorithm's schedules replayed on a platform, with the cost
model's prediction beside it.

``simulate(algorithm, platform, size_bytes)`` exports every rank's schedule (export.py),
replays it under smpirun (smpi.py) and returns a ``Result``. ``algorithm`` is a registered
schedule, ``auto`` (the cost model's pick for the platform, see ``calibration``), or
``smpi:NAME``: SMPI's own MPI_Allreduce algorithm NAME (``lr`` ring, ``rdb`` recursive
doubling, ``rab_rdb`` Rabenseifner, ...), to compare our schedules with, or
``hierarchical:INTER``: the two-level schedule (algorithms/hierarchical.py ``two_level``) with
schedule INTER across nodes instead of ring (the research's ``ntt_lr_rab`` is
``hierarchical:rabenseifner``); it is registered only while it is simulated, so the cost model
costs it like any other and ``auto`` elsewhere never sees it.

The cost model is given the platform as a ``Calibration`` (``calibration``): alpha and beta
of a message inside a node and between nodes from the generated links (the farthest pair's
route: its links' latencies summed, its slowest link's bandwidth, per level where the platform
has levels), no reduction cost. It predicts contention only on
each node's own link (costmodel/model.py); what the simulation adds is the network's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from commlayer import algorithms, costmodel
from commlayer.algorithms import hierarchical, sparse
from commlayer.algorithms.schedule import Schedule
from commlayer.common.topology import Topology
from commlayer.costmodel import compressed
from commlayer.costmodel import sparse as sparse_cost
from commlayer.costmodel.simulated import SMPI_PREFIX
from commlayer.sim import export, smpi
from commlayer.sim.platforms import Platform

ELEMENT_SIZE = 4  # float32, as the research's runs
INDEX_SIZE = 4  # int32 indices of a sparse stream, as the executor's
# The cost model reads messages off a curve, log-log between its points: alpha + beta n on
# points 2^(1/8) apart is read within 0.2% (0.6% at 2^(1/4): 16 ranks, 1 MiB ring on flat).
_CURVE = sorted({int(round(2 ** (k / 8))) for k in range(0, 8 * 34)})


@dataclasses.dataclass(frozen=True)
class Result:
    algorithm: str  # as asked ("auto" resolved: "auto=shd")
    platform: str
    ranks: int
    size_bytes: int
    simulated_s: float
    model_s: float | None
    messages: int  # messages replayed (0 for SMPI's own)
    wall_s: float  # export and smpirun, seconds of this machine
    density: float | None = None  # a sparse algorithm's nnz / numel per rank; None: dense
    # ranks per node (the platform's topology; 0 when its nodes hold different numbers):
    # what a table read back (sim/learn.py) needs beside a spec that leaves it to the option
    gpus_per_node: int = 0
    pairwise: bool = False  # a sparse step's streams replayed in rounds (export.pairwise)
    # a compressed reduction (sim/compressed.py): its compressor spec, whether once per host,
    # and the most bytes a host sent to the others
    compression: str | None = None
    per_host: bool | None = None
    cross_bytes: int | None = None

    @property
    def label(self) -> str:
        """The algorithm, with the density for a sparse one (``topo_sparse@0.01``)."""
        return self.algorithm if self.density is None else f"{self.algorithm}@{self.density:.3g}"

    @property
    def busbw_Bps(self) -> float:
        """Bus bandwidth (NCCL's convention): 2 (p - 1) / p bytes over the simulated time."""
        return 2 * (self.ranks - 1) / self.ranks * self.size_bytes / self.simulated_s

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "busbw_Bps": self.busbw_Bps}


def calibration(platform: Platform) -> costmodel.Calibration | None:
    """The platform's links as a cost-model calibration (None for an XML file: its links are
    not known)."""
    links = platform.links
    if links is None:
        return None
    topology = platform.topology()
    inter = [(n, links.inter_alpha_s + links.inter_beta_s_per_byte * n) for n in _CURVE]
    return costmodel.Calibration(
        size=platform.ranks,
        nodes=topology.nodes,
        alpha_s=links.intra_alpha_s if topology.nodes < platform.ranks else links.inter_alpha_s,
        beta_s_per_byte=(
            links.intra_beta_s_per_byte
            if topology.nodes < platform.ranks
            else links.inter_beta_s_per_byte
        ),
        gamma_s_per_byte=0.0,
        copy_s_per_byte=0.0,
        native={},
        exchange=[] if topology.nodes < platform.ranks else inter,
        exchange_inter=inter if topology.nodes > 1 else [],
        host="simulated",
        date="",
    )


def model_time(name: str, platform: Platform, size_bytes: int) -> float | None:
    cal = calibration(platform)
    if cal is None or name.startswith(SMPI_PREFIX):
        return None
    numel = max(size_bytes // ELEMENT_SIZE, 1)
    return costmodel.predict(name, numel, ELEMENT_SIZE, cal, platform.topology())


def resolve(name: str, platform: Platform, size_bytes: int) -> str:
    """``auto``: the schedule the cost model predicts fastest on the platform (ring without a
    model: a file platform); other names checked and returned."""
    if name == algorithms.AUTO:
        cal = calibration(platform)
        if cal is None:
            return "ring"
        rows = costmodel.table(size_bytes, cal, ELEMENT_SIZE, platform.topology())
        return rows[0][0]
    return check(name)


def check(name: str) -> str:
    """``name`` if it is a dense algorithm ``simulate`` runs, else ValueError listing them."""
    family, _, inter = name.partition(":")
    if name == algorithms.AUTO or name in algorithms.schedules():
        return name
    if (name.startswith(SMPI_PREFIX) and inter) or (
        family == "hierarchical" and inter in algorithms.schedules()
    ):
        return name
    raise ValueError(
        f"unknown algorithm {name!r}; allowed: auto, {', '.join(algorithms.schedules())}, "
        "hierarchical:INTER, or smpi:NAME (SMPI's own, e.g. smpi:lr, smpi:rdb, smpi:rab_rdb)"
    )


@contextlib.contextmanager
def _variant(name: str) -> Iterator[None]:
    """``hierarchical:INTER`` registered for the block (nothing to do for other names)."""
    family, _, inter = name.partition(":")
    if family != "hierarchical" or not inter:
        yield
        return

    def build(rank: int, size: int, numel: int, topology: Topology) -> Schedule:
        groups = [topology.members(node) for node in sorted(set(topology.node_of))]
        return hierarchical.two_level(rank, numel, groups, inter)

    with algorithms.registered(name, build):
        yield


def simulate(
    algorithm: str,
    platform: Platform,
    size_bytes: int,
    factors: bool = False,
    gamma_s_per_byte: float = 0.0,
    timeout_s: float | None = None,
) -> Result:
    """Replay ``algorithm`` for a buffer of ``size_bytes`` on ``platform`` (module docstring)."""
    start = time.monotonic()
    name = resolve(algorithm, platform, size_bytes)
    label = f"auto={name}" if algorithm == algorithms.AUTO else name
    numel = max(size_bytes // ELEMENT_SIZE, 1)
    if name.startswith(SMPI_PREFIX):
        cfg = [f"smpi/allreduce:{name[len(SMPI_PREFIX) :]}"]
        args = ["--builtin", str(numel * ELEMENT_SIZE)]
        simulated = smpi.run(platform, args, size_bytes, factors, cfg, timeout_s)
        messages, model = 0, None
    else:
        with _variant(name), tempfile.TemporaryDirectory(prefix="commlayer-traces-") as tmp:
            schedules = export.schedules(name, numel, platform.topology())
            messages = export.write(
                schedules, Path(tmp), ELEMENT_SIZE, gamma_s_per_byte, gamma_s_per_byte
            )
            simulated = smpi.run(platform, [tmp], size_bytes, factors, (), timeout_s)
            model = model_time(name, platform, size_bytes)
    return Result(
        label,
        platform.name,
        platform.ranks,
        numel * ELEMENT_SIZE,
        simulated,
        model,
        messages,
        time.monotonic() - start,
        gpus_per_node=gpus_per_node(platform),
    )


def gpus_per_node(platform: Platform) -> int:
    """Ranks per node of ``platform``, 0 when its nodes hold different numbers of ranks."""
    counts = set(collections.Counter(platform.topology().node_of).values())
    return counts.pop() if len(counts) == 1 else 0


def check_sparse(name: str, density: float) -> None:
    """ValueError naming what is wrong with a sparse algorithm name or density."""
    if name == sparse.AUTO or name not in sparse.available():
        allowed = ", ".join(n for n in sparse.available() if n != sparse.AUTO)
        raise ValueError(f"unknown sparse algorithm {name!r}; allowed: {allowed}")
    if not 0 < density <= 1:
        raise ValueError(f"density {density!r}: must be in (0, 1], e.g. 0.01 for 1%")


def sparse_model_time(name: str, platform: Platform, numel: int, nnz: int) -> float | None:
    """The sparse cost model (costmodel/sparse.py) on the platform's inter-node and
    intra-node alpha and beta, merges free as in the replay (None for an XML file)."""
    links = platform.links
    if links is None:
        return None
    rates = sparse_cost.Rates(
        links.inter_alpha_s,
        links.inter_beta_s_per_byte,
        0.0,
        0.0,
        intra_alpha_s=links.intra_alpha_s,
        intra_beta_s_per_byte=links.intra_beta_s_per_byte,
    )
    topology = platform.topology()
    return sparse_cost.predict(name, platform.ranks, numel, nnz, topology, rates=rates).seconds


def allgather_streams(
    ranks: int, nbytes: int
) -> list[list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]]:
    """Every rank's ``nbytes`` to every rank, as MPI libraries' allgather moves them: recursive
    doubling on a power of two (step k: 2^k lists with the partner r XOR 2^k; SMPI's ``rdb``,
    the sparse cost model's log2 p rounds), a ring otherwise (p - 1 steps of one list)
    (costmodel/compressed.py ``allgather``). A trace rather than SMPI's MPI_Allgather, whose
    receive buffers of p lists per rank are real memory (256 ranks at 10% of 64 MiB: 3.4 GB
    each)."""
    return compressed.allgather(list(range(ranks)), nbytes, ranks)


def simulate_sparse(
    algorithm: str,
    platform: Platform,
    size_bytes: int,
    density: float,
    factors: bool = False,
    timeout_s: float | None = None,
    max_streams: int | None = None,
) -> Result:
    """Replay sparse allreduce ``algorithm`` of a ``size_bytes`` gradient of which every rank
    holds ``density`` (nnz = density x elements, random indices): a schedule's streams with the
    bytes the sparse cost model expects of them (export.write_sparse), or for ``allgather``
    every rank's (index, value) pairs to all (``allgather_streams``). Merging costs nothing.
    ``max_streams``: a step posting more transfers than that is replayed in pairwise rounds
    (export.pairwise; the Result says so); None: every step as posted."""
    check_sparse(algorithm, density)
    start = time.monotonic()
    numel = max(size_bytes // ELEMENT_SIZE, 1)
    nnz = max(round(density * numel), 1)
    if algorithm in sparse.NATIVE:
        streams = allgather_streams(platform.ranks, nnz * (ELEMENT_SIZE + INDEX_SIZE))
    else:
        streams = sparse_cost.streams(algorithm, platform.ranks, numel, nnz, platform.topology())
    cut = False
    if max_streams is not None:
        streams, cut = export.pairwise(streams, max_streams)
    largest = max(b for rank in streams for step in rank for _, b in (*step[0], *step[1]))
    with tempfile.TemporaryDirectory(prefix="commlayer-traces-") as tmp:
        messages = export.write_sparse(streams, Path(tmp))
        simulated = smpi.run(platform, [tmp], math.ceil(largest), factors, (), timeout_s)
    model = sparse_model_time(algorithm, platform, numel, nnz)
    wall = time.monotonic() - start
    return Result(
        algorithm, platform.name, platform.ranks, numel * ELEMENT_SIZE, simulated, model,
        messages, wall, density, gpus_per_node(platform), cut,
    )  # fmt: skip


def alpha_beta(name: str, ranks: int, size_bytes: int, alpha_s: float, beta: float) -> float:
    """The textbook alpha-beta time of ring, recursive doubling and Rabenseifner on ``ranks``
    (a power of two for the last two) with one link per rank and no contention."""
    n, p = size_bytes, ranks
    if name == "ring":
        return 2 * (p - 1) * (alpha_s + n / p * beta)
    if name == "recursive_doubling":
        return math.log2(p) * (alpha_s + n * beta)
    if name == "rabenseifner":
        return 2 * math.log2(p) * alpha_s + 2 * (p - 1) / p * n * beta
    raise ValueError(f"no alpha-beta formula for {name!r}")
