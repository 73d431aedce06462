"""COMMLAYER_SIM_TABLE as ``auto`` reads it: the simulated allreduce times of the job's machine.

The runtime's own small reader of ``commlayer simulate --format json`` rows (JSON lines with
algorithm, platform, ranks, gpus_per_node, size_bytes, simulated_s), so that the engine never
imports the simulator (DESIGN.md: side systems are not imported by the runtime). For a job of R
ranks on N nodes:

1. the rows at R ranks and R / N GPUs per node are the job's; of several platform specs there,
   the one with the most rows (a table holds one machine: rows of two kinds are refused);
2. per algorithm (registered schedules only), the time at the job's size is the simulated one,
   else interpolated linearly in log(size)-log(time) between the two nearest simulated sizes,
   extrapolated along the two nearest outside them (a bandwidth-bound tail keeps its slope), and
   proportional to the size where one size was simulated;
3. no row at R ranks and R / N GPUs per node: no prediction (``auto`` then uses the calibrated
   model). The simulator's learned corrections for rank counts not simulated (sim/learn.py,
   ``commlayer algorithms --sim-table``) need its platform models: simulate the job's rank count
   to have ``auto`` read it.

``parse_line`` is the one reader of a row's fields; sim/learn.py builds its rows on it.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from commlayer import algorithms
from commlayer.costmodel.model import log_line

REQUIRED = ("algorithm", "platform", "ranks", "size_bytes", "simulated_s")
SMPI_PREFIX = "smpi:"  # SimGrid's own allreduce in a table (sim/simulate.py writes it)


@dataclasses.dataclass(frozen=True)
class Row:
    """One simulated dense allreduce: what ``auto`` reads of a table's line."""

    algorithm: str
    platform: str
    gpus_per_node: int
    ranks: int
    size_bytes: int
    simulated_s: float


def _gpus(spec: str, raw: dict[str, object]) -> int:
    """GPUs per node of a row: its field (simulate writes it), else the spec's, else 1."""
    value = raw.get("gpus_per_node")
    if not value and not spec.partition(":")[0].endswith(".xml"):
        for field in spec.partition(":")[2].split(","):
            key, _, text = field.partition("=")
            if key.strip() == "gpus-per-node":
                value = text.strip()
    return int(value or 1)  # type: ignore[call-overload]


def parse_line(line: str, where: str) -> Row | None:
    """A row from one JSON line (None for a sparse or compressed row, a blank line or SMPI's
    own algorithm); ValueError naming ``where`` and what is wrong."""
    if not line.strip():
        return None
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg}); expected a line of `commlayer "
                         "simulate --format json`") from None  # fmt: skip
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)} (a row of `commlayer simulate "
                         "--format json` has them)")  # fmt: skip
    if (
        raw.get("density") is not None
        or raw.get("compression") is not None
        or str(raw["algorithm"]).startswith(SMPI_PREFIX)
    ):
        return None  # sparse, compressed, or SMPI's own: nothing auto or the dense model uses
    try:
        spec, ranks, size = str(raw["platform"]), int(raw["ranks"]), int(raw["size_bytes"])
        seconds, gpus = float(raw["simulated_s"]), _gpus(spec, raw)
        if min(ranks, size, gpus) < 1 or not 0 < seconds < math.inf:
            raise ValueError("ranks, size_bytes, gpus_per_node and simulated_s must be > 0")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    name = algorithms.canonical(str(raw["algorithm"]).removeprefix("auto="))
    return Row(name, spec, gpus, ranks, size, seconds)


def read(paths: Sequence[Path | str]) -> list[tuple[Row, str]]:
    """Every dense row of the files with its FILE:LINE; ValueError naming the file (and line)
    that cannot be read or parsed, or holds no row."""
    rows: list[tuple[Row, str]] = []
    for path in map(Path, paths):
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
        found = [
            (parse_line(line, f"{path}:{i}"), f"{path}:{i}")
            for i, line in enumerate(text.splitlines(), 1)
        ]
        if not any(row for row, _ in found):
            raise ValueError(f"{path}: no dense row of `commlayer simulate --format json`")
        rows.extend((row, where) for row, where in found if row is not None)
    return rows


def split_paths(text: str) -> list[str]:
    """The files of COMMLAYER_SIM_TABLE: one path, or several separated by ``os.pathsep``."""
    return [p.strip() for p in text.split(os.pathsep) if p.strip()]


def _at(points: Sequence[tuple[int, float]], nbytes: int) -> tuple[float, str]:
    """Seconds at ``nbytes`` from (size, seconds) points sorted by size (module docstring, 2)."""
    for size, seconds in points:
        if size == nbytes:
            return seconds, "simulated"
    if len(points) == 1:
        size, seconds = points[0]
        return seconds * nbytes / size, "scaled"
    inside = [i for i in range(len(points) - 1) if points[i][0] < nbytes < points[i + 1][0]]
    i = inside[0] if inside else (0 if nbytes < points[0][0] else len(points) - 2)
    source = "interpolated" if inside else "extrapolated"
    return log_line(points[i], points[i + 1], nbytes), source


class Times(abc.ABC):
    """What ``auto`` reads of a table (costmodel.model.Simulated): ``_times`` of a subclass
    (this module's ``Table``, sim/learn.py's ``Job``), answered once per job and size."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, int], list[tuple[str, float, str]] | None] = {}

    def times(self, ranks: int, nodes: int, nbytes: int) -> list[tuple[str, float, str]] | None:
        """(algorithm, seconds, source) fastest first for one allreduce of ``nbytes`` on
        ``ranks`` ranks over ``nodes`` equal nodes; None when the table has nothing of that
        job."""
        key = (ranks, nodes, nbytes)
        if key not in self._cache:
            self._cache[key] = self._times(ranks, nodes, nbytes)
        return self._cache[key]

    @abc.abstractmethod
    def _times(
        self, ranks: int, nodes: int, nbytes: int
    ) -> list[tuple[str, float, str]] | None: ...


class Table(Times):
    """A one-machine table as ``auto`` reads it (module docstring)."""

    def __init__(self, rows: Iterable[Row]) -> None:
        super().__init__()
        self.rows = list(rows)
        kinds = sorted({r.platform.partition(":")[0] for r in self.rows})
        if len(kinds) > 1:
            raise ValueError(
                f"rows of {len(kinds)} machines ({', '.join(kinds)}); auto needs the table of "
                'the machine the job runs on (keep its rows: grep \'"platform": "KIND\' FILE '
                "> machine.jsonl)"
            )

    def _times(self, ranks: int, nodes: int, nbytes: int) -> list[tuple[str, float, str]] | None:
        if nodes < 1 or ranks % nodes:
            return None
        mine = [r for r in self.rows if r.ranks == ranks and r.gpus_per_node == ranks // nodes]
        if not mine:
            return None
        counts: dict[str, int] = {}
        for r in mine:
            counts[r.platform] = counts.get(r.platform, 0) + 1
        spec = max(counts, key=lambda s: counts[s])  # the most rows, then the first in order
        known = set(algorithms.schedules())
        points: dict[str, dict[int, float]] = {}
        for r in mine:
            if r.platform == spec and r.algorithm in known:
                points.setdefault(r.algorithm, {})[r.size_bytes] = r.simulated_s  # later wins
        found = [(name, *_at(sorted(p.items()), nbytes)) for name, p in points.items()]
        return sorted(found, key=lambda row: (row[1], row[0])) or None


def load(text: str) -> Table:
    """COMMLAYER_SIM_TABLE's files as ``auto`` reads them; ValueError naming the file."""
    paths = split_paths(text)
    if not paths:
        raise ValueError("no file given")
    return Table(row for row, _ in read(paths))


def to_bytes(table: Table) -> bytes:
    """The table's rows as one payload (the engine makes every rank use rank 0's)."""
    return json.dumps([dataclasses.asdict(r) for r in table.rows], sort_keys=True).encode()


def from_bytes(payload: bytes) -> Table:
    return Table(Row(**raw) for raw in json.loads(payload))
