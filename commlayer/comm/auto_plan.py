"""``compression="auto"`` and COMMLAYER_COMPRESSION_HIERARCHY=auto at the bucket plan: the
measuring and deciding DistributedOptimizer's plan needs (compression/auto.py says how a
choice is made; this module gathers its facts and applies its answers).

When the optimizer plans its buckets (after the first complete step, a collective), where a
bucket's compressor is auto or its level is: every rank times the links (``measure_links``:
blocking allreduces over the communicator's transport and, with per-host levels, inside this
rank's host and among the first leaders), rank 0 decides each such bucket's compressor and
whether it is compressed per host (``decide``, logged by compression/auto.py and kept in
``decisions``; COMMLAYER_COMPRESSION_HIERARCHY=auto's for compressors given outright in
``hierarchy_decisions``), and its decisions travel with the plan; every rank then makes a
bucket's compressor from them (``resolve``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from commlayer.comm import hierarchy
from commlayer.comm.communicator import Transport, measure_cpu
from commlayer.comm.hierarchy import HostLevels
from commlayer.common.errors import CommlayerError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import CompressorBase, Policy
from commlayer.compression import auto as auto_compression
from commlayer.compression.auto import AutoCompressor, Hosts, Link
from commlayer.core import runtime
from commlayer.core.process_sets import ProcessSet

_log = logging.getLogger("commlayer")

Param = torch.nn.Parameter
# rank 0's decision for a bucket: (spec, compressed per host); None for a bucket not decided
Decisions = list[tuple[str, bool] | None]


class AutoPlanner:
    """One optimizer's auto decisions: its ``policy``, its ``process_set``, its choice of a
    compressor for a parameter (``choose``) and of a compressor's level (``level``:
    comm/hierarchy.py's mode, flat where the optimizer has no per-host levels)."""

    __slots__ = ("policy", "process_set", "choose", "level", "hierarchy_decisions")

    def __init__(
        self,
        policy: Policy,
        process_set: ProcessSet,
        choose: Callable[[Param], CompressorBase],
        level: Callable[[CompressorBase], str],
    ) -> None:
        self.policy = policy
        self.process_set = process_set
        self.choose = choose
        self.level = level
        # COMMLAYER_COMPRESSION_HIERARCHY=auto's decisions for compressors given outright
        self.hierarchy_decisions: list[dict[str, Any]] = []

    def autos(self) -> list[AutoCompressor]:
        """The policy's ``compression="auto"`` compressors (none without auto)."""
        return [c for c in self.policy.compressors().values() if isinstance(c, AutoCompressor)]

    def decided(self, compressor: CompressorBase) -> bool:
        """Whether rank 0 decides at the plan for buckets of ``compressor``: auto, or its level
        is auto."""
        return isinstance(compressor, AutoCompressor) or self.level(compressor) == hierarchy.AUTO

    def measure_links(
        self, transport: Transport, levels: HostLevels | None, prefix: str
    ) -> tuple[Link, Hosts | None]:
        """The process set's link (over ``transport``) and, with per-host ``levels``, the links
        inside this rank's host and among the first leaders (compression/auto.py 1. and 4.):
        collectives, each rank in the sets it belongs to, named after ``prefix``. Hosts is
        None on a rank that is not in both (rank 0 is, unless alone on its host: its decisions
        are then flat)."""
        link = self.measure_link(transport, f"{prefix}.auto_link")
        if levels is None:
            return link, None
        intra = (
            None
            if levels.intra is None
            else self.measure_link(levels.intra, f"{prefix}.auto_link.host")
        )
        across = None
        if levels.local_index == 0 and levels.across is not None:
            across = self.measure_link(levels.across, f"{prefix}.auto_link.across")
        if intra is None or across is None:
            return link, None
        return link, Hosts(intra, across, levels.layout.leaders)

    @staticmethod
    def measure_link(transport: Transport, prefix: str) -> Link:
        """The engine's allreduce time over ``transport``'s ranks, ``alpha + beta B``, from the
        fastest of a few blocking allreduces at two sizes (every rank of it: a collective)."""
        points = []
        for nbytes in auto_compression.LINK_SIZES:
            buffer = torch.zeros(nbytes // 4)
            best = math.inf
            for repeat in range(auto_compression.LINK_REPEATS):
                start = time.perf_counter()
                name = f"{prefix}.{nbytes}.{repeat}"
                transport.allreduce_([buffer], name, ReduceOp.Sum, 1.0, 1.0).wait()
                best = min(best, time.perf_counter() - start)
            points.append((nbytes, best))
        return Link.fit(points, transport.size)

    def decide(self, buckets: list[list[Param]], link: Link, hosts: Hosts | None) -> Decisions:
        """Rank 0: (spec, compressed per host) for each bucket it decides (``decided``; the
        spec empty for a compressor given outright), None for the others."""
        size = self.process_set.size()
        out: Decisions = [None] * len(buckets)
        groups: dict[CompressorBase, list[int]] = {}
        for index, params in enumerate(buckets):
            chosen = self.choose(params[0])
            if self.decided(chosen):
                groups.setdefault(chosen, []).append(index)
        for chosen, indices in groups.items():
            grads = [
                [p.grad if p.grad is not None and not p.grad.is_sparse else torch.zeros_like(p)
                 for p in buckets[i]]
                for i in indices
            ]  # fmt: skip
            picks: list[tuple[str, bool]]
            if isinstance(chosen, AutoCompressor):
                level = self.level(chosen)
                used = self.calibrated_link(link) if chosen.link == "calibration" else link
                labels = auto_compression.plan(
                    chosen, grads, used, size, measure_cpu,
                    None if level == hierarchy.FLAT else hosts, flat=level != hierarchy.HOST,
                )  # fmt: skip
                picks = [auto_compression.split(label) for label in labels]
            elif hosts is None:  # no host links measured here: flat
                picks = [("", False)] * len(indices)
            else:
                flags = auto_compression.plan_levels(
                    chosen, grads, link, size, measure_cpu, hosts, self.hierarchy_decisions
                )
                picks = [("", flag) for flag in flags]
            for i, pick in zip(indices, picks):
                out[i] = pick
        return out

    def resolve(
        self, index: int, compressor: CompressorBase, decisions: Decisions | None, root: int
    ) -> tuple[CompressorBase, bool]:
        """Bucket ``index``'s compressor and whether it is compressed per host, from rank
        ``root``'s ``decisions`` (a bucket of ``compressor``, which ``decided``)."""
        decided = decisions[index] if decisions is not None else None
        if decided is None:
            raise CommlayerError(
                f"rank {runtime.rank()}: bucket {index} is decided by rank {root} "
                "(compression='auto' or COMMLAYER_COMPRESSION_HIERARCHY=auto here), which "
                "sent no decision for it: every rank must pass the same compression and "
                "settings"
            )
        spec, per_host = decided
        if isinstance(compressor, AutoCompressor):
            compressor = compressor.compressor(spec, runtime.rank())
        return compressor, per_host

    def calibrated_link(self, measured: Link) -> Link:
        """``auto:link=calibration``: the stored calibration for these ranks and nodes, else
        the measured link (logged)."""
        from commlayer import costmodel

        set_id = self.process_set.process_set_id
        assert set_id is not None  # a set the optimizer reduces over is registered
        nodes = runtime.engine().topology(set_id).nodes
        cal = costmodel.load(self.process_set.size(), nodes)
        if cal is None or (nodes > 1 and not cal.has_inter):
            _log.info(
                "commlayer: compression auto:link=calibration: no calibration for %d ranks on "
                "%d node(s) (run `commlayer calibrate`); using the link measured now",
                self.process_set.size(), nodes,
            )  # fmt: skip
            return measured
        from commlayer.costmodel import compressed

        return compressed.link(cal)
