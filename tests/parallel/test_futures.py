"""Futures from real collectives: then() chains on the engine's completion, errors keep their
type on every rank, and the compression communicator chains a multi-round compressor's rounds
without a thread or a wait."""

from __future__ import annotations

import threading

import pytest
import torch

import commlayer as cl
from commlayer.comm.communicator import Communicator, EngineTransport
from commlayer.compression import create


def test_allreduce_future_then_chains() -> None:
    fut = cl.allreduce_async(torch.full((3,), float(cl.rank())), name="fut.sum", op=cl.Sum)
    total = sum(range(cl.size()))
    chained = fut.then(lambda f: f.value() * 2)
    assert torch.equal(chained.wait(), torch.full((3,), 2.0 * total))
    assert fut.done() and torch.equal(fut.value(), torch.full((3,), float(total)))
    assert cl.poll(fut) and torch.equal(cl.synchronize(fut), fut.value())


def test_a_mismatch_keeps_its_type_through_then_on_every_rank() -> None:
    shape = (2,) if cl.rank() == 0 else (3,)
    fut = cl.allreduce_async(torch.ones(shape), name="fut.mismatch").then(lambda f: f.value())
    if cl.size() == 1:
        fut.wait()
        return
    with pytest.raises(cl.TensorMismatchError, match="fut.mismatch"):
        fut.wait()


def test_communicator_chains_powersgd_rounds_on_the_engine() -> None:
    """Two PowerSGD rounds (P then Q) through the engine, started from callbacks: the result is
    the rank-2 approximation of the averaged gradient that the same compressor gives on the
    average computed locally (PowerSGD is linear in the gradient given the same Q)."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(12, 10, generator=g, dtype=torch.float64) for _ in range(cl.size())]
    threads_before = {t.name for t in threading.enumerate()}
    mine = grads[cl.rank()].clone()
    communicator = Communicator(EngineTransport(), cl.Average)
    future = communicator.reduce([mine], create("powersgd:rank=2,ef=0"), "fut.powersgd")
    assert future.wait() == [mine]
    reference = create("powersgd:rank=2,ef=0")
    average = torch.stack(grads).mean(0)
    step = reference.compress(average, "fut.powersgd")
    while not step.final:
        step = reference.next_round(step, "fut.powersgd")  # type: ignore[attr-defined]
    torch.testing.assert_close(mine, reference.decompress(step), rtol=1e-9, atol=1e-9)
    assert {t.name for t in threading.enumerate()} <= threads_before  # no thread of its own
