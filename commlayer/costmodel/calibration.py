"""The stored calibration: what ``commlayer calibrate`` measured, per (ranks, nodes), in a file.

``Calibration`` holds the fitted alpha, beta, gamma and copy rates, the measured curves the
model reads (model.py) and the native algorithms' measured times. ``save`` adds or replaces one
(size, nodes) entry of the JSON file (default: ``calibration.json`` in ``config.cache_dir()``);
``to_bytes``/``from_bytes`` carry them between ranks (the engine makes every rank use rank
0's). A file or entry written by another version reads as absent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commlayer.algorithms.registry import canonical
from commlayer.common import config


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
    # commlayer's engine per collective call besides its transfers (negotiation, the handoff
    # to and from the engine's thread, its cycle): a blocking 4-byte allreduce through the
    # engine less the fastest native one; 0 in calibrations from before it was measured
    op_latency_s: float = 0.0

    @property
    def has_inter(self) -> bool:
        """Whether inter-node transfers were measured (``exchange_inter``); without it the
        model costs every transfer on the one ``exchange`` curve and ``auto`` on several nodes
        keeps ``native``."""
        return bool(self.exchange_inter)


def default_path() -> Path:
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
        # keyed "mpi" before the backend's own allreduce was named "native"
        raw["native"] = {canonical(k): [tuple(p) for p in v] for k, v in raw["native"].items()}
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
