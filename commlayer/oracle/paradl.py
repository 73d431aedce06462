"""ParaDL's own model, quirks included (``commlayer oracle --paradl``).

What ParaDL's ``parallel_analysis.py`` (TruongThaoNguyen/paraDL-analysis, Python 2) computes,
re-derived here from its formulas so that its projections are reproduced from its inputs:
same rows, same numbers. Times are per epoch of N samples, B the global mini-batch, p the GPUs,
W the weights, X and Y the activations per sample (RELU and BNORM left out), 4 bytes an item,
I = ceil(N / B) iterations, (a_p, b_p) the latency and bandwidth ``abci_link`` gives for p GPUs:

- single: B = b, one GPU, T = N * t.
- data: B = b p; mem 2 (b (X + Y) + W) 4; T_comp = ceil(N / p) t;
  T_comm = 2 I (p - 1) (a_p + 4 W / (b_p p)).
- spatial (layers of the mask split in width): per-sample X, Y and t of split layers divided by
  p (all layers counted); halo exchange of every split layer with kernel K > 1 up to the last
  split one, forward and backward, each 2 (a + 4 W_y (K - 1)//2 S / b), where S is the most
  samples that fit in memory (ParaDL uses it, not B); an allgather of the last split layer's
  output, forward and backward; the weight allreduce (over N / B iterations, not rounded up).
- filter and channel (ParaDL's cases 1, B = b p, and 3, B = b): split layers' weights and
  compute divided by p; mem 2 (B (X + Y) + W_f / p) 4 with W_f already divided (ParaDL divides
  twice); T_comm = 3 I (p - 1) (a_p n + 4 B Y_s / (b_p p)), n the split layers and Y_s their
  outputs, the last layer's left out; rows over the GPU memory are dropped.
- pipeline: ParaDL never finished it; no rows.
- data+filter: filter among the P2 GPUs of a node, data across the P1 = p / P2 nodes,
  B = b P1; the data allreduce moves all W (ChainerMNX's limitation) at b_p / (2 P2).
- data+spatial: spatial among a node's P2 GPUs, data across nodes, B = b P1; only the layers up
  to the last split one are counted (compute and memory); halo and allgather inside the node
  without GPUDirect, at b / (2 P2) and b / 2; the allreduce inside the node then across nodes
  at b_p / (2 P2). Needs ``--batch-per-gpu`` (ParaDL prints nothing without it).

The GPU counts are 2, 4, ... up to ``max_gpus`` (P2 up for the hybrids), capped for
spatial by the narrowest split layer, for filter by the fewest filters, for channel by the fewest
channels. Without ``batch_per_gpu``, data (or data+filter) sets it to the largest power of two
that fits in memory, and the strategies after it use that, as in ParaDL.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from commlayer.oracle.row import Row
from commlayer.oracle.spec import Layer, Net, Platform

ITEM_BYTES = 4.0  # float32 values and gradients


@dataclasses.dataclass(frozen=True)
class AbciLinks:
    """ABCI's network as ParaDL hard-codes it (its .plat's BANDWIDTH and LATENCY are not read):
    NVLink inside a node, InfiniBand EDR through two PLX switch hops across nodes, leaf, rack
    and spine latencies by job size (68 GPUs share a leaf switch, 136 a rack)."""

    intra_bw: float = 50e9  # NVLink, B/s
    intra_lat: float = 9e-6  # one NVLink hop end to end
    plx_lat: float = 110e-9  # PLX switch
    plx_cable_lat: float = 20e-6  # GPU to PLX
    plx_cable_lat_host: float = 3e-3  # measured without GPUDirect
    plx_bw: float = 16e9
    inter_bw: float = 12.5e9  # InfiniBand EDR
    leaf_lat: float = 90e-9
    spine_lat: float = 400e-9
    intra_gpus: int = 4  # "rank <= 4" in ParaDL, not the platform's GPU_PER_NODE
    leaf_gpus: int = 68
    rack_gpus: int = 136

    def factor(self, gpus: float, gpudirect: bool = True) -> tuple[float, float]:
        """(bandwidth B/s, latency s) of a ring over ``gpus`` GPUs."""
        hop = 2 * (self.plx_cable_lat + self.plx_lat)
        if gpus <= self.intra_gpus:
            if not gpudirect:
                return self.plx_bw, self.plx_cable_lat_host + self.plx_lat
            return self.intra_bw, self.intra_lat
        bandwidth = min(self.inter_bw, self.intra_bw)
        if gpus <= self.leaf_gpus:
            if not gpudirect:
                return min(self.inter_bw, self.plx_bw), max(
                    2 * self.intra_lat, 2 * hop + self.leaf_lat
                )
            return bandwidth, max(self.intra_lat, hop + self.leaf_lat)
        if gpus <= self.rack_gpus:
            return bandwidth, max(self.intra_lat, hop + 3 * self.leaf_lat)
        return bandwidth, max(self.intra_lat, hop + self.spine_lat + 4 * self.leaf_lat)


@dataclasses.dataclass
class _Setup:
    net: Net
    plat: Platform
    mask: tuple[bool, ...]
    links: AbciLinks
    max_batch: float
    max_gpus: float
    fix: float | None  # ParaDL's FIX_MIRCO_BATCH, set by data / data+filter when None
    comp: list[float]  # seconds per sample per layer
    total_comp: float
    x_items: float
    y_items: float
    w_items: float

    @property
    def n(self) -> float:
        return float(self.net.samples)

    @property
    def items(self) -> float:
        return self.plat.mem_per_gpu_bytes / ITEM_BYTES


def _pow2_upto(limit: float, start: int = 1) -> list[float]:
    """2**start .. the largest power of two <= limit (ParaDL: int(log(limit, 2)))."""
    return [2.0**i for i in range(start, int(math.log(limit, 2)) + 1)] if limit >= 1 else []


def _floor_pow2(value: float) -> float:
    return 2.0 ** int(math.log(value, 2))


def _row(
    setup: _Setup,
    case: str,
    strategy: str,
    b: float,
    p: float,
    mem: float,
    tcomp: float,
    tcomm: float,
    parts: dict[str, float],
) -> Row:
    return Row(
        strategy=strategy,
        B=b,
        p=int(p),
        mem_bytes=mem,
        tcomp_s=tcomp,
        tcomm_s=tcomm,
        iterations=math.ceil(setup.n / b),
        fits=mem <= setup.plat.mem_per_gpu_bytes,
        case=case,
        parts_s=parts,
    )


def _max_samples(setup: _Setup, weights: float, x: float, y: float) -> float:
    return (setup.items / 2 - weights) / (x + y)


def _default_batch(s: _Setup) -> float:
    """The largest power of two of samples that fits beside the weights (at least 1)."""
    return _floor_pow2(max(_max_samples(s, s.w_items, s.x_items, s.y_items), 1.0))


def single(s: _Setup) -> list[Row]:
    most = _max_samples(s, s.w_items, s.x_items, s.y_items)
    if most < 1:
        return []
    b = s.fix if s.fix is not None else _floor_pow2(most)
    mem = 2 * ITEM_BYTES * (b * (s.x_items + s.y_items) + s.w_items)
    return [_row(s, "single", "single", b, 1, mem, s.n * s.total_comp, 0.0, {})]


def data(s: _Setup) -> list[Row]:
    most = _max_samples(s, s.w_items, s.x_items, s.y_items)
    if most < 1:
        return []
    if s.fix is None:
        s.fix = _floor_pow2(most)
    micro, rows = s.fix, []
    for p in _pow2_upto(s.max_gpus):
        b = micro * p
        if b > s.max_batch:
            continue
        mem = 2 * (micro * (s.x_items + s.y_items) + s.w_items) * ITEM_BYTES
        bw, lat = s.links.factor(p)
        ar = 2 * math.ceil(s.n / b) * (p - 1) * (lat + s.w_items * ITEM_BYTES / bw / p)
        tcomp = math.ceil(s.n / p) * s.total_comp
        rows.append(_row(s, "data", "data", b, p, mem, tcomp, ar, {"allreduce": ar}))
    return rows


def _split_sums(s: _Setup, ways: float) -> tuple[float, float, int, float]:
    """(weights, compute per sample, split layers but the last, their outputs) with the
    split layers' weights and compute divided by ``ways``."""
    weights = comp = outputs = 0.0
    count = 0
    for layer, split, t in zip(s.net.layers, s.mask, s.comp):
        if split:
            count += 1
            weights += layer.weight_items / ways
            outputs += layer.out_items
            comp += t / ways
        else:
            weights += layer.weight_items
            comp += t
    if s.mask[-1]:
        outputs -= s.net.layers[-1].out_items
        count -= 1
    return weights, comp, count, outputs


def _model_parallel(s: _Setup, p: float, b: float, case: str, strategy: str) -> Row | None:
    """Filter or channel parallelism over ``p`` GPUs at mini-batch ``b`` (one of ParaDL's
    cases); None when it does not fit (ParaDL prints 'Not enough memory')."""
    weights, comp, count, outputs = _split_sums(s, p)
    mem = 2 * (b * (s.x_items + s.y_items) + weights / p) * ITEM_BYTES
    if mem > s.plat.mem_per_gpu_bytes:
        return None
    iters = math.ceil(s.n / b)
    bw, lat = s.links.factor(p)
    one = iters * (p - 1) * (lat * count + b * outputs * ITEM_BYTES / bw / p)
    # filter: allgather y forward, allreduce dL/dx back; channel the other way round; ParaDL
    # costs both as one allgather and one allreduce of the split layers' outputs
    parts = {"allgather": one, "allreduce": 2 * one}
    return _row(s, case, strategy, b, p, mem, iters * b * comp, 3 * one, parts)


def _filter_or_channel(s: _Setup, strategy: str, short: str, narrowest: float) -> list[Row]:
    counts = _pow2_upto(min(s.max_gpus, narrowest))
    rows: list[Row | None] = []
    fix = s.fix if s.fix is not None else _default_batch(s)  # ParaDL fails without one
    for p in counts:  # case 1: the data-parallel mini-batch
        if fix * p <= s.max_batch:
            rows.append(_model_parallel(s, p, fix * p, f"{short}1", strategy))
    if fix <= s.max_batch:  # case 3: the mini-batch fixed
        rows.extend(_model_parallel(s, p, fix, f"{short}3", strategy) for p in counts)
    return [r for r in rows if r is not None]


def filter_(s: _Setup) -> list[Row]:
    fewest = min((la.y[0] for la, m in zip(s.net.layers, s.mask) if m), default=1e9)
    return _filter_or_channel(s, "filter", "filter", fewest)


def channel(s: _Setup) -> list[Row]:
    fewest = min(
        (la.x[0] for i, (la, m) in enumerate(zip(s.net.layers, s.mask)) if m and i > 0),
        default=1e9,
    )
    return _filter_or_channel(s, "channel", "chan", fewest)


def _last_split(s: _Setup) -> tuple[int, float]:
    """(index of the last split layer, narrowest width among split layers' x and y)."""
    last, narrowest = 0, 1e9
    for i, (layer, split) in enumerate(zip(s.net.layers, s.mask)):
        if split:
            last, narrowest = i, min(narrowest, layer.x[1], layer.y[1])
    return last, narrowest


def _spatial_sums(
    s: _Setup, layers: Sequence[tuple[Layer, bool, float]], ways: float
) -> tuple[float, float, float]:
    x = y = comp = 0.0
    for layer, split, t in layers:
        if split:
            x += math.ceil(layer.in_items / ways)
            y += math.ceil(layer.out_items / ways)
            comp += t / ways
        else:
            x += layer.in_items
            y += layer.out_items
            comp += t
    return x, y, comp


def spatial(s: _Setup) -> list[Row]:
    last, narrowest = _last_split(s)
    layers = list(zip(s.net.layers, s.mask, s.comp))
    rows = []
    for p in _pow2_upto(min(s.max_gpus, narrowest)):
        x, y, comp = _spatial_sums(s, layers, p)
        most = _max_samples(s, s.w_items, x, y)
        if most < 1:
            continue
        b = s.fix if s.fix is not None else _floor_pow2(most)
        if b > s.max_batch:
            continue
        mem = 2 * (b * (x + y) + s.w_items) * ITEM_BYTES
        bw, lat = s.links.factor(p, gpudirect=False)
        halo = 0.0
        for layer, split, _ in layers[: last + 1]:
            k = layer.kernel
            if k > 1 and split:
                for width in (layer.y[1], layer.x[1]):  # activations forward, gradients back
                    halo += 2 * (lat + width * ((k - 1) // 2) * most * ITEM_BYTES / bw)
        iters = math.ceil(s.n / b)
        halo *= iters
        split_out = s.net.layers[last].out_items
        gather = 2 * (p - 1) * (lat + b * split_out * ITEM_BYTES / bw / p) * iters
        ar = 2 * (s.n / b) * (p - 1) * (lat + s.w_items * ITEM_BYTES / bw / p)
        parts = {"halo": halo, "allgather": gather, "allreduce": ar}
        rows.append(_row(s, "spatial", "spatial", b, p, mem, s.n * comp, halo + gather + ar, parts))
    return rows


def data_filter(s: _Setup) -> list[Row]:
    p2 = float(s.plat.gpus_per_node)
    most = _max_samples(s, s.w_items / p2, s.x_items, s.y_items)
    if most < 1:
        return []
    if s.fix is None:
        s.fix = _floor_pow2(most)
    micro, rows = s.fix, []
    weights, comp, count, outputs = _split_sums(s, p2)
    for p in _pow2_upto(s.max_gpus, int(math.log(p2, 2))):
        p1 = p / p2
        b = micro * p1
        if b > s.max_batch:
            continue
        mem = 2 * (micro * (s.x_items + s.y_items) + weights) * ITEM_BYTES
        iters = math.ceil(s.n / b)
        bw, lat = s.links.factor(p2)
        filt = 3 * iters * (p2 - 1) * (lat * count + micro * outputs * ITEM_BYTES / bw / p2)
        bw, lat = s.links.factor(p)
        bw /= 2 * p2  # P2 flows share the node's link, which also crosses a PLX switch twice
        ar = 2 * iters * (p1 - 1) * (lat + s.w_items * ITEM_BYTES / bw / p1)
        parts = {"filter": filt, "allreduce": ar}
        rows.append(_row(s, "df", "data+filter", b, p, mem, iters * micro * comp, filt + ar, parts))
    return rows


def data_spatial(s: _Setup) -> list[Row]:
    if s.fix is None:
        return []  # ParaDL's loop body runs only with a batch per GPU given
    last, _ = _last_split(s)
    p2 = float(s.plat.gpus_per_node)
    layers = list(zip(s.net.layers, s.mask, s.comp))[: last + 1]
    x, y, comp = _spatial_sums(s, layers, p2)
    micro, rows = s.fix, []
    halo_one = 0.0
    bw, lat = s.links.factor(p2, gpudirect=False)
    for layer, split, _ in layers:
        if layer.kernel > 1 and split:
            column = layer.x[0] * ((layer.kernel - 1) // 2) * math.prod(layer.x[2:])
            halo_one += 2 * 2 * (lat + column * micro * ITEM_BYTES / (bw / (2 * p2)))
    split_out = s.net.layers[last].out_items
    gather_one = 2 * (p2 - 1) * (lat + micro * split_out * ITEM_BYTES / (bw / 2) / p2)
    bw_node, lat_node = s.links.factor(p2)
    local_ar = 2 * (p2 - 1) * (lat_node + s.w_items * ITEM_BYTES / bw_node / p2)
    for p in _pow2_upto(s.max_gpus, int(math.log(p2, 2))):
        p1 = p / p2
        b = micro * p1
        if b > s.max_batch or p < p2:
            continue
        mem = 2 * (b * (x + y) / p1 + s.w_items) * ITEM_BYTES
        iters = math.ceil(s.n / b)
        bw_p, lat_p = s.links.factor(p)
        global_ar = 2 * (p1 - 1) * (lat_p + s.w_items * ITEM_BYTES / (bw_p / (2 * p2)) / p1)
        parts = {
            "halo": halo_one * iters,
            "allgather": gather_one * iters,
            "allreduce": (local_ar + global_ar) * iters,
        }
        tcomp = math.ceil(s.n / p1) * comp
        rows.append(_row(s, "ds", "data+spatial", b, p, mem, tcomp, sum(parts.values()), parts))
    return rows


# ParaDL's order: data sets the batch per GPU the later ones use when none is given.
_ANALYSES: tuple[tuple[str, Callable[[_Setup], list[Row]]], ...] = (
    ("single", single),
    ("data", data),
    ("spatial", spatial),
    ("filter", filter_),
    ("channel", channel),
    ("pipeline", lambda s: []),
    ("data+filter", data_filter),
    ("data+spatial", data_spatial),
)


def predict(
    net: Net,
    plat: Platform,
    strategies: Sequence[str],
    mask: Sequence[bool],
    max_gpus: int,
    batch_per_gpu: float | None = None,
    max_batch: float = 256.0,
    links: AbciLinks | None = None,
) -> list[Row]:
    """ParaDL's rows for ``strategies`` (names, see row.STRATEGIES), in ParaDL's order.
    ``max_batch`` defaults to ParaDL's 256."""
    comp = net.layer_times_s(plat.gpu_speed_flops)
    x, y = net.activation_items()
    setup = _Setup(
        net=net,
        plat=plat,
        mask=tuple(mask),
        links=links or AbciLinks(),
        max_batch=float(max_batch),
        max_gpus=float(min(max_gpus, plat.max_gpus)),
        fix=float(batch_per_gpu) if batch_per_gpu is not None else None,
        comp=comp,
        total_comp=sum(comp),
        x_items=float(x),
        y_items=float(y),
        w_items=float(net.total_weight_items()),
    )
    rows: list[Row] = []
    for name, analysis in _ANALYSES:
        if name in strategies:
            rows.extend(analysis(setup))
    return rows
