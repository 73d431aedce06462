"""The oracle: which parallelism strategy for which model and machine (``commlayer oracle``).

ParaDL's model (Kahira, Nguyen et al., HPDC 2021, "An Oracle for Guiding Large-Scale
Model/Hybrid Parallel Training of Convolutional Neural Networks") reproduced (paradl.py, rows
and numbers as its script gives them), and commlayer's own (model.py): the same strategies
plus pipeline, communication from commlayer's cost model and algorithms (network.py), and the
gradient allreduce overlapped with backward. Inputs in ParaDL's formats (spec.py) or any torch
model (torchmodel.py); rows out (row.py), printed, as JSON or plotted (report.py).

    from commlayer import oracle
    rows = oracle.predict(oracle.parse_net("resnet50.net"), oracle.parse_plat("abci.plat"),
                          strategies="d,f,ds", gpus=oracle.gpu_counts("1-1024"),
                          batch_per_gpu=64)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from commlayer.costmodel import Calibration
from commlayer.oracle import model, paradl
from commlayer.oracle.network import Compression, Network
from commlayer.oracle.row import STRATEGIES, Row, strategy_names
from commlayer.oracle.spec import (
    Layer,
    Net,
    Platform,
    full_mask,
    parse_lc,
    parse_net,
    parse_plat,
)

# DistributedOptimizer's default bucket (COMMLAYER_MIN_BUCKET_BYTES): backward's gradients go
# out in buckets of at least this many bytes, each as soon as it is full
FUSION_BYTES = 1 << 20
PARADL_MAX_BATCH = 256  # ParaDL's --cmaxB when not given


def gpu_counts(text: str) -> list[int]:
    """``--gpus``: ``A-B``, the powers of two from A to B (ParaDL's ``--cmaxp``); ``a,b,c``,
    those counts; ``n``, n alone."""
    try:
        if "-" in text:
            low, high = (int(v) for v in text.split("-", 1))
            if low < 1 or high < low:
                raise ValueError
            return [2**i for i in range(0, high.bit_length()) if low <= 2**i <= high]
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--gpus {text!r}: give A-B (powers of two between) or a list like 1,2,4"
        ) from None
    if any(c < 1 for c in counts):
        raise ValueError(f"--gpus {text!r}: counts must be >= 1")
    return counts


def default_batch_per_gpu(net: Net, plat: Platform) -> int:
    """The largest power of two of samples whose activations fit beside the weights (values and
    gradients) on one GPU, at least 1: ParaDL's default."""
    x, y = net.activation_items()
    most = (plat.mem_per_gpu_bytes / 4 / 2 - net.total_weight_items()) / (x + y)
    return 2 ** int(math.log2(most)) if most >= 1 else 1


def predict(
    net: Net,
    plat: Platform,
    strategies: str | Sequence[str] = "all",
    gpus: Sequence[int] = (1, 2, 4, 8),
    batch_per_gpu: int | None = None,
    max_batch: float | None = None,
    mask: Sequence[bool] | None = None,
    calibrations: list[Calibration] | None = None,
    algorithm: str = "auto",
    compression: str | None = None,
    paradl_model: bool = False,
    overlap: bool = True,
    fusion_bytes: int = FUSION_BYTES,
    op_latency_s: float | None = None,
) -> list[Row]:
    """Rows for every (strategy, GPU count) that applies. ``paradl_model``: ParaDL's own model
    (its GPU counts are 2, 4, ... up to max(gpus); ``max_batch`` defaults to its 256), which
    ignores ``calibrations``, ``algorithm``, ``compression``, ``overlap`` and
    ``op_latency_s`` (commlayer's engine: seconds per collective call besides its transfers;
    None: each calibration's own measurement, 0 without one)."""
    names = strategy_names(strategies) if isinstance(strategies, str) else list(strategies)
    if paradl_model and isinstance(strategies, str) and {"a", "all"} & set(strategies.split(",")):
        names.insert(0, "single")  # ParaDL's ``a`` includes ``o``
    unknown = [n for n in names if n not in STRATEGIES.values()]
    if unknown:
        raise ValueError(f"unknown strategies {unknown!r}; allowed {list(STRATEGIES.values())}")
    mask = tuple(mask) if mask is not None else full_mask(net)
    if paradl_model:
        return paradl.predict(
            net,
            plat,
            names,
            mask,
            max(gpus),
            batch_per_gpu,
            PARADL_MAX_BATCH if max_batch is None else max_batch,
        )
    network = Network(plat, calibrations, algorithm, Compression.parse(compression), op_latency_s)
    setup = model.Setup(
        net=net,
        plat=plat,
        mask=mask,
        network=network,
        batch_per_gpu=batch_per_gpu or default_batch_per_gpu(net, plat),
        max_batch=max_batch or 0.0,
        comp_s=tuple(net.layer_times_s(plat.gpu_speed_flops, per_layer=True)),
        fusion_bytes=fusion_bytes,
        overlap=overlap,
    )
    rows = []
    for name in names:
        for p in gpus:
            if p > plat.max_gpus:
                continue
            if name == "single":
                got = model.row(setup, "data", 1) if p == 1 else None
                got = got and Row(**{**got.__dict__, "strategy": "single", "case": "single"})
            else:
                got = model.row(setup, name, p)
            if got is not None:
                rows.append(got)
    return rows


__all__ = [
    "STRATEGIES",
    "Compression",
    "Layer",
    "Net",
    "Network",
    "Platform",
    "Row",
    "default_batch_per_gpu",
    "full_mask",
    "gpu_counts",
    "parse_lc",
    "parse_net",
    "parse_plat",
    "predict",
    "strategy_names",
]
