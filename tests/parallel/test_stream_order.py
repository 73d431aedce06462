"""Device order (issue 35, item 6): the stream that consumes a reduced gradient is ordered after
all the device work queued for it, wherever that work was queued.

The race this guards against: with fp16 compression the engine's future completes once its own
work is done (``Direct.done`` waits for its work stream), and only then do the future's
callbacks, on the engine thread, queue the cast back and the copy into the gradient, on the
engine thread's current stream (the work stream). ``step()`` waited on the host for the chained
future and queued the optimizer on its own stream, which nothing ordered after that copy: the
optimizer could read the gradient before the reduced value was written (silently the local
gradient). The fix (commlayer/device.py **Order**, commlayer/future.py): a future is completed
with events recorded on the completing thread's current streams after that work, and whoever
waits on it, or runs a callback on it, makes its current streams wait on them.

Here CPU tensors go through the direct and the staged paths with fake streams and events that
model what CUDA orders after what (fake_streams.py); the training runs on a stream of its own
(as under ``torch.cuda.stream(s)``), the tests mark the device work that matters (the write
into each gradient, the optimizer's step) and check that every write is ordered before every
later step. Each case also runs with the marks switched off, which the model must report as a
race: that is what the code did before the fix. tests/gpu/test_stream_order_cuda.py runs the
same cases on a GPU, where a delay queued before the write makes the race visible in the values.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from direct_cpu import force_direct
from fake_streams import FakeDevice

import commlayer as cl
from commlayer import device
from commlayer.compression import communicator
from commlayer.future import Future, combined

CPU = torch.device("cpu")
_runs = itertools.count()  # operation names differ between cases (the same on every rank)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDevice]:
    """Fake streams installed, futures marked for the CPU device, this thread on the side
    stream."""
    fake = FakeDevice()
    fake.install(monkeypatch)
    device.mark_futures_on(CPU)
    fake.set_current(fake.side)
    yield fake


def _without_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Futures completed without marks: the code before the fix."""
    monkeypatch.setattr(device, "marks", lambda: None)


def _on_thread(world: FakeDevice, stream_name: str, work: Callable[[], None]) -> None:
    """Run ``work`` on another thread whose current stream is ``stream_name``."""

    def run() -> None:
        world.set_current(getattr(world, stream_name))
        work()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


# -- the future's part ------------------------------------------------------------------------
@pytest.mark.parametrize("marked", [True, False])
def test_wait_orders_the_waiting_stream_after_the_completing_one(
    world: FakeDevice, monkeypatch: pytest.MonkeyPatch, marked: bool
) -> None:
    if not marked:
        _without_marks(monkeypatch)
    future = Future("t")

    def complete() -> None:
        world.enqueue("write")
        future.set_result(1)

    _on_thread(world, "work", complete)
    assert future.wait() == 1
    world.enqueue("read")
    assert bool(world.unordered("write", "read")) is not marked, world.log


def test_then_and_combined_carry_the_order(world: FakeDevice) -> None:
    """A callback's work (a decompress) is queued after the future's, and the future chained
    from it orders its waiter after both; a combined future after every part's."""
    first, second = Future("a"), Future("b")
    chained = first.then(lambda done: world.enqueue("write"))
    both = combined("ab", [chained, second], lambda results: None)
    _on_thread(world, "work", lambda: (world.enqueue("write"), first.set_result(None)))
    _on_thread(world, "copy", lambda: (world.enqueue("write"), second.set_result(None)))
    both.wait()
    world.enqueue("read")
    assert [w.stream for w in world.log if w.what == "write"] == ["work", "work", "copy"]
    assert not world.unordered("write", "read"), world.log


def test_callbacks_and_to_torch_follow_the_order(world: FakeDevice) -> None:
    """A callback added once the future is done runs on the adding thread's stream: ordered
    after the future's work before it runs (as is ``to_torch()``'s forwarding)."""
    future = Future("t")
    _on_thread(world, "work", lambda: (world.enqueue("write"), future.set_result(2)))
    future.add_done_callback(lambda done: world.enqueue("read"))
    assert future.to_torch().wait() == 2
    world.enqueue("read")
    assert not world.unordered("write", "read"), world.log


def test_no_device_no_marks() -> None:
    """A CPU job's futures carry no marks (one check on completion and on wait)."""
    future = Future("t")
    future.set_result(0)
    assert future._marks is None and device.marks() is None


# -- DistributedOptimizer through the engine ----------------------------------------------------
class _LoggingSGD(torch.optim.SGD):
    """SGD whose step is device work queued on the caller's current stream."""

    world: FakeDevice

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.world.enqueue("step")
        super().step()


@pytest.mark.parametrize("marked", [True, False])
@pytest.mark.parametrize("compression", ["fp16", "powersgd:rank=1", "topk:ratio=0.5"])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_reduced_gradients_are_written_before_step(
    world: FakeDevice,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    compression: str,
    marked: bool,
) -> None:
    """Every write of a reduced gradient (the cast back and copy, in a callback on the engine
    thread) is ordered before the optimizer step that follows it; without the marks the model
    reports the race the code had before."""
    if path == "direct":
        force_direct(monkeypatch)
    else:
        monkeypatch.setattr(device, "STAGE_CPU", True)
    if not marked:
        _without_marks(monkeypatch)
    real_write = communicator._write

    def write(tensor: torch.Tensor, value: torch.Tensor) -> None:
        world.enqueue("write")
        real_write(tensor, value)

    monkeypatch.setattr(communicator, "_write", write)
    torch.manual_seed(0)
    # weights of 2048 elements: compressed (the policy sends tensors under 1024 as they are)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    sgd = _LoggingSGD(model.parameters(), lr=0.1)
    sgd.world = world
    run = next(_runs)
    opt = cl.DistributedOptimizer(
        sgd,
        named_parameters=[(f"order{run}.{n}", p) for n, p in model.named_parameters()],
        compression=compression,
    )
    g = torch.Generator().manual_seed(cl.rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 32, generator=g)).square().sum().backward()
        opt.step()
    # The first step's callbacks run on the engine thread (its gradients are submitted in one
    # batch, after their callbacks were added); later ones may run on this thread when the
    # reduction is done before the callback is added, their writes then on the training stream.
    writes = [w for w in world.log if w.what == "write"]
    assert any(w.stream != "side" for w in writes), world.log
    # Without marks the first step's last write, queued after the engine's last host wait, is
    # unordered with the step: the model sees the race, on both paths.
    unordered = world.unordered("write", "step")
    assert bool(unordered) is not marked, unordered[:4]
