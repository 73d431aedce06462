"""One prediction: a strategy at a global batch and GPU count, and what it costs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# ParaDL's letters and commlayer's names for the strategies; ``single`` is ParaDL's ``o``.
STRATEGIES = {
    "o": "single",
    "d": "data",
    "s": "spatial",
    "f": "filter",
    "c": "channel",
    "p": "pipeline",
    "df": "data+filter",
    "ds": "data+spatial",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """Per GPU: memory, and per epoch: compute, communication (all of it; ``hidden_s`` of it
    runs behind the backward pass) and time. ``B`` is the global mini-batch, ``p`` the GPUs.
    ``case``: ParaDL's name of the row (``filter1``, ``chan3``, ...) or the strategy's.
    ``parts_s``: the communication per kind (allreduce, allgather, halo, ...), per epoch."""

    strategy: str
    B: float
    p: int
    mem_bytes: float
    tcomp_s: float
    tcomm_s: float
    iterations: float
    fits: bool
    case: str = ""
    hidden_s: float = 0.0
    parts_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def time_s(self) -> float:
        """Seconds per epoch: compute plus the communication not hidden behind it."""
        return self.tcomp_s + self.tcomm_s - self.hidden_s

    @property
    def iter_s(self) -> float:
        return self.time_s / self.iterations if self.iterations else 0.0

    @property
    def cost_gpu_min(self) -> float:
        """GPU-minutes per epoch, as ParaDL bills them: p x the epoch rounded up to minutes."""
        return self.p * math.ceil(self.time_s / 60)

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "case": self.case or self.strategy,
            "B": self.B,
            "p": self.p,
            "mem_bytes": self.mem_bytes,
            "fits": self.fits,
            "tcomp_s": self.tcomp_s,
            "tcomm_s": self.tcomm_s,
            "hidden_s": self.hidden_s,
            "time_s": self.time_s,
            "iterations": self.iterations,
            "iter_s": self.iter_s,
            "cost_gpu_min": self.cost_gpu_min,
            "parts_s": dict(self.parts_s),
        }


def strategy_names(text: str) -> list[str]:
    """``--strategy``: ParaDL letters or names, comma-separated, or ``all`` (every strategy but
    ``single``); ValueError naming the unknown one."""
    names = list(STRATEGIES.values())
    chosen: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part in ("all", "a"):
            chosen.extend(n for n in names if n != "single")
        elif part in STRATEGIES:
            chosen.append(STRATEGIES[part])
        elif part in names:
            chosen.append(part)
        else:
            allowed = ", ".join([*STRATEGIES, *names, "all"])
            raise ValueError(f"unknown strategy {part!r}; allowed: {allowed}")
    return list(dict.fromkeys(chosen))
