"""Planned buckets own their memory (comm/bucketer.py, 4.): copies of a gradient per step.

After the first step a bucket's uncompressed part is one flat buffer of which the gradients are
views. The copies the gradient's corridor makes (the optimizer, the bucketer, the communicator,
the engine's fusion) are counted, in elements of the model's float64 gradients, by wrapping the
torch functions that copy (``copy_``, ``clone``, ``cat``, the split and foreach copies, a
scale into another tensor) for calls made from those modules; the collective algorithm's own
transfers are not the corridor's. Targets: one copy in per gradient a step where
``zero_grad(set_to_none=True)`` (torch's default) left ``p.grad`` None, none where the gradients
are kept (``set_to_none=False``), none out (the reduced buffer is the gradients).

The engine reduces a part where it lies: a lone tensor is not packed, and an operation of one
large tensor (``fusion.ALONE_NUMEL`` elements or more) is never fused with others that reach
the engine in the same cycle. The model's parts are all that large, so the engine's fusion
copies nothing either (smaller parts that meet in one cycle may still be packed there).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as cl
from commlayer.core import fusion, submit

F64 = torch.float64
WIDTH = 256  # a weight: fusion.ALONE_NUMEL elements, so every part is as large
ROWS = 4
EXACT = {"rtol": 1e-9, "atol": 1e-10}
_ROOT = os.path.dirname(os.path.abspath(cl.__file__))
# where the gradient's corridor copies: the optimizer, comm/, the engine's fusion and runner
_ABOVE = tuple(os.path.join(_ROOT, *p) for p in (("optimizer.py",), ("comm", ""), ("ops.py",)))
_FUSION = tuple(
    os.path.join(_ROOT, "core", *p) for p in (("fusion.py",), ("runners", "allreduce.py"))
)
# the shared-memory window buckets live in (COMMLAYER_WINDOW_BUCKETS): its own transfers, the
# one copy of the reduced data a rank makes, counted apart
_WINDOW = (os.path.join(_ROOT, "backends", "shm.py"),)
_CORRIDOR = _ABOVE + _FUSION + _WINDOW


class _Copies:
    """Elements of float64 tensors copied from the corridor's modules, by call site."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_site: dict[str, int] = {}

    def total(self, where: tuple[str, ...]) -> int:
        """Elements copied from the modules ``where`` (paths, or folders ending them)."""
        prefixes = tuple(
            os.path.relpath(path, _ROOT) + (os.sep if path.endswith(os.sep) else ":")
            for path in where
        )
        return sum(n for site, n in self.by_site.items() if site.startswith(prefixes))

    def add(self, numel: int) -> None:
        caller = sys._getframe(2).f_code.co_filename
        if not caller.startswith(_CORRIDOR):
            return
        site = f"{os.path.relpath(caller, _ROOT)}:{sys._getframe(2).f_lineno}"
        with self.lock:
            self.by_site[site] = self.by_site.get(site, 0) + numel


def _f64(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() if tensors.dtype == F64 else 0
    return sum(_f64(t) for t in tensors)


@contextlib.contextmanager
def _counting() -> Iterator[_Copies]:
    """Wrap torch's copying functions while the block runs (every thread: the engine's too)."""
    copies = _Copies()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, count: Callable[..., int]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            copies.add(count(*args, **kwargs))
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    def scaled_into(source: torch.Tensor, _: Any, out: Any = None, **__: Any) -> int:
        if out is None or out.data_ptr() == source.data_ptr():
            return 0  # in place, or a new tensor (not a copy of ours)
        return _f64(out)

    wrap(torch.Tensor, "copy_", lambda self, src, *a, **k: _f64(self))
    wrap(torch.Tensor, "clone", lambda self, *a, **k: _f64(self))
    wrap(torch, "cat", lambda tensors, *a, **k: _f64(list(tensors)))
    wrap(torch, "split_with_sizes_copy", lambda t, *a, **k: _f64(t))
    wrap(torch, "_foreach_copy_", lambda dst, src, *a, **k: _f64(list(dst)))
    wrap(torch, "div", scaled_into)
    wrap(torch, "mul", scaled_into)
    wrap(fusion, "scale_into", scaled_into)  # unpack's scale straight into the outputs
    try:
        yield copies
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(
        *[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())], nn.Linear(WIDTH, 2)
    ).to(F64)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS * cl.size(), WIDTH, generator=g, dtype=F64)
    y = torch.randn(ROWS * cl.size(), 2, generator=g, dtype=F64)
    return x, y


def _shard(t: torch.Tensor) -> torch.Tensor:
    return t[cl.rank() * ROWS : (cl.rank() + 1) * ROWS]


def _wrapped(model: nn.Module, bucket_bytes: int) -> torch.optim.Optimizer:
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    opt._commlayer.bucketer.bucket_bytes = bucket_bytes  # type: ignore[attr-defined]
    return opt


def _backward(model: nn.Module, step: int, shard: bool = True) -> None:
    x, y = _batch(step)
    if shard:
        x, y = _shard(x), _shard(y)
    F.mse_loss(model(x), y).backward()


def _views(opt: torch.optim.Optimizer) -> dict[nn.Parameter, torch.Tensor]:
    return opt._commlayer.bucketer.view_of  # type: ignore[attr-defined,no-any-return]


# bucket_bytes: one bucket for the whole model, and one every few gradients
BUCKET_BYTES = {"one_bucket": 1 << 30, "buckets": 8 * WIDTH * WIDTH}


@pytest.mark.parametrize("window", [False, True], ids=["process_memory", "window"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "grads_kept"])
@pytest.mark.parametrize("bucket_bytes", list(BUCKET_BYTES))
def test_copies_per_step_on_the_planned_path(
    set_to_none: bool, bucket_bytes: str, window: bool
) -> None:
    """``window``: the buckets in a shared-memory window (COMMLAYER_WINDOW_BUCKETS): the same
    corridor copies, and the window's own: each rank writes its reduced slice into the other
    ranks' buckets, (size - 1) / size of the gradients a step (the regular window copies all
    but its own slice in and every slice out, (2 size - 1) / size)."""
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = _wrapped(model, BUCKET_BYTES[bucket_bytes])
    params = list(model.parameters())
    elements = sum(p.numel() for p in params)
    _backward(model, 0)
    with cl.config.override(window_buckets=window):
        opt.step()  # the first step plans the buckets
    housed = opt._commlayer.window  # type: ignore[attr-defined]
    opt.zero_grad(set_to_none=set_to_none)
    planned = len(_views(opt))
    buckets = opt._commlayer.bucketer.buckets  # type: ignore[attr-defined]
    parts = [part.flat.numel() for b in buckets for part in b.parts]
    above, fused, in_window, sites = [], [], [], []
    for step in range(1, 4):
        with _counting() as copies:
            _backward(model, step)
            opt.step()
        above.append(copies.total(_ABOVE))
        fused.append(copies.total(_FUSION))
        in_window.append(copies.total(_WINDOW))
        sites.append(copies.by_site)
        opt.zero_grad(set_to_none=set_to_none)
    for step in range(4):
        _backward(ref, step, shard=False)
        ref_opt.step()
        ref_opt.zero_grad()
    every_rank = cl.allgather_object(in_window)  # collectives first, asserts last

    assert planned == len(params)  # every gradient lives in a bucket's memory
    want = elements if set_to_none else 0  # one copy in where p.grad was None, none out
    assert above == [want] * 3, sites
    assert min(parts) >= fusion.ALONE_NUMEL, parts  # never packed with another (docstring)
    assert fused == [0] * 3, sites  # reduced where it lies: no pack, no unpack
    if housed is not None:  # every rank on one machine: the buckets are the window's
        assert all(housed.offset_of(v) is not None for v in _views(opt).values())
        n = cl.size()
        # each rank's slices, handed to the n - 1 others: every element once by one rank (a
        # rank's share is about 1/n of them: slices are whole cache lines of each chunk, so
        # the last rank's is smaller by a few lines a chunk)
        totals = [sum(step) for step in zip(*every_rank)]
        assert totals == [elements * (n - 1)] * 3, every_rank
        assert all(0 < c <= elements * (n - 1) // n + 64 * len(parts) for c in in_window)
    else:
        assert not window or cl.size() == 1 or submit.topology().nodes > 1
    for got, expected in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, expected, **EXACT)


def test_grad_after_step_is_the_reduced_value_and_none_after_zero_grad() -> None:
    model = _model()
    opt = _wrapped(model, BUCKET_BYTES["buckets"])
    for step in range(2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    _backward(model, 2)
    opt.synchronize()
    views = _views(opt)
    reduced = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    gathered = [cl.allgather(g.unsqueeze(0)) for g in reduced]
    local = copy.deepcopy(model)
    for p in local.parameters():
        p.grad = None
    _backward(local, 2, shard=False)  # the whole batch's gradient: the average of the shards'
    with opt.skip_synchronize():
        opt.step()
    is_view = [p.grad is views[p] for p in model.parameters()]
    opt.zero_grad()
    none_after = [p.grad is None for p in model.parameters()]

    assert all(is_view)
    assert all(none_after)
    for g, on_all, p in zip(reduced, gathered, local.parameters()):
        assert all(torch.equal(g, other) for other in on_all)  # the same on every rank
        torch.testing.assert_close(g, p.grad, **EXACT)
