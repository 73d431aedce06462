"""commlayer's model of each parallelism strategy: compute, communication, overlap and memory.

ParaDL's model (paradl.py) with what it simplifies made explicit, and commlayer's communication
(network.py). Per iteration, b samples per GPU, t_l a layer's forward+backward seconds per
sample, x_l, y_l, w_l its input, output and weight items, 4 bytes each, p GPUs, P2 a node's:

1. data: B = b p; compute b sum t; the gradients allreduced in fusion buckets as backward
   produces them (last layer first), so all but what is left after backward hides behind it.
2. spatial (the masked layers split along their width among p GPUs, the others replicated):
   B = b; compute b (sum_split t / p + sum_rest t); each split layer with a kernel K > 1
   exchanges a halo of (K - 1) // 2 columns of its input with both neighbours, forward and
   (the input gradient) backward; the last split layer's output is allgathered; only the split
   layers' weight gradients are partial and allreduced (replicated layers compute the same).
3. filter (a split layer's filters divided among p): B = b; its output allgathered forward and
   its input gradient allreduced backward (not for the first layer); weights sharded.
4. channel (a split layer's input channels divided): its partial output allreduced forward,
   its input gradient allgathered backward; weights sharded.
5. pipeline (GPipe: the layers cut into p stages of balanced compute, B = b p cut into
   m micro-batches, by default m = 4 p, GPipe's m >= 4 K for a small bubble): every
   micro-batch forward through the stages, then every one backward, so (m + p - 1) slots of
   the slowest stage (a bubble of (p - 1) / (m + p - 1)), each its compute on B / m samples
   and its boundary's transfers: the activations forward and their gradient backward, one
   point-to-point call each (examples/model_parallel_cnn.py's --strategy pipeline: an alltoall
   in the pair of stages, both blocked while it runs, so it is on the slot's critical path);
   a stage keeps the activations of all B samples (no recomputation).
6. data+filter, data+spatial: filter or spatial among P2 GPUs (a node's, or ``model_ways``,
   consecutive ranks), data across the p / P2 groups, B = b p / P2. data+filter allreduces each
   GPU's weight shard across the groups, the P2 sets' flows sharing the nodes' links (P2 times
   the bytes); data+spatial allreduces all weights over the p GPUs.
7. Ranks sharing processors (a CPU node running more ranks than its ``CORES_PER_NODE``): each
   rank's compute takes ranks / cores times its one-rank profile, and the gradient allreduce
   does not overlap backward: every core already has more runnable compute than it can run,
   so the engine's copies and reductions (CPU work on such a node) add to the step instead of
   filling idle time. At most one rank per core, the model is the GPU one.
Memory per GPU: 2 x 4 bytes x (activations + weights held), values and gradients, activations
of RELU and BNORM layers not counted (they run in place), as in ParaDL; rows above the GPU's
memory are kept with ``fits`` false. An epoch is ceil(N / B) iterations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from commlayer.oracle.network import Network
from commlayer.oracle.row import Row
from commlayer.oracle.spec import IN_PLACE_TYPES, Layer, Net, Platform

ITEM_BYTES = 4
BACKWARD_SHARE = 2 / 3  # backward is two of the three passes' FLOPs (ParaDL's estimate too)
PIPELINE_MICRO_PER_STAGE = 4  # GPipe (Huang et al. 2019): the bubble is small for m >= 4 K


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every strategy reads."""

    net: Net
    plat: Platform
    mask: tuple[bool, ...]
    network: Network
    batch_per_gpu: int
    max_batch: float
    comp_s: tuple[float, ...]  # per layer, forward+backward seconds per sample
    fusion_bytes: int
    overlap: bool
    micro_batches: int | None = None  # pipeline's m; None: 4 p
    model_ways: int | None = None  # the hybrids' P2; None: a node's GPUs

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self.net.layers

    def split(self) -> list[tuple[Layer, float]]:
        return [(la, t) for la, t, m in zip(self.layers, self.comp_s, self.mask) if m]

    def kept(self, layer: Layer) -> bool:
        return layer.kind not in IN_PLACE_TYPES


@dataclasses.dataclass
class Step:
    """One iteration: compute seconds, communication per kind, and the gradient buckets
    (per layer, last first: backward seconds before it is ready and its bytes) to overlap."""

    comp_s: float
    comm_s: dict[str, float]
    mem_bytes: float
    batch: float
    gradient_layers: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    gradient_cost: Callable[[int], float] | None = None  # seconds for one bucket of n bytes


def _activations(s: Setup, ways: float = 1, upto: int | None = None) -> float:
    """Items of x and y per sample held by a GPU, split layers' divided by ``ways``."""
    total = 0.0
    for layer, m in list(zip(s.layers, s.mask))[:upto]:
        if s.kept(layer):
            total += (layer.in_items + layer.out_items) / (ways if m else 1)
    return total


def _weights(s: Setup, ways: float) -> float:
    return sum(la.weight_items / (ways if m else 1) for la, m in zip(s.layers, s.mask))


def _compute(s: Setup, ways: float) -> float:
    return sum(t / (ways if m else 1) for t, m in zip(s.comp_s, s.mask))


def _buckets(s: Setup, b: float, ways: float, only_split: bool = False) -> list[tuple[float, int]]:
    """(backward seconds elapsed when the layer's gradient is ready, its bytes), last layer
    first; a layer whose gradient needs no allreduce brings 0 bytes."""
    out, elapsed = [], 0.0
    for layer, t, m in reversed(list(zip(s.layers, s.comp_s, s.mask))):
        elapsed += BACKWARD_SHARE * b * t / (ways if m else 1)
        carries = m or not only_split
        out.append((elapsed, layer.weight_items * ITEM_BYTES if carries else 0))
    return out


def exposed_gradient_s(
    layers: Sequence[tuple[float, int]],
    cost: Callable[[int], float],
    fusion_bytes: int,
    overlap: bool,
) -> tuple[float, float]:
    """(all gradient communication, the part hidden behind backward): buckets of up to
    ``fusion_bytes`` filled last layer first, each submitted when full (the rest at the end),
    one collective at a time as commlayer's engine runs them: the buckets submitted while one
    is in flight go out together in the next, as one fused collective (the engine fuses what
    is queued at a cycle), so a per-call cost (``op_latency``) is paid once for them; without
    ``overlap`` nothing hides."""
    sends: list[tuple[float, int]] = []
    filled = 0
    for ready_s, nbytes in layers:
        filled += nbytes
        if filled >= fusion_bytes:
            sends.append((ready_s, filled))
            filled = 0
    backward_s = layers[-1][0] if layers else 0.0
    if filled:
        sends.append((backward_s, filled))
    total, end, i = 0.0, 0.0, 0
    while i < len(sends):
        start = max(end, sends[i][0])
        fused = 0
        while i < len(sends) and sends[i][0] <= start:
            fused += sends[i][1]
            i += 1
        seconds = cost(fused)
        total += seconds
        end = start + seconds
    if not overlap:
        return total, 0.0
    return total, total - max(0.0, end - backward_s)


def data(s: Setup, p: int) -> Step | None:
    b = s.batch_per_gpu
    x = _activations(s)
    mem = 2 * ITEM_BYTES * (b * x + s.net.total_weight_items())
    return Step(
        b * _compute(s, 1), {}, mem, b * p, _buckets(s, b, 1), lambda n: s.network.gradient_s(n, p)
    )


def _halo_s(s: Setup, b: float, ways: int, inter: bool) -> float:
    """Both neighbours, forward and backward, of every split layer up to the last one."""
    total = 0.0
    if ways < 2:
        return total
    for layer, _ in s.split():
        rows = (layer.kernel - 1) // 2
        if rows > 0:
            column = layer.x[0] * math.prod(layer.x[2:]) * rows * b * ITEM_BYTES
            # both neighbours forward and back; one collective call (an alltoall) each way
            total += 2 * 2 * s.network.p2p_s(column, ways, inter) + 2 * s.network.op_latency(ways)
    return total


def _last_split(s: Setup) -> int:
    return max(i for i, m in enumerate(s.mask) if m)


def spatial(s: Setup, p: int) -> Step | None:
    if not any(s.mask) or p < 2 or p > min(min(la.x[1], la.y[1]) for la, _ in s.split()):
        return None
    b = s.batch_per_gpu
    inter = s.network.nodes(p) > 1
    gather = s.layers[_last_split(s)].out_items * b * ITEM_BYTES
    comm = {"halo": _halo_s(s, b, p, inter), "allgather": s.network.allgather_s(gather, p)}
    mem = 2 * ITEM_BYTES * (b * _activations(s, p) + s.net.total_weight_items())
    return Step(
        b * _compute(s, p),
        comm,
        mem,
        b,
        _buckets(s, b, p, only_split=True),
        lambda n: s.network.gradient_s(n, p),
    )


def _sharded(
    s: Setup, p: int, b: float, forward: str, nodes: int | None = None
) -> dict[str, float]:
    """Filter (``forward`` allgather) or channel (allreduce) communication of one iteration."""
    comm = {"allgather": 0.0, "allreduce": 0.0}
    backward = "allreduce" if forward == "allgather" else "allgather"
    split = [(i, la) for i, (la, m) in enumerate(zip(s.layers, s.mask)) if m]
    for i, layer in split:
        for kind, items in ((forward, layer.out_items), (backward, layer.in_items if i else 0)):
            nbytes = items * b * ITEM_BYTES
            if kind == "allgather":
                comm[kind] += s.network.allgather_s(nbytes, p, nodes)
            else:
                comm[kind] += s.network.allreduce_s(int(nbytes), p, nodes)
    return comm


def _model_parallel(s: Setup, p: int, forward: str, widest: int) -> Step | None:
    if not any(s.mask) or p < 2 or p > widest:
        return None
    b = s.batch_per_gpu
    mem = 2 * ITEM_BYTES * (b * _activations(s) + _weights(s, p))
    return Step(b * _compute(s, p), _sharded(s, p, b, forward), mem, b)


def filter_(s: Setup, p: int) -> Step | None:
    return _model_parallel(s, p, "allgather", min((la.y[0] for la, _ in s.split()), default=0))


def channel(s: Setup, p: int) -> Step | None:
    # every split layer, the first too (ParaDL leaves it out: 3 RGB channels cannot go to 8)
    return _model_parallel(s, p, "allreduce", min((la.x[0] for la, _ in s.split()), default=0))


def stages(comp_s: Sequence[float], count: int) -> list[tuple[int, int]] | None:
    """Contiguous [first, last) layer ranges, ``count`` of them, minimizing the slowest stage's
    compute (binary search on it, greedy packing); None if there are fewer layers."""
    if count > len(comp_s):
        return None

    def pack(limit: float) -> list[tuple[int, int]] | None:
        cuts: list[tuple[int, int]] = []
        start, acc = 0, 0.0
        for i, t in enumerate(comp_s):
            left = len(comp_s) - i  # layers still to place, each stage needs one
            if i > start and (acc + t > limit or left < count - len(cuts)):
                cuts.append((start, i))
                start, acc = i, 0.0
            acc += t
        cuts.append((start, len(comp_s)))
        return cuts if len(cuts) == count else None

    low, high = max(comp_s), sum(comp_s)
    best = pack(high * 2) if count == 1 else None
    for _ in range(60):
        mid = (low + high) / 2
        got = pack(mid)
        if got is not None and max(sum(comp_s[a:b]) for a, b in got) <= mid * (1 + 1e-12):
            best, high = got, mid
        else:
            low = mid
    return best or pack(sum(comp_s))


def pipeline(s: Setup, p: int) -> Step | None:
    parts = stages(s.comp_s, p)
    if parts is None or p < 2:
        return None
    batch = s.batch_per_gpu * p  # b samples per GPU on average, as data parallelism
    micro = min(s.micro_batches or PIPELINE_MICRO_PER_STAGE * p, batch)
    b = batch / micro  # samples per micro-batch
    slot, boundary, mem = 0.0, 0.0, 0.0
    for k, (first, last) in enumerate(parts):
        layers = s.layers[first:last]
        send = 0.0
        if k < p - 1:  # activations forward, their gradient backward
            inter = (k + 1) % s.plat.gpus_per_node == 0
            send = 2 * (
                s.network.p2p_s(layers[-1].out_items * b * ITEM_BYTES, p, inter)
                + s.network.op_latency(p)
            )
        comp = b * sum(s.comp_s[first:last])
        if comp + send > slot:
            slot, boundary = comp + send, send
        held = sum(la.in_items + la.out_items for la in layers if s.kept(la))
        weights = sum(la.weight_items for la in layers)
        mem = max(mem, 2 * ITEM_BYTES * (batch * held + weights))
    slots = micro + p - 1
    return Step((slot - boundary) * slots, {"p2p": boundary * slots}, mem, batch)


def _groups(s: Setup, p: int) -> tuple[int, int, int]:
    """(P2, P1, the nodes a data set spans): groups of P2 consecutive ranks, node-major."""
    p2 = s.model_ways or s.plat.gpus_per_node
    p1 = p // p2
    return p2, p1, min(p1, s.network.nodes(p))


def data_filter(s: Setup, p: int) -> Step | None:
    p2, p1, nodes = _groups(s, p)
    if p < p2 or p % p2 or not any(s.mask) or p2 > min(la.y[0] for la, _ in s.split()):
        return None
    b = s.batch_per_gpu
    comm = _sharded(s, p2, b, "allgather", nodes=1)
    mem = 2 * ITEM_BYTES * (b * _activations(s) + _weights(s, p2))
    # Each of a node's P2 GPUs allreduces its shard across nodes at once, the P2 flows sharing
    # the node's link (costmodel's contention: P2 times the bytes): as one allreduce of the
    # node's whole gradient (the shards add up to each layer's weights) over P1 nodes.
    return Step(
        b * _compute(s, p2),
        comm,
        mem,
        b * p1,
        _buckets(s, b, p2),
        lambda n: s.network.gradient_s(n, p1, nodes),
    )


def data_spatial(s: Setup, p: int) -> Step | None:
    p2, p1, _ = _groups(s, p)
    if p < p2 or p % p2 or not any(s.mask):
        return None
    if p2 > min(min(la.x[1], la.y[1]) for la, _ in s.split()):
        return None
    b = s.batch_per_gpu
    gather = s.layers[_last_split(s)].out_items * b * ITEM_BYTES
    comm = {"halo": _halo_s(s, b, p2, False), "allgather": s.network.allgather_s(gather, p2, 1)}
    mem = 2 * ITEM_BYTES * (b * _activations(s, p2) + s.net.total_weight_items())
    return Step(
        b * _compute(s, p2),
        comm,
        mem,
        b * p1,
        _buckets(s, b, p2),
        lambda n: s.network.gradient_s(n, p),
    )


STRATEGY_STEPS = {
    "data": data,
    "spatial": spatial,
    "filter": filter_,
    "channel": channel,
    "pipeline": pipeline,
    "data+filter": data_filter,
    "data+spatial": data_spatial,
}


def row(s: Setup, strategy: str, p: int) -> Row | None:
    """The epoch of ``strategy`` on p GPUs, or None where it does not apply."""
    shared = s.plat.ranks_per_core(p)
    if shared > 1:  # ranks share processors: slower compute, and no core left to overlap on
        s = dataclasses.replace(s, comp_s=tuple(t * shared for t in s.comp_s), overlap=False)
    step = STRATEGY_STEPS[strategy](s, p)
    if step is None or (s.max_batch and step.batch > s.max_batch):
        return None
    parts = {kind: seconds for kind, seconds in step.comm_s.items() if seconds > 0}
    hidden = 0.0
    if step.gradient_layers and step.gradient_cost is not None:
        total, hidden = exposed_gradient_s(
            step.gradient_layers, step.gradient_cost, s.fusion_bytes, s.overlap
        )
        if total > 0:
            parts["gradient allreduce"] = total
    iterations = math.ceil(s.net.samples / step.batch)
    return Row(
        strategy=strategy,
        B=step.batch,
        p=p,
        mem_bytes=step.mem_bytes,
        tcomp_s=step.comp_s * iterations,
        tcomm_s=sum(parts.values()) * iterations,
        iterations=iterations,
        fits=step.mem_bytes <= s.plat.mem_per_gpu_bytes,
        case=strategy,
        hidden_s=hidden * iterations,
        parts_s={k: v * iterations for k, v in parts.items()},
    )
