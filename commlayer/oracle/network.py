"""The oracle's network: collective times from commlayer's own cost model (costmodel/).

An allreduce is costed by ``costmodel.predict``: the algorithm's schedule, step by step, on a
node-major topology of p GPUs with ``gpus_per_node`` a node, the contention of ranks sharing a
node's link included. The curves it reads come from

1. a measured calibration for exactly this (ranks, nodes), when ``--calibration`` has one: its
   own curves, and its measured native algorithms (``native``, ``shm``) as candidates too;
2. else a calibration's curves carried to p ranks (the largest one in the file: its exchange
   curves inside and across nodes, its local reduce and copy rates, its overlap);
3. else the platform file: alpha + n beta inside a node (INTRA_LATENCY, INTRA_BANDWIDTH, the
   inter-node figures when absent) and across nodes (LATENCY, BANDWIDTH); no local work (a
   .plat gives no reduction rate).

``algorithm``: a registered schedule (ring, tree, hierarchical, rabenseifner, ...) or ``auto``,
the lowest predicted time as ``auto`` picks (``costmodel.choose``, native algorithms only where
measured). Compression changes the bytes on the wire, as the compressor declares them
(compression/base.py): a summable payload (fp16 and bf16: half the bytes; random-k: k values)
is allreduced, any other (top-k: k (value, int32 index) pairs; QSGD; signs) allgathered from
every rank.
Allgather and point-to-point transfers (halo, pipeline stages) read the same curves: an
allgather is a ring's p - 1 steps of n / p bytes, across nodes as soon as p GPUs span several.
Each collective call also costs ``op_latency(p)``, the engine's own work per operation
(negotiation, the handoff to its thread): the calibration's ``op_latency_s`` (``commlayer
calibrate`` measures it through the engine; 0 in a platform file and in calibrations from
before it), unless ``op_latency_s`` is given.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import cast

from commlayer import algorithms, compression, costmodel
from commlayer.common.topology import Topology
from commlayer.compression.base import WIRE_BYTES, CompressorBase, WireBytes, lookup
from commlayer.compression.factory import split_spec
from commlayer.costmodel import Calibration
from commlayer.oracle.spec import Platform

# Affine curves as costmodel reads them: one point per power of two up to 64 GiB, so its
# log-log interpolation of alpha + n beta stays within 0.4% of the line.
_CURVE_SIZES = [2**i for i in range(0, 37)]


def _affine(alpha_s: float, beta_s_per_byte: float) -> list[tuple[int, float]]:
    return [(n, alpha_s + beta_s_per_byte * n) for n in _CURVE_SIZES]


@dataclasses.dataclass(frozen=True)
class Compression:
    """What a compressor puts on the wire for float32 gradients, as it declares
    (compression/base.py): read once by ``parse``, from the compressor ``create`` makes."""

    spec: str = "none"
    summable: bool = True
    element_bytes: int = 4  # of a summable payload: what its allreduce reduces
    # bytes one rank sends for (numel, element bytes); None: the gradient as it is
    wire_bytes: Callable[[int, int], int] | None = None

    @classmethod
    def parse(cls, text: str | None) -> Compression:
        """A compressor spec (``fp16``, ``topk:ratio=0.01``, ...) whose compressor declares
        ``wire_bytes`` and is given its ``wire_parameters`` (no ratio assumed)."""
        if not text:
            return cls()
        spec = text.strip()
        try:
            name, params = split_spec(spec)
            compressor = compression.create(spec)
        except ValueError as exc:
            raise ValueError(f"compression {text!r}: {exc}") from None
        if compressor.identity:
            return cls(spec)
        if WIRE_BYTES not in compressor.capabilities:
            modelled = [n for n in compression.available() if _costed(n)]
            raise ValueError(
                f"compression {text!r}: the oracle models compressors whose payload's size "
                f"follows from the element count (wire_bytes): {', '.join(modelled)}"
            )
        # the parameters' values, for the example: the compressor's (error feedback's inner's)
        made = compressor.inner if isinstance(compressor, compression.ErrorFeedback) else compressor
        for key in compressor.wire_parameters:
            if key not in params:
                example = f"{name}:{key}={vars(made).get(key)}"
                raise ValueError(f"compression {text!r}: give its {key}, e.g. {example}")
        wire_dtype = compressor.wire_dtype
        element_bytes = wire_dtype.itemsize if wire_dtype is not None else 4
        wire_bytes = cast(WireBytes, compressor).wire_bytes
        return cls(spec, compressor.summable, element_bytes, wire_bytes)

    def sent_bytes(self, nbytes: int) -> int:
        """Bytes one rank sends for ``nbytes`` of float32 gradients."""
        if self.wire_bytes is None:
            return nbytes
        return self.wire_bytes(nbytes // 4, 4)


def _costed(name: str) -> bool:
    """Whether the compressor registered as ``name`` declares its payload's size (or is the
    identity)."""
    factory = lookup(name)
    if not (isinstance(factory, type) and issubclass(factory, CompressorBase)):
        return False  # a compressor with the minimum only declares no size
    return WIRE_BYTES in factory.capabilities or factory.identity


class Network:
    """Collective times for p GPUs of ``plat``, from ``calibrations`` where given."""

    def __init__(
        self,
        plat: Platform,
        calibrations: list[Calibration] | None = None,
        algorithm: str = "auto",
        compression: Compression | None = None,
        op_latency_s: float | None = None,
    ) -> None:
        if algorithm != "auto" and algorithm not in algorithms.schedules():
            raise ValueError(
                f"algorithm {algorithm!r}: allowed auto, {', '.join(algorithms.schedules())}"
            )
        self.plat = plat
        self.gpus_per_node = plat.gpus_per_node
        self.calibrations = list(calibrations or [])
        self.algorithm = algorithm
        self.compression = compression or Compression()
        # what one collective call costs on the engine besides its transfers (negotiation, the
        # engine thread's handoff): given, or None to read it from the calibration (op_latency)
        self.op_latency_s = op_latency_s
        # the cost model is pure, and an epoch asks for the same few sizes many times
        self.allreduce_s = functools.lru_cache(maxsize=4096)(self._allreduce_s)  # type: ignore[method-assign]

    def nodes(self, p: int) -> int:
        return max(1, math.ceil(p / self.gpus_per_node))

    def calibration(self, p: int, nodes: int | None = None) -> Calibration:
        """The calibration costing p ranks on ``nodes`` (node-major) nodes: see the module."""
        nodes = nodes or self.nodes(p)
        for cal in self.calibrations:
            if cal.size == p and cal.nodes == nodes:
                return cal
        if self.calibrations:
            base = max(self.calibrations, key=lambda c: (c.has_inter, c.size))
            inter = base.exchange_inter or base.exchange
            return dataclasses.replace(
                base, size=p, nodes=nodes, native={}, exchange_inter=inter if nodes > 1 else []
            )
        plat = self.plat
        intra_lat = plat.intra_latency_s if plat.intra_latency_s is not None else plat.latency_s
        intra_bw = plat.intra_bandwidth_bytes_s or plat.bandwidth_bytes_s
        return Calibration(
            size=p,
            nodes=nodes,
            alpha_s=intra_lat,
            beta_s_per_byte=1 / intra_bw,
            gamma_s_per_byte=0.0,
            copy_s_per_byte=0.0,
            native={},
            exchange=_affine(intra_lat, 1 / intra_bw),
            exchange_inter=_affine(plat.latency_s, 1 / plat.bandwidth_bytes_s) if nodes > 1 else [],
            host=plat.path,
            date="platform file",
        )

    def op_latency(self, p: int) -> float:
        """The engine's seconds per collective call over p ranks: as given, else the
        calibration's measurement (``Calibration.op_latency_s``; 0 from a platform file)."""
        if self.op_latency_s is not None:
            return self.op_latency_s
        return self.calibration(p).op_latency_s if p > 1 else 0.0

    def topology(self, p: int, nodes: int | None = None) -> Topology:
        per_node = math.ceil(p / (nodes or self.nodes(p)))
        return Topology(tuple(r // per_node for r in range(p)))

    def _allreduce_s(
        self, nbytes: int, p: int, nodes: int | None = None, element_bytes: int = 4
    ) -> float:
        """One allreduce of ``nbytes`` over p ranks on ``nodes`` nodes (node-major)."""
        if p <= 1 or nbytes <= 0:
            return 0.0
        nodes = nodes or self.nodes(p)
        cal = self.calibration(p, nodes)
        topo = self.topology(p, nodes)
        numel = max(nbytes // element_bytes, 1)
        name = self.algorithm
        if name == "auto":
            name = costmodel.choose(numel, element_bytes, p, nodes, cal, topo)
        seconds = costmodel.predict(name, numel, element_bytes, cal, topo)
        if seconds is None:  # a native ``auto`` chose, not measured at this size
            name = min(
                algorithms.schedules(),
                key=lambda n: costmodel.predict(n, numel, element_bytes, cal, topo) or 0,
            )
            seconds = costmodel.predict(name, numel, element_bytes, cal, topo)
        return float(seconds or 0.0) + self.op_latency(p)

    def gradient_s(self, nbytes: int, p: int, nodes: int | None = None) -> float:
        """The allreduce of ``nbytes`` of float32 gradients, compressed as configured."""
        if p <= 1 or nbytes <= 0:
            return 0.0
        comp = self.compression
        sent = comp.sent_bytes(nbytes)
        if comp.summable:
            return self.allreduce_s(sent, p, nodes, comp.element_bytes)
        return self.allgather_s(p * sent, p, nodes)

    def message_s(self, nbytes: float, p: int, inter: bool) -> float:
        """One message each way between partners (every rank at once)."""
        cal = self.calibration(p)
        return costmodel.message_time(int(max(nbytes, 1)), cal, inter and cal.has_inter)

    def allgather_s(self, total_bytes: float, p: int, nodes: int | None = None) -> float:
        """Ring allgather of ``total_bytes`` (each rank brings total / p): p - 1 steps."""
        if p <= 1 or total_bytes <= 0:
            return 0.0
        inter = (nodes or self.nodes(p)) > 1
        return (p - 1) * self.message_s(total_bytes / p, p, inter) + self.op_latency(p)

    def p2p_s(self, nbytes: float, p: int, inter: bool) -> float:
        """One message each way (its collective call's ``op_latency`` not included)."""
        return self.message_s(nbytes, p, inter) if nbytes > 0 else 0.0

    def describe(self) -> str:
        source = (
            "platform file"
            if not self.calibrations
            else "calibration "
            + ", ".join(
                f"{c.size} ranks/{c.nodes} node(s) ({c.host} {c.date})" for c in self.calibrations
            )
        )
        return (
            f"allreduce {self.algorithm}, compression {self.compression.spec}"
            f", network from {source}"
        )
