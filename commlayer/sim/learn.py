"""The cost model corrected by simulation: simulated tables turned into predictions.

The cost model (costmodel/model.py, given a platform's links by simulate.calibration) counts
the contention of each node's own link, not the network's: on a torus or a dragonfly
Rabenseifner's far partners share links the model does not know of, and ring's one-hop
neighbours are nearer than the farthest route it charges (benchmarks/results/simulate.md,
section 6). A table of ``commlayer simulate --format json`` rows measures what it misses. For
an (algorithm, platform, ranks, size) a prediction is, in this order:

1. ``simulated``: the table has that very point (same algorithm, same platform spec, fields in
   any order, same ranks, GPUs per node and size): its simulated time.
2. ``learned``: the model's time times a correction learned from the table's rows of the same
   algorithm on the same platform *family* (the kind and every field but the ones that size
   it, GPUs per node included: ``torus:4x4`` and ``torus:8x8x4`` are one family, a fat tree
   with ``oversub=2`` another than without). The correction is the ratio simulated / model,
   recomputed with today's model for every row, read in log space:
   a. at each rank count of the family's rows, interpolated linearly in log(size) between the
      two nearest sizes, held at the nearest one outside the sizes simulated;
   b. across rank counts (this one and those simulated at sizes on both sides of this one, if
      any; else all), linearly in log(ranks) between the two nearest; beyond the largest
      (or below the smallest) extrapolated along the line of the two nearest, for at most the
      distance between them (then held): contention that grew from 64 to 256 ranks is assumed
      to grow as much again up to 1024, not for ever. One rank count: held.
3. ``model``: no row of that algorithm and family: the model alone.

Leave-one-out on the stored tables (benchmarks/results/simulate.md, section 6) says how
close this comes and where the extrapolation in ranks misleads. ``Table.job`` serves
``auto`` (costmodel.choose): the table's predictions for the job's ranks and GPUs per node.
Its cost is the model's, once per size class and algorithm: at 1024 ranks a ring or
hierarchical schedule takes about a second (7 s per size class for the torus table's four
algorithms on the loaded 2-core VM), so a table simulated at the job's sizes is also faster.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from commlayer import algorithms
from commlayer.costmodel import simulated
from commlayer.sim import platforms, simulate
from commlayer.sim.platforms import Platform

SOURCES = ("simulated", "learned", "model")
# The fields that size a platform of each kind (the rest, GPUs per node included, make its
# family): filled from the ranks when a family's spec is rebuilt for another size.
_SHAPE = {
    "flat": {"nodes", "ranks"},
    "fat-tree": {"nodes"},
    "torus": {"shape"},
    "dragonfly": {"groups", "chassis", "routers", "nodes"},
    "dln": {"shape", "switches"},
}
_REBUILT = {"flat": "nodes", "fat-tree": "nodes", "dln": "switches"}  # kinds sized by ranks


@dataclasses.dataclass(frozen=True)
class Row:
    """One simulated point of a table."""

    algorithm: str
    spec: str  # the platform spec, normalized (``canonical``)
    family: str  # the spec less the fields that size it (``family``)
    gpus_per_node: int
    ranks: int
    size_bytes: int
    simulated_s: float
    where: str  # FILE:LINE, for messages


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One predicted time and where it came from (``SOURCES``); ``model_s`` and ``ratio``
    (simulated / model applied) when a model was read."""

    seconds: float
    source: str
    model_s: float | None = None
    ratio: float | None = None


def _fields(spec: str, gpus_per_node: int) -> tuple[str, dict[str, str]]:
    """(kind, fields) of a spec, GPUs per node among the fields; a file's kind is its path."""
    if spec.partition(":")[0].endswith(".xml"):
        return spec.partition(":")[0], {"gpus-per-node": str(gpus_per_node)}
    kind, fields = platforms.parse_spec(spec)
    fields["gpus-per-node"] = str(gpus_per_node)
    return kind, fields


def _join(kind: str, fields: dict[str, str]) -> str:
    return kind + ":" + ",".join(f"{k}={v}" for k, v in sorted(fields.items()))


def canonical(spec: str, gpus_per_node: int) -> str:
    """The spec with its GPUs per node, fields sorted: two ways of writing one platform match."""
    return _join(*_fields(spec, gpus_per_node))


def family(spec: str, gpus_per_node: int) -> str:
    """The spec less the fields that size it (``_SHAPE``): what one correction is learned for."""
    kind, fields = _fields(spec, gpus_per_node)
    shape = _SHAPE.get(kind, set())
    return _join(kind, {k: v for k, v in fields.items() if k not in shape})


def machine(spec: str) -> str:
    """The family less GPUs per node: the machine a table is of."""
    kind, fields = _fields(spec, 1)
    shape = _SHAPE.get(kind, set()) | {"gpus-per-node"}
    return _join(kind, {k: v for k, v in fields.items() if k not in shape}).rstrip(":")


def _row(raw: simulated.Row, where: str) -> Row:
    """The runtime reader's row (costmodel/simulated.py reads the fields) with its platform
    normalized: ValueError naming ``where`` for a spec the platform generator refuses."""
    try:
        spec, gpus = raw.platform, raw.gpus_per_node
        return Row(raw.algorithm, canonical(spec, gpus), family(spec, gpus), gpus, raw.ranks,
                   raw.size_bytes, raw.simulated_s, where)  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_line(line: str, where: str) -> Row | None:
    """A row from one JSON line (None for a sparse row, a blank line or SMPI's own
    algorithm); ValueError naming ``where`` and what is wrong."""
    raw = simulated.parse_line(line, where)
    return None if raw is None else _row(raw, where)


def read(paths: Sequence[Path | str]) -> list[Row]:
    """Every dense row of the files (JSON lines of ``commlayer simulate --format json``);
    ValueError naming the file (and line) that cannot be read or parsed, or holds no row."""
    return [_row(raw, where) for raw, where in simulated.read(paths)]


def _interpolate(points: Sequence[tuple[float, float]], x: float, reach: bool) -> float:
    """y at x, linear between the two nearest points (sorted by x); outside them held at the
    nearest, or with ``reach`` extrapolated along the two nearest for at most their distance."""
    if len(points) == 1:
        return points[0][1]
    if x <= points[0][0] or x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[:2] if x <= points[0][0] else points[-2:]
        if not reach:
            return y0 if x <= points[0][0] else y1
        span = x1 - x0
        x = min(max(x, x0 - span), x1 + span)
        return y0 + (y1 - y0) * (x - x0) / span
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


class Table:
    """Simulated rows, and the predictions they give (module docstring)."""

    def __init__(self, rows: Iterable[Row], extrapolate: bool = True) -> None:
        # a point simulated twice: the later row (files in the order given, lines in order)
        self.points = {(r.algorithm, r.spec, r.ranks, r.size_bytes): r for r in rows}
        self.extrapolate = extrapolate
        self._platforms: dict[tuple[str, int, int], Platform | None] = {}

    @property
    def rows(self) -> list[Row]:
        return list(self.points.values())

    def platform(self, spec: str, ranks: int, gpus_per_node: int) -> Platform | None:
        """The generated platform of a canonical spec (None: a file, whose links are unknown)."""
        key = (spec, ranks, gpus_per_node)
        if key not in self._platforms:
            if _fields(spec, gpus_per_node)[0] not in platforms.KINDS:
                self._platforms[key] = None
            else:
                self._platforms[key] = platforms.generate(spec, ranks, gpus_per_node)
        return self._platforms[key]

    def model(self, algorithm: str, spec: str, ranks: int, gpus: int, size: int) -> float | None:
        return _model_time(self, algorithm, spec, ranks, gpus, size)

    def ratio(
        self,
        algorithm: str,
        family_: str,
        ranks: int,
        size_bytes: int,
        leave_out: frozenset[tuple[str, int, int]] = frozenset(),
    ) -> float | None:
        """The learned simulated / model at (ranks, size) from the rows of ``algorithm`` on
        ``family_`` (None without any), less the (spec, ranks, size) points in ``leave_out``."""
        levels: dict[int, list[tuple[float, float]]] = {}
        for r in self.points.values():
            if r.algorithm != algorithm or r.family != family_:
                continue
            if (r.spec, r.ranks, r.size_bytes) in leave_out:
                continue
            model = self.model(algorithm, r.spec, r.ranks, r.gpus_per_node, r.size_bytes)
            if model:
                point = (math.log2(r.size_bytes), math.log(r.simulated_s / model))
                levels.setdefault(r.ranks, []).append(point)
        if not levels:
            return None
        x = math.log2(size_bytes)
        # this rank count, and those simulated around this size: a count simulated only at
        # other sizes says little here (a 4096-rank DLN point at 1 MiB pulled 1024 x 32 MiB
        # off by 8%)
        covering = [p for p in levels if p == ranks or min(levels[p])[0] <= x <= max(levels[p])[0]]
        by_ranks = [
            (math.log2(p), _interpolate(sorted(levels[p]), x, False))
            for p in sorted(covering or levels)
        ]
        return math.exp(_interpolate(by_ranks, math.log2(ranks), self.extrapolate))

    def predict(
        self,
        algorithm: str,
        spec: str,
        ranks: int,
        gpus_per_node: int,
        size_bytes: int,
        leave_out: frozenset[tuple[str, int, int]] = frozenset(),
    ) -> Prediction | None:
        """``algorithm``'s time on platform ``spec`` (any spelling) at ``ranks`` and
        ``size_bytes`` (module docstring); None: a file platform the table did not simulate."""
        spec = canonical(spec, gpus_per_node)
        hit = self.points.get((algorithm, spec, ranks, size_bytes))
        if hit is not None and (spec, ranks, size_bytes) not in leave_out:
            return Prediction(hit.simulated_s, "simulated")
        model = self.model(algorithm, spec, ranks, gpus_per_node, size_bytes)
        if model is None:
            return None
        ratio = self.ratio(algorithm, family(spec, gpus_per_node), ranks, size_bytes, leave_out)
        if ratio is None:
            return Prediction(model, "model", model)
        return Prediction(model * ratio, "learned", model, ratio)

    def machines(self) -> list[str]:
        """The families of the rows, GPUs per node left out: the machines the table is of."""
        return sorted({machine(r.spec) for r in self.points.values()})

    def job(self) -> Job:
        """The table as ``auto`` reads it (ValueError when it is of several machines)."""
        machines = self.machines()
        if len(machines) != 1:
            raise ValueError(
                f"rows of {len(machines)} machines ({', '.join(machines)}); auto needs the "
                'table of the machine the job runs on (keep its rows: grep \'"platform": '
                "\"KIND' FILE > machine.jsonl)"
            )
        return Job(self)


@functools.lru_cache(maxsize=4096)
def _model_cached(platform: Platform, algorithm: str, size: int) -> float | None:
    return simulate.model_time(algorithm, platform, size)


def _model_time(
    table: Table, algorithm: str, spec: str, ranks: int, gpus: int, size: int
) -> float | None:
    if algorithm not in algorithms.schedules():
        return None  # not registered here (a table written with another version): no model
    platform = table.platform(spec, ranks, gpus)
    return None if platform is None else _model_cached(platform, algorithm, size)


class Job(simulated.Times):
    """A one-machine table as ``auto`` would read it with the simulator's learned corrections:
    the predicted time of every algorithm the table simulated for the job's ranks and GPUs per
    node (None: the table is not of this job: its GPUs per node, or its ranks on a kind that
    cannot be resized)."""

    def __init__(self, table: Table) -> None:
        super().__init__()
        self.table = table
        self._names = sorted({r.algorithm for r in table.rows} & set(algorithms.schedules()))

    def spec(self, ranks: int, gpus_per_node: int) -> str | None:
        """The platform of the job: the spec of the table's rows at its ranks and GPUs per node
        (the most rows, then the first in order), else for a kind sized by its ranks (flat,
        fat tree, DLN) the family's spec at that size; None: not this table's machine."""
        counts: dict[str, int] = {}
        for r in self.table.rows:
            if r.ranks == ranks and r.gpus_per_node == gpus_per_node:
                counts[r.spec] = counts.get(r.spec, 0) + 1
        if counts:
            return max(counts, key=lambda s: counts[s])
        fams = {r.family for r in self.table.rows if r.gpus_per_node == gpus_per_node}
        if len(fams) != 1 or ranks % gpus_per_node:
            return None
        kind, _, rest = next(iter(fams)).partition(":")
        if kind not in _REBUILT:
            return None
        nodes = ranks // gpus_per_node
        if kind == "dln" and nodes & (nodes - 1):
            return None
        return canonical(f"{kind}:{rest},{_REBUILT[kind]}={nodes}", gpus_per_node)

    def _times(self, ranks: int, nodes: int, nbytes: int) -> list[tuple[str, float, str]] | None:
        if nodes < 1 or ranks % nodes:
            return None
        spec = self.spec(ranks, ranks // nodes)
        if spec is None:
            return None
        rows = []
        for name in self._names:
            found = self.table.predict(name, spec, ranks, ranks // nodes, nbytes)
            if found is not None:
                rows.append((name, found.seconds, found.source))
        return sorted(rows, key=lambda r: (r[1], r[0])) or None


def load(text: str) -> Job:
    """COMMLAYER_SIM_TABLE's files as ``auto`` reads them; ValueError naming the file."""
    paths = simulated.split_paths(text)
    if not paths:
        raise ValueError("no file given")
    return Table(read(paths)).job()


def to_bytes(job: Job) -> bytes:
    """The table's rows as one payload (the engine makes every rank use rank 0's)."""
    return json.dumps([dataclasses.asdict(r) for r in job.table.rows], sort_keys=True).encode()


def from_bytes(payload: bytes) -> Job:
    return Table(Row(**raw) for raw in json.loads(payload)).job()
