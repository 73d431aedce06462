"""Any torch model as the oracle's ``Net``: shapes from the meta device, FLOPs counted by torch.

``describe("torchvision.models:resnet50", "3x224x224", 1281167)`` builds the model on the meta
device (no weights allocated, no data), runs one sample forward under
``torch.utils.flop_counter.FlopCounterMode`` and records, per leaf module in call order, its
input and output shapes, its parameters and its FLOPs. A layer's forward+backward FLOPs are 3x
its forward ones (the backward pass computes the input and the weight gradients, each about a
forward's work; ParaDL's estimate is the same 2x + |w|). Functional operations outside modules
(a residual ``+``, ``torch.flatten``) are not layers: their activations are not counted.
Layer names carry ParaDL's type words (CONV, FC, BNORM, RELU, MPOOL, APOOL, DROPOUT) so the
strategies treat them as they treat a .net's layers.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from commlayer.common.errors import SpecError
from commlayer.oracle.spec import Layer, Net

_KINDS = (
    ("Conv", "CONV"),
    ("Linear", "FC"),
    ("BatchNorm", "BNORM"),
    ("ReLU", "RELU"),
    ("MaxPool", "MPOOL"),
    ("AvgPool", "APOOL"),
    ("Dropout", "DROPOUT"),
)


def _load(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SpecError(f"--model {spec!r}: give module:callable, e.g. torchvision.models:resnet50")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # a module failing on import (e.g. a torchvision
        # built for another torch) is the user's input problem: name it, no traceback
        raise SpecError(f"--model {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(factory):
        raise SpecError(f"--model {spec!r}: {attr!r} is not callable")
    return factory


def _dims(shape: Any) -> tuple[int, ...]:
    """(C, W, H[, D]) from a tensor shape (1, C, H, W[, D]); (F, 1, 1) from (1, F)."""
    rest = [int(d) for d in shape[1:]]
    if len(rest) == 1:
        return (rest[0], 1, 1)
    if len(rest) >= 3:
        rest[1], rest[2] = rest[2], rest[1]
    return tuple(rest) if len(rest) >= 2 else (1, 1)


def _weights(module: Any, x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
    """ParaDL's (C, F, K, K[, K]): kernels for convolutions and pooling, 1s for Linear."""
    spatial = len(x) - 1
    kernel = getattr(module, "kernel_size", None)
    if kernel is not None:
        sizes = kernel if isinstance(kernel, tuple) else (kernel,) * spatial
        weight = getattr(module, "weight", None)
        if weight is not None:
            return (int(weight.shape[1]), int(weight.shape[0]), *(int(k) for k in sizes))
        return (0, 0, *(int(k) for k in sizes))
    return (x[0], y[0], *(1 if type(module).__name__ == "Linear" else 0,) * spatial)


def describe(spec: str, input_shape: str, dataset_size: int) -> Net:
    """The ``Net`` of the model ``spec`` (module:callable) for one sample of ``input_shape``."""
    return describe_model(_load(spec), input_shape, dataset_size, spec)


def describe_model(factory: Any, input_shape: str, dataset_size: int, label: str = "") -> Net:
    """The ``Net`` of the model ``factory()`` builds, for one sample of ``input_shape``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    try:
        sample = tuple(int(d) for d in input_shape.lower().split("x"))
    except ValueError:
        raise SpecError(f"--input {input_shape!r}: sizes joined by x, e.g. 3x224x224") from None
    if dataset_size < 1:
        raise SpecError(f"--dataset-size {dataset_size!r} must be >= 1")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # the user's callable: name it, no traceback
        raise SpecError(
            f"--model {label!r}: building it failed: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(model, "named_modules"):
        raise SpecError(f"--model {label!r}: built a {type(model).__name__}, not a torch module")
    leaves = [(name, m) for name, m in model.named_modules() if not list(m.children())]
    calls: list[tuple[str, Any, tuple[int, ...], tuple[int, ...]]] = []

    def hook(name: str) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            if inputs and hasattr(inputs[0], "shape") and hasattr(output, "shape"):
                calls.append((name, module, _dims(inputs[0].shape), _dims(output.shape)))

        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in leaves]
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            dtype = next((p.dtype for p in model.parameters()), torch.float32)
            model(torch.empty((1, *sample), device="meta", dtype=dtype))
    except Exception as exc:  # most often an --input the model cannot take
        raise SpecError(
            f"--model {label!r} on --input {input_shape!r}: forward failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    per_module = counter.get_flop_counts()
    layers = []
    for name, module, x, y in calls:
        kind = next((k for cls, k in _KINDS if cls in type(module).__name__), "")
        flops = sum(per_module.get(f"{type(model).__name__}.{name}", {}).values()) if name else 0
        params = sum(math.prod(p.shape) for p in module.parameters(recurse=False))
        layers.append(
            Layer(
                name=f"{kind}_{name}" if kind else name,
                x=x,
                w=_weights(module, x, y),
                y=y,
                params=int(params),
                counted_flops=3 * int(flops),
            )
        )
    if not layers:
        raise SpecError(f"--model {label!r}: no leaf module ran on the input")
    return Net("dataset", dataset_size, sample, type(model).__name__, tuple(layers), label)
