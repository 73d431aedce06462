"""Cost model of the sparse allreduce algorithms; it decides ``auto``.

alpha-beta-gamma per step as for the dense schedules (costmodel.py), with the bytes a step
moves predicted from the density: with every rank holding ``nnz`` of ``numel`` indices at
random, the sum of m ranks' vectors holds u(m) = numel (1 - (1 - nnz/numel)^m) indices (the
fill-in). A stream of e entries over a range of L elements costs e (index + value bytes), or
L value bytes once the algorithm switches to dense and that is smaller. The local work is
costed by what the executor does: a reducing step merges the rank's own entries of the range
with each received stream (``merge_s_per_pair`` per pair, own + received), the allgather merges
the p lists one after another (or scatter-adds them into a dense buffer once they would be
larger sparse, ``scatter_s_per_entry``), a copying step only moves bytes. alpha and beta come
from the dense calibration when one exists (``commlayer calibrate``), else from the defaults
below (measured on the 2-core development machine: ~60 us per executor step, ~3 GB/s point
to point between two ranks); the merge and scatter rates from ``commlayer calibrate`` too
(:func:`calibrate_local`, saved beside the dense calibration), else the defaults (numba,
measured by benchmarks/kernels.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from commlayer import kernels
from commlayer.algorithms import sparse
from commlayer.algorithms.topology import Topology
from commlayer.costmodel import Calibration


@dataclass(frozen=True)
class Rates:
    alpha_s: float = 60e-6
    beta_s_per_byte: float = 1 / 3e9
    merge_s_per_pair: float = 1 / 150e6  # numba merge, 1%+1% of 4M: ~150 M pairs/s (own + in)
    scatter_s_per_entry: float = 1 / 300e6

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
    from commlayer import costmodel

    return Rates.of(costmodel.load(size, 1))


def local_path() -> Path:
    from commlayer import config

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


class _Model:
    def __init__(self, numel: int, nnz: int, value_bytes: int, index_bytes: int, r: Rates):
        self.n, self.d = numel, min(nnz / max(numel, 1), 1.0)
        self.nnz, self.vb, self.pair, self.r = nnz, value_bytes, value_bytes + index_bytes, r
        self.seconds = 0.0
        self.sent = 0.0

    def union(self, m: float) -> float:
        return self.n * (1 - (1 - self.d) ** m)

    def wire(self, entries: float, length: float, switch: bool) -> float:
        sparse_bytes = entries * self.pair
        return min(sparse_bytes, length * self.vb) if switch else sparse_bytes

    def step(self, sent: float, merged_pairs: float = 0.0) -> None:
        """One exchange of ``sent`` bytes each way, then a merge of ``merged_pairs``."""
        r = self.r
        self.seconds += r.alpha_s + r.beta_s_per_byte * sent + r.merge_s_per_pair * merged_pairs
        self.sent += sent

    def merged(self, own: float, received: float, length: float, switch: bool) -> float:
        """Pairs a reducing step merges (none once a switching stream is dense: an add)."""
        dense = switch and (own + received) * self.pair >= length * self.vb
        return 0.0 if dense else own + received


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
    """Predicted time and bytes sent per rank of sparse algorithm ``name`` (not auto)."""
    if name == sparse.AUTO or name not in sparse.available():
        raise ValueError(f"no cost model for sparse algorithm {name!r}")
    m = _Model(numel, nnz, value_bytes, index_bytes, rates or calibrated(size))
    p, n = size, numel
    if p == 1:
        return Prediction(0.0, 0.0)
    levels = int(math.log2(p))
    folded = p != 1 << levels
    switch = sparse.policy(name).switch
    if name == "allgather":
        if p * nnz * m.pair >= n * m.vb:  # summed by a scatter-add into a dense buffer
            m.step((p - 1) * nnz * m.pair)
            m.seconds += m.r.scatter_s_per_entry * p * nnz
        else:  # merged one list after another
            m.step((p - 1) * nnz * m.pair, sum(m.union(j) + nnz for j in range(1, p)))
        m.seconds += (math.ceil(math.log2(p)) - 1) * m.r.alpha_s
    elif name in ("ssar_recursive_doubling", "gtopk"):
        if folded:
            m.step(m.wire(nnz, n, switch), m.merged(nnz, nnz, n, switch))
        for s in range(levels):
            kept = nnz if name == "gtopk" else m.union((2**s) * (1 + folded))
            m.step(m.wire(kept, n, switch), m.merged(kept, kept, n, switch))
            if name == "gtopk":  # torch.topk of the merged vector: ~ a merge pass or two
                m.seconds += 2 * m.r.merge_s_per_pair * 2 * kept
        if folded:
            m.step(m.wire(nnz if name == "gtopk" else m.union(p), n, switch))
    elif name in ("ssar_split_allgather", "dsar"):
        merged = sum(m.merged(m.union(j) / p, nnz / p, n / p, switch) for j in range(1, p))
        m.step((p - 1) * m.wire(nnz / p, n / p, switch), merged)
        m.step((p - 1) * m.wire(m.union(p) / p, n / p, switch))
    elif name == "topo_sparse":
        topology = topology or Topology.flat(p)
        big = topology.uniform() and topology.nodes > 1
        groups, g = (topology.nodes, p // topology.nodes) if big else (1, p)
        for s in range(1, g):  # ring reduce-scatter in the node
            own = m.union(s) / g
            m.step(m.wire(own, n / g, switch), m.merged(own, nnz / g, n / g, switch))
        for s in range(1, groups):  # ring allreduce of one block across nodes
            part, length = m.union(g * s) / (g * groups), n / (g * groups)
            m.step(m.wire(part, length, switch), m.merged(part, part, length, switch))
        for _ in range(1, groups):
            m.step(m.wire(m.union(p) / (g * groups), n / (g * groups), switch))
        for _ in range(1, g):  # ring allgather in the node
            m.step(m.wire(m.union(p) / g, n / g, switch))
    else:
        raise ValueError(f"no cost model for sparse algorithm {name!r}")  # a new, unmodelled one
    return Prediction(m.seconds, m.sent)


def choose(
    size: int,
    numel: int,
    nnz: int,
    topology: Topology | None = None,
    value_bytes: int = 4,
    index_bytes: int = 4,
    rates: Rates | None = None,
) -> str:
    """The exact algorithm predicted fastest (ties: the first in ``sparse.exact()``)."""
    best = min(
        sparse.exact(),
        key=lambda name: (
            predict(name, size, numel, nnz, topology, value_bytes, index_bytes, rates).seconds
        ),
    )
    return best
