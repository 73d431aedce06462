"""The oracle's inputs: a model (``.net``), a platform (``.plat``) and a layer mask (``.lc``).

The formats are ParaDL's (Kahira, Nguyen et al., HPDC 2021; TruongThaoNguyen/paraDL-analysis),
so its published inputs read unchanged:

- ``.net``: ``Dataset|name``, ``Input|N x C x W x H[x D]``, ``Model|name``, then one layer a line,
  ``NAME|x CxWxH|w CxFxKxK|y FxWxH[|t]``; ``#`` starts a comment line. The layer's type is read
  from its name (CONV, FC, MPOOL, APOOL, RELU, BNORM, ADD, DROPOUT). ``t``: the measured
  forward+backward seconds per sample (ParaDL's ``*_profall`` files put the whole model's on the
  first layer and 0 on the others); a model with no ``t`` at all is costed from FLOPs.
- ``.plat``: ``KEY|value[|unit]`` lines: MEM_PER_NODE (bytes per GPU), NODE_SPEED (FLOP/s),
  BANDWIDTH (B/s), LATENCY (s), MAX_NODE (GPUs), GPU_PER_NODE; commlayer adds the optional
  INTRA_BANDWIDTH and INTRA_LATENCY (inside a node; the inter-node figures when absent) and
  CORES_PER_NODE (the processors a node's ranks share, a CPU node: ranks beyond it slow each
  other's compute; absent, one device per rank as with GPUs).
- ``.lc``: one ``NAME|0|1`` a line per layer (``NAME`` may carry a leading index): whether
  spatial, filter or channel parallelism splits that layer.

ParaDL skips a line it cannot read with a warning; here it is an error naming the file and the
line, and a mask that does not match the model's layers (count or names) is an error too.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from commlayer.common.errors import SpecError

# Layer types, matched as substrings of the name in this order (ParaDL's order: "CONV" wins).
LAYER_TYPES = ("CONV", "MPOOL", "APOOL", "RELU", "FC", "BNORM", "ADD", "DROPOUT")
# Layers whose output overwrites their input in memory (ParaDL leaves them out of |x| and |y|).
IN_PLACE_TYPES = ("RELU", "BNORM")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: its input ``x`` (C, W, H[, D]), weights ``w`` (C, F, K, K[, K]), output ``y``
    (F, W, H[, D]), and ``t_s`` (measured seconds per sample, None when the file has none)."""

    name: str
    x: tuple[int, ...]
    w: tuple[int, ...]
    y: tuple[int, ...]
    t_s: float | None = None
    params: int | None = None  # weights when w's product is not (a torch model's BatchNorm)
    counted_flops: int | None = None  # forward+backward FLOPs counted (a torch model)

    @property
    def kind(self) -> str:
        return next((k for k in LAYER_TYPES if k in self.name.upper()), "OTHER")

    @property
    def in_items(self) -> int:
        return math.prod(self.x)

    @property
    def out_items(self) -> int:
        return math.prod(self.y)

    @property
    def weight_items(self) -> int:
        return self.params if self.params is not None else math.prod(self.w)

    @property
    def kernel(self) -> int:
        """The kernel's width (w[2]): 0 for layers without one."""
        return self.w[2] if len(self.w) > 2 else 0

    def flops(self) -> int:
        """Forward + backward FLOPs per sample, ParaDL's estimate: the forward count (CONV
        2 C F K^2 W H; pooling C F K^2 W H as ParaDL writes it; RELU, ADD |y|; BNORM 4 |x|;
        FC |w|), twice that for the backward pass's input gradient, plus |w| for the weight
        gradient. A torch model's layer has its count (torch.utils.flop_counter) instead."""
        if self.counted_flops is not None:
            return self.counted_flops
        forward = 0
        spatial = self.w[2:]
        out_extent = self.y[1 : 1 + len(spatial)]
        kind = self.kind
        if kind == "CONV":
            forward = 2 * self.w[0] * self.w[1] * math.prod(spatial) * math.prod(out_extent)
        elif kind in ("MPOOL", "APOOL"):
            forward = self.x[0] * self.y[0] * math.prod(spatial) * math.prod(out_extent)
        elif kind in ("RELU", "ADD"):
            forward = self.out_items
        elif kind == "FC":
            forward = self.weight_items
        elif kind == "BNORM":
            forward = 4 * self.in_items
        return 2 * forward + self.weight_items


@dataclasses.dataclass(frozen=True)
class Net:
    """A dataset (``samples`` of shape ``sample``) and a model's layers."""

    dataset: str
    samples: int
    sample: tuple[int, ...]
    model: str
    layers: tuple[Layer, ...]
    path: str = ""

    def total_weight_items(self) -> int:
        return sum(layer.weight_items for layer in self.layers)

    def activation_items(self) -> tuple[int, int]:
        """(sum |x|, sum |y|) over the layers that keep their own buffers (not RELU, BNORM)."""
        kept = [layer for layer in self.layers if layer.kind not in IN_PLACE_TYPES]
        return sum(la.in_items for la in kept), sum(la.out_items for la in kept)

    def layer_times_s(self, node_speed_flops: float, per_layer: bool = False) -> list[float]:
        """Per layer, forward+backward seconds per sample: the file's measured total spread over
        the layers in proportion to their FLOPs (ParaDL's rule; the ``*_profall`` files measure
        only the whole model), else FLOPs / ``node_speed_flops``. ``per_layer`` (commlayer's
        model): where several layers carry a measured time (a per-layer profile) each keeps
        its own, as on a CPU the memory-bound layers are far from their share of FLOPs."""
        flops = [layer.flops() for layer in self.layers]
        measured = [layer.t_s for layer in self.layers]
        if all(t is None for t in measured):
            return [f / node_speed_flops for f in flops]
        if per_layer and sum(1 for t in measured if t) > 1:
            return [t if t is not None else f / node_speed_flops for t, f in zip(measured, flops)]
        # ParaDL's sum: a layer without t counts its FLOPs at node speed (ALEXNET_ImageNet.net)
        total_s = sum(t if t is not None else f / node_speed_flops for t, f in zip(measured, flops))
        return [f * total_s / sum(flops) for f in flops]


@dataclasses.dataclass(frozen=True)
class Platform:
    """A machine: per-GPU memory and speed, the network, and its size."""

    mem_per_gpu_bytes: float
    gpu_speed_flops: float
    bandwidth_bytes_s: float
    latency_s: float
    max_gpus: int
    gpus_per_node: int
    intra_bandwidth_bytes_s: float | None = None
    intra_latency_s: float | None = None
    path: str = ""
    # processors a node's ranks share (a CPU node: its cores); None, one device per rank (GPUs)
    cores_per_node: int | None = None

    def ranks_per_core(self, p: int) -> float:
        """How many of p ranks (node-major) share one processor, at least 1: each rank's
        compute runs that many times slower than in a one-rank profile."""
        if not self.cores_per_node:
            return 1.0
        return max(1.0, min(p, self.gpus_per_node) / self.cores_per_node)


_PLAT_KEYS = {
    "MEM_PER_NODE": "mem_per_gpu_bytes",
    "NODE_SPEED": "gpu_speed_flops",
    "BANDWIDTH": "bandwidth_bytes_s",
    "LATENCY": "latency_s",
    "MAX_NODE": "max_gpus",
    "GPU_PER_NODE": "gpus_per_node",
    "INTRA_BANDWIDTH": "intra_bandwidth_bytes_s",
    "INTRA_LATENCY": "intra_latency_s",
    "CORES_PER_NODE": "cores_per_node",
}
_PLAT_OPTIONAL = ("INTRA_BANDWIDTH", "INTRA_LATENCY", "CORES_PER_NODE")


def _lines(path: str | Path) -> list[tuple[int, str]]:
    """(line number, text without line ending or surrounding blanks) of the non-blank lines."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return [(i, s.strip()) for i, s in enumerate(text.splitlines(), 1) if s.strip()]


def _dims(text: str, where: str, what: str) -> tuple[int, ...]:
    parts = text.strip().lower().split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise SpecError(
            f"{where}: {what} {text.strip()!r} is not integers joined by 'x' (e.g. 3x224x224)"
        ) from None
    if any(d < 0 for d in dims) or len(dims) < 2:
        raise SpecError(f"{where}: {what} {text.strip()!r} needs at least 2 non-negative sizes")
    return dims


def _number(text: str, where: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"{where}: {what} {text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise SpecError(f"{where}: {what} {text.strip()!r} must be finite and >= 0")
    return value


def _header(
    lines: list[tuple[int, str]], index: int, key: str, path: str | Path
) -> tuple[int, str]:
    if len(lines) <= index:
        raise SpecError(
            f"{path}: ends before its {key}|... line (a .net starts with Dataset, "
            "Input, Model lines)"
        )
    number, text = lines[index]
    fields = text.split("|")
    if fields[0].strip().lower() != key.lower() or len(fields) < 2:
        raise SpecError(f"{path}:{number}: expected '{key}|...', got {text!r}")
    return number, fields[1].strip()


def parse_net(path: str | Path) -> Net:
    """Read a ``.net`` file; SpecError naming the file and line for anything malformed."""
    lines = [(n, s) for n, s in _lines(path) if not s.startswith("#")]
    _, dataset = _header(lines, 0, "Dataset", path)
    number, shape = _header(lines, 1, "Input", path)
    dims = _dims(shape, f"{path}:{number}", "Input")
    _, model = _header(lines, 2, "Model", path)
    layers = [_layer(text, f"{path}:{n}") for n, text in lines[3:]]
    if not layers:
        raise SpecError(f"{path}: no layer lines after the Model line")
    return Net(dataset, dims[0], dims[1:], model, tuple(layers), str(path))


def _layer(text: str, where: str) -> Layer:
    fields = text.split("|")
    if len(fields) not in (4, 5):
        raise SpecError(
            f"{where}: a layer line is NAME|x|w|y[|t], 4 or 5 fields; got {len(fields)}: {text!r}"
        )
    name = fields[0].strip()
    if not name:
        raise SpecError(f"{where}: layer without a name: {text!r}")
    x = _dims(fields[1], where, "input x")
    w = _dims(fields[2], where, "weights w")
    y = _dims(fields[3], where, "output y")
    t_s = _number(fields[4], where, "time t") if len(fields) == 5 else None
    if len(w) != len(x) + 1:
        raise SpecError(
            f"{where}: weights {fields[2].strip()!r} need one size more than input "
            f"{fields[1].strip()!r} (C x F x kernel sizes)"
        )
    return Layer(name, x, w, y, t_s)


def parse_plat(path: str | Path) -> Platform:
    """Read a ``.plat`` file (keys in any order, units ignored); SpecError on anything else."""
    values: dict[str, float] = {}
    for number, text in _lines(path):
        fields = text.split("|")
        key = fields[0].strip().upper()
        where = f"{path}:{number}"
        if key not in _PLAT_KEYS:
            raise SpecError(
                f"{where}: unknown key {fields[0].strip()!r}; known: {', '.join(_PLAT_KEYS)}"
            )
        if len(fields) < 2:
            raise SpecError(f"{where}: {key} has no value (KEY|value[|unit])")
        if key in values:
            raise SpecError(f"{where}: {key} given twice")
        values[key] = _number(fields[1], where, key)
    missing = [k for k in _PLAT_KEYS if k not in values and k not in _PLAT_OPTIONAL]
    if missing:
        raise SpecError(f"{path}: missing {', '.join(missing)}")
    for key in ("MEM_PER_NODE", "NODE_SPEED", "BANDWIDTH", "MAX_NODE", "GPU_PER_NODE"):
        if values[key] <= 0:
            raise SpecError(f"{path}: {key} must be > 0, got {values[key]!r}")
    kwargs: dict[str, float | int | str] = {_PLAT_KEYS[k]: v for k, v in values.items()}
    kwargs["max_gpus"] = int(values["MAX_NODE"])
    kwargs["gpus_per_node"] = int(values["GPU_PER_NODE"])
    if "CORES_PER_NODE" in values:
        if values["CORES_PER_NODE"] < 1:
            raise SpecError(
                f"{path}: CORES_PER_NODE must be >= 1, got {values['CORES_PER_NODE']!r}"
            )
        kwargs["cores_per_node"] = int(values["CORES_PER_NODE"])
    return Platform(**kwargs, path=str(path))  # type: ignore[arg-type]


def parse_lc(path: str | Path, net: Net) -> tuple[bool, ...]:
    """Read a layer mask for ``net``: one entry per layer, names matching when given."""
    mask: list[bool] = []
    lines = [(n, s) for n, s in _lines(path) if not s.startswith("#")]
    for number, text in lines:
        where = f"{path}:{number}"
        fields = text.split("|")
        if len(fields) != 2 or fields[1].strip() not in ("0", "1"):
            raise SpecError(f"{where}: a mask line is NAME|0 or NAME|1, got {text!r}")
        index = len(mask)
        label = fields[0].split()
        if index < len(net.layers) and label and label[-1] != net.layers[index].name:
            raise SpecError(
                f"{where}: entry {index} names {label[-1]!r} but layer {index} of "
                f"{net.path or net.model} is {net.layers[index].name!r}"
            )
        mask.append(fields[1].strip() == "1")
    if len(mask) != len(net.layers):
        raise SpecError(
            f"{path}: {len(mask)} entries for {len(net.layers)} layers of {net.path or net.model}"
        )
    return tuple(mask)


def full_mask(net: Net) -> tuple[bool, ...]:
    """Every layer split (ParaDL's default without ``--lc``)."""
    return tuple(True for _ in net.layers)
