"""commlayer.core.future.Future: torch's Future interface, errors keeping their type through chains,
callbacks on the completing thread, and the refusal of a wait that would deadlock the engine."""

from __future__ import annotations

import threading

import pytest
import torch

from commlayer.common.errors import TensorMismatchError
from commlayer.core import future as future_module
from commlayer.core.future import Future, Handle


def test_torch_interface_and_horovod_name() -> None:
    fut = Future("grad.w")
    assert Handle is Future
    assert not fut.done()
    with pytest.raises(RuntimeError, match="has not completed"):
        fut.value()
    fut.set_result(7)
    assert fut.done() and fut.wait() == 7 and fut.value() == 7
    with pytest.raises(RuntimeError, match="completed twice"):
        fut.set_result(8)


def test_then_chains_values_and_keeps_error_types() -> None:
    fut = Future("a")
    doubled = fut.then(lambda f: f.value() * 2)
    plus_one = doubled.then(lambda f: f.value() + 1)
    assert not plus_one.done()
    fut.set_result(20)
    assert plus_one.wait() == 41

    failing = Future("b")
    chained = failing.then(lambda f: f.value()).then(lambda f: f.value())
    failing.set_exception(TensorMismatchError("rank 1: shapes differ"))
    with pytest.raises(TensorMismatchError, match="rank 1: shapes differ"):
        chained.wait()  # torch's Future would raise RuntimeError here


def test_callback_error_completes_the_chained_future() -> None:
    fut = Future("c")
    chained = fut.then(lambda f: 1 // 0)
    fut.set_result(None)
    with pytest.raises(ZeroDivisionError):
        chained.wait()


def test_add_done_callback_runs_once_on_the_completing_thread_or_at_once() -> None:
    fut = Future("d")
    seen: list[tuple[int, str]] = []
    fut.add_done_callback(lambda f: seen.append((f.value(), threading.current_thread().name)))
    worker = threading.Thread(target=fut.set_result, args=(5,), name="completer")
    worker.start()
    worker.join()
    assert seen == [(5, "completer")]
    fut.add_done_callback(lambda f: seen.append((f.value(), threading.current_thread().name)))
    assert seen[-1] == (5, threading.current_thread().name)


def test_a_raising_callback_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    fut = Future("e")
    fut.add_done_callback(lambda f: 1 // 0)
    fut.set_result(None)  # the completing thread (the engine's) goes on
    assert fut.done() and "a callback on" in caplog.text


def test_to_torch_forwards_result_and_error() -> None:
    fut = Future("f")
    theirs = fut.to_torch()
    assert isinstance(theirs, torch.futures.Future) and not theirs.done()
    fut.set_result(torch.ones(2))
    assert torch.equal(theirs.wait(), torch.ones(2))

    failing = Future("g")
    theirs = failing.to_torch()
    failing.set_exception(TensorMismatchError("mismatch"))
    with pytest.raises(Exception, match="mismatch"):
        theirs.wait()


def test_waiting_on_the_engine_thread_is_refused_not_a_hang() -> None:
    pending = Future("h")
    caught: list[BaseException] = []

    def engine_thread() -> None:
        future_module.mark_engine_thread(threading.get_ident(), True)
        try:
            pending.wait()
        except RuntimeError as exc:
            caught.append(exc)
        finally:
            future_module.mark_engine_thread(threading.get_ident(), False)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and "chain it with then()" in str(caught[0])


def test_wait_timeout() -> None:
    with pytest.raises(TimeoutError, match="'i' did not complete"):
        Future("i").wait(timeout_s=0.01)
