"""Planned buckets that own their memory vs the grouped path: copies of a gradient and step time.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bucket_memory.py [--model mlp] [--rounds 3]

1. In one job, rounds alternate three ways of reducing DistributedOptimizer's planned buckets:
   ``grouped`` (the parts' gradients sent as a grouped allreduce, packed into the engine's
   fusion buffer and unpacked: what every planned bucket did before; here by making no part
   own memory), ``owned_fused`` (comm/bucketer.py, 4.: a part is one flat buffer, the gradients
   its views, sent as that one tensor, but the engine may pack parts that reach it in one
   cycle, as it did before ``fusion.ALONE_NUMEL``) and ``owned`` (such a part is never packed).
2. A step is zero_grad (``--set-to-none``, torch's default, or the gradients kept), forward,
   backward, step; benchmarks/train.py's model, SGD momentum 0.9, ``--batch`` random samples a
   rank. Median step time over ``--steps`` steps after ``--warmup``, and the copies of the
   gradients per step (elements copied by the optimizer, comm/, ops and the engine's fusion,
   over the gradients' elements: 1.0 is one copy of every gradient), counted over two steps
   by wrapping torch's copying functions (tests/parallel/test_optimizer_memory.py's way).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import MODELS  # noqa: E402

import commlayer as cl  # noqa: E402
from commlayer.comm import bucketer  # noqa: E402
from commlayer.core import fusion  # noqa: E402

_ROOT = os.path.dirname(os.path.abspath(cl.__file__))
_CORRIDOR = tuple(
    os.path.join(_ROOT, *p)
    for p in (
        ("optimizer.py",),
        ("comm", ""),  # the folder (not common/)
        ("ops.py",),
        ("core", "fusion.py"),
        ("core", "runners", "allreduce.py"),
    )
)


@contextlib.contextmanager
def counting(dtype: torch.dtype) -> Iterator[list[int]]:
    """Elements of ``dtype`` copied by the corridor's modules while the block runs."""
    copied = [0]
    lock = threading.Lock()
    saved: list[tuple[Any, str, Any]] = []

    def numel(tensors: Any) -> int:
        if isinstance(tensors, torch.Tensor):
            return tensors.numel() if tensors.dtype == dtype else 0
        return sum(numel(t) for t in tensors)

    def wrap(owner: Any, name: str, count: Any) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.startswith(_CORRIDOR):
                n = count(*args, **kwargs)
                with lock:
                    copied[0] += n
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    def into(source: torch.Tensor, _: Any, out: Any = None, **__: Any) -> int:
        same = out is None or out.data_ptr() == source.data_ptr()
        return 0 if same else numel(out)

    wrap(torch.Tensor, "copy_", lambda self, *a, **k: numel(self))
    wrap(torch.Tensor, "clone", lambda self, *a, **k: numel(self))
    wrap(torch, "cat", lambda tensors, *a, **k: numel(list(tensors)))
    wrap(torch, "split_with_sizes_copy", lambda t, *a, **k: numel(t))
    wrap(torch, "_foreach_copy_", lambda dst, *a, **k: numel(list(dst)))
    wrap(torch, "div", into)
    wrap(torch, "mul", into)
    wrap(fusion, "scale_into", into)  # unpack's scale straight into the outputs
    try:
        yield copied
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _no_memory(params: Any, compressor: Any, tail: int = 0) -> tuple[None, tuple[()], int]:
    return None, (), 0


def run(way: str, args: argparse.Namespace) -> tuple[float, float]:
    """(median step seconds, copies of the gradients a step) of one round."""
    make, shape, classes = MODELS[args.model]
    torch.manual_seed(0)
    model = make()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    x = torch.randn(args.batch, *shape)
    y = torch.randint(0, classes, (args.batch,))
    elements = sum(p.numel() for p in model.parameters())
    owned, alone = bucketer.owned_memory, fusion.ALONE_NUMEL
    if way == "grouped":
        bucketer.owned_memory = _no_memory  # type: ignore[assignment]
    if way == "owned_fused":
        fusion.ALONE_NUMEL = 1 << 62  # the engine may pack parts that meet in one cycle
    try:
        times, copies = [], []
        for step in range(args.warmup + args.steps + 2):
            counted = step >= args.warmup + args.steps
            with counting(torch.float32) if counted else contextlib.nullcontext([0]) as copied:
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=args.set_to_none)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                seconds = time.perf_counter() - t0
            if counted:
                copies.append(copied[0] / elements)
            elif step >= args.warmup:
                times.append(seconds)
    finally:
        bucketer.owned_memory = owned  # type: ignore[assignment]
        fusion.ALONE_NUMEL = alone
    return statistics.median(times), statistics.mean(copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="mlp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--set-to-none", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    cl.init()
    results: dict[str, list[tuple[float, float]]] = {"grouped": [], "owned_fused": [], "owned": []}
    for _ in range(args.rounds):
        for way in results:
            results[way].append(run(way, args))
    if cl.rank() == 0:
        zero = "set_to_none" if args.set_to_none else "grads kept"
        print(f"{args.model}, {cl.size()} ranks, zero_grad: {zero}, {args.rounds} rounds")
        print(f"{'way':<12} {'step ms (median a round)':<32} copies of the gradients a step")
        for way, rounds in results.items():
            ms = ", ".join(f"{t * 1e3:.1f}" for t, _ in rounds)
            copies = ", ".join(f"{c:.2f}" for _, c in rounds)
            print(f"{way:<12} {ms:<32} {copies}")
    cl.shutdown()


if __name__ == "__main__":
    main()
