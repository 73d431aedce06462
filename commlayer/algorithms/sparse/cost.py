"""Cost model of the sparse allreduce algorithms; it decides ``auto``.

alpha-beta-gamma per step as for the dense schedules (costmodel.py), with the bytes a step
moves predicted from the density: with every rank holding ``nnz`` of ``numel`` indices at
random, the sum of m ranks' vectors holds u(m) = numel (1 - (1 - nnz/numel)^m) indices (the
fill-in). A stream of e entries over a range of L elements costs e (index + value bytes), or
L value bytes once the algorithm switches to dense and that is smaller. gamma is the local
merge/scatter-add cost per byte received. alpha and beta come from the dense calibration when
one exists (``commlayer calibrate``), else from the defaults below (measured on the 2-core
development machine: ~60 us per executor step, ~3 GB/s point to point between two ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commlayer.algorithms import sparse
from commlayer.algorithms.topology import Topology
from commlayer.costmodel import Calibration


@dataclass(frozen=True)
class Rates:
    alpha_s: float = 60e-6
    beta_s_per_byte: float = 1 / 3e9
    gamma_s_per_byte: float = 1 / 1e9  # numba merge: ~120 M (index, value) pairs/s

    @classmethod
    def of(cls, cal: Calibration | None) -> Rates:
        if cal is None:
            return cls()
        return cls(cal.alpha_s, cal.beta_s_per_byte)


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

    def step(self, sent: float, received: float | None = None) -> None:
        received = sent if received is None else received
        r = self.r
        self.seconds += r.alpha_s + r.beta_s_per_byte * max(sent, received)
        self.seconds += r.gamma_s_per_byte * received
        self.sent += sent


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
    m = _Model(numel, nnz, value_bytes, index_bytes, rates or Rates())
    p, n = size, numel
    if p == 1:
        return Prediction(0.0, 0.0)
    levels = int(math.log2(p))
    folded = p != 1 << levels
    switch = sparse.policy(name).switch
    if name == "allgather":
        m.step((p - 1) * nnz * m.pair)
        m.seconds += (math.ceil(math.log2(p)) - 1) * m.r.alpha_s
    elif name in ("ssar_recursive_doubling", "gtopk"):
        if folded:
            m.step(m.wire(nnz, n, switch))
        for s in range(levels):
            kept = nnz if name == "gtopk" else m.union((2**s) * (1 + folded))
            m.step(m.wire(kept, n, switch))
        if folded:
            m.step(m.wire(nnz if name == "gtopk" else m.union(p), n, switch))
    elif name in ("ssar_split_allgather", "dsar"):
        m.step((p - 1) * m.wire(nnz / p, n / p, switch))
        m.step((p - 1) * m.wire(m.union(p) / p, n / p, switch))
    elif name == "topo_sparse":
        topology = topology or Topology.flat(p)
        big = topology.uniform() and topology.nodes > 1
        groups, g = (topology.nodes, p // topology.nodes) if big else (1, p)
        for s in range(1, g):  # ring reduce-scatter in the node
            m.step(m.wire(m.union(s) / g, n / g, switch))
        for s in range(1, groups):  # ring allreduce of one block across nodes
            m.step(m.wire(m.union(g * s) / (g * groups), n / (g * groups), switch))
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
