"""Where the ranks are: the node of each rank, and optionally a 2D torus shape.

Detected from MPI (a node is a shared-memory communicator, ``Backend.nodes()``), or given for
tests and simulation with ``COMMLAYER_TOPOLOGY``: ``nodes=2,local=2`` (node-major: rank r is on
node r // local), optionally ``torus=RxC`` (the grid torus2d uses; R*C ranks, row-major). So
multi-node logic runs, and is tested, on one machine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

_PART = re.compile(r"^\s*(nodes|local|torus)\s*=\s*(\d+(?:\s*x\s*\d+)?)\s*$")


@dataclass(frozen=True)
class Topology:
    node_of: tuple[int, ...]  # node index of every rank, first appearance order 0, 1, ...
    torus: tuple[int, int] | None = None  # rows, columns

    @classmethod
    def flat(cls, size: int) -> Topology:
        return cls((0,) * size)

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def members(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        counts = {self.node_of.count(n) for n in set(self.node_of)}
        return len(counts) == 1

    def windows_fit(self, detected: Sequence[int]) -> bool:
        """A shared-memory window per node can serve this layout: every node holds the same
        number of ranks (a chunk's slices match across nodes) and lies within one ``detected``
        node, a real machine (an override may split machines, not join them)."""
        return (
            len(detected) == self.size
            and self.uniform()
            and len(set(zip(self.node_of, detected))) == self.nodes
        )

    def grid(self) -> tuple[int, int]:
        """(rows, columns) for torus2d: the given torus, else one row per node when nodes are
        uniform and more than one, else the most square factorization of the size."""
        if self.torus is not None:
            return self.torus
        if self.nodes > 1 and self.uniform():
            return self.nodes, self.size // self.nodes
        rows = max(d for d in range(1, math.isqrt(self.size) + 1) if self.size % d == 0)
        return rows, self.size // rows

    def positions(self) -> list[int]:
        """Ranks ordered node by node (then by rank): neighbours in this order share a node."""
        return sorted(range(self.size), key=lambda r: (self.node_of[r], r))


def parse(text: str) -> dict[str, object]:
    """The fields of a COMMLAYER_TOPOLOGY value (syntax only; sizes are checked by ``build``)."""
    fields: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _PART.match(part)
        if not match or match.group(1) in fields:
            raise ValueError(part)
        key, value = match.group(1), match.group(2).replace(" ", "")
        if key == "torus":
            if "x" not in value:
                raise ValueError(part)
            rows, cols = (int(v) for v in value.split("x"))
            if rows < 1 or cols < 1:
                raise ValueError(part)
            fields[key] = (rows, cols)
        else:
            if "x" in value or int(value) < 1:
                raise ValueError(part)
            fields[key] = int(value)
    if not fields:
        raise ValueError(text)
    return fields


def build(text: str, size: int, detected: list[int]) -> Topology:
    """The job's topology: ``detected`` node indices, overridden by a COMMLAYER_TOPOLOGY
    value. ValueError when the value does not fit ``size`` ranks."""
    if not text:
        return Topology(tuple(detected))
    fields = parse(text)
    node_of = tuple(detected)
    if "nodes" in fields or "local" in fields:
        nodes = fields.get("nodes")
        local = fields.get("local")
        if nodes is None:
            assert isinstance(local, int)
            nodes = size // local
        if local is None:
            assert isinstance(nodes, int)
            local = size // nodes
        assert isinstance(nodes, int) and isinstance(local, int)
        if nodes * local != size:
            raise ValueError(f"nodes={nodes} x local={local} is not the job's {size} ranks")
        node_of = tuple(r // local for r in range(size))
    torus = fields.get("torus")
    if torus is not None:
        assert isinstance(torus, tuple)
        if torus[0] * torus[1] != size:
            raise ValueError(f"torus={torus[0]}x{torus[1]} is not the job's {size} ranks")
    return Topology(node_of, torus)  # type: ignore[arg-type]
