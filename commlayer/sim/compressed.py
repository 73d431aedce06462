"""``commlayer simulate --compression``: one bucket's compressed reduction replayed, flat against
once per host (issue 51).

The phases costmodel/compressed.py plans (flat: every rank's payload among all ranks; per
host: the bucket's sum inside each node, the payload among one leader a node, the share inside
the node) are written as traces (export.write_sparse: every transfer with its bytes, a rank's
phases one after the other) and replayed under smpirun. Beside the simulated time: the cost
model's (costmodel/compressed.py ``seconds`` on the platform's links) and the most bytes a node
sends to the others. Local work (the sums, compressing, decoding) costs nothing here, as in the
dense replay without ``--reduce-GBps``: what the table compares is what crosses the network.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from commlayer import compression
from commlayer.costmodel import compressed
from commlayer.sim import export, smpi
from commlayer.sim.platforms import Platform
from commlayer.sim.simulate import ELEMENT_SIZE, Result, calibration, gpus_per_node

HIERARCHIES = ("flat", "host")


def check(spec: str) -> str:
    """``spec`` if it names a compressor whose payload's size is declared, else ValueError."""
    try:
        compressed.payload(spec, 1 << 10)
    except ValueError as exc:
        allowed = ", ".join(n for n in compression.available() if n not in ("auto", "none"))
        raise ValueError(f"--compression {spec!r}: {exc}; e.g. one of {allowed}") from None
    return spec


def label(spec: str, per_host: bool) -> str:
    return f"{spec} {'per host' if per_host else 'flat'}"


def simulate_compressed(
    spec: str,
    platform: Platform,
    size_bytes: int,
    per_host: bool,
    factors: bool = False,
    timeout_s: float | None = None,
) -> Result:
    """Replay one bucket of ``size_bytes`` reduced under ``spec`` on ``platform`` (module
    docstring); ``per_host`` where the platform's nodes hold several ranks."""
    start = time.monotonic()
    numel = max(size_bytes // ELEMENT_SIZE, 1)
    topology = platform.topology()
    cal = calibration(platform)
    plan = compressed.plan(spec, numel, topology, cal, per_host)
    streams = plan.streams()
    largest = max((b for rank in streams for step in rank for _, b in step[0]), default=4)
    with tempfile.TemporaryDirectory(prefix="commlayer-traces-") as tmp:
        messages = export.write_sparse(streams, Path(tmp))
        simulated = smpi.run(platform, [tmp], math.ceil(largest), factors, (), timeout_s)
    model = None if cal is None else compressed.seconds(plan, cal, topology)
    return Result(
        label(spec, plan.per_host), platform.name, platform.ranks, numel * ELEMENT_SIZE,
        simulated, model, messages, time.monotonic() - start,
        gpus_per_node=gpus_per_node(platform), compression=spec, per_host=plan.per_host,
        cross_bytes=compressed.cross_bytes(plan, topology),
    )  # fmt: skip
