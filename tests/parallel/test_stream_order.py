"""Device order (issue 35, item 6): the stream that consumes a reduced gradient is ordered after
all the device work queued for it, wherever that work was queued.

The race this guards against: with fp16 compression the engine's future completes once its own
work is done (``Direct.done`` then waited for its work stream), and only then do the future's
callbacks, on the engine thread, queue the cast back and the copy into the gradient, on the
engine thread's current stream (the work stream). ``step()`` waited on the host for the chained
future and queued the optimizer on its own stream, which nothing ordered after that copy: the
optimizer could read the gradient before the reduced value was written (silently the local
gradient). The fix (core/device.py **Order**, core/future.py): a future is completed
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
from typing import Any

import pytest
import torch
from direct_cpu import force_direct
from fake_streams import FakeDevice

import commlayer as cl
from commlayer.comm import communicator
from commlayer.core import device, fusion
from commlayer.core.future import Future, combined

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
    _on_thread(world, "h2d", lambda: (world.enqueue("write"), second.set_result(None)))
    both.wait()
    world.enqueue("read")
    assert [w.stream for w in world.log if w.what == "write"] == ["work", "work", "h2d"]
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
    # the reduced payload written straight into the gradient (casts, PowerSGD: decompress_into;
    # gathered top-k: summed in place) is a write of the gradient too
    real_into = communicator._decompress_into

    def into(compressor: Any, compressed: Any, tensor: torch.Tensor) -> None:
        world.enqueue("write")
        real_into(compressor, compressed, tensor)

    monkeypatch.setattr(communicator, "_decompress_into", into)
    real_add = communicator.Communicator._add_records

    def add(self: Any, *args: Any) -> bool:
        world.enqueue("write")
        return real_add(self, *args)

    monkeypatch.setattr(communicator.Communicator, "_add_records", add)
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
    _assert_no_device_wait(world)


def _assert_no_device_wait(world: FakeDevice) -> None:
    """No thread waited for device work host-side (``synchronize``); events are only polled
    (``query``): by the engine, for what it must see done before a collective reads host memory
    (a staged operation's copies to the host; for MPI's direct route the producer's event), and
    by the pool of host buffers, for a buffer's copies back. The code before issue 35
    synchronized an event on the work stream (direct) or the copy stream (staged) before every
    future completed."""
    waits = set(world.host_waits)
    assert {how for how, _ in waits} <= {"query"}, waits


# -- no host wait on the direct path; the fusion buffers stay on the work stream ---------------
@pytest.mark.parametrize("marked", [True, False])
def test_direct_completes_without_host_wait_and_readers_follow_the_unpack(
    world: FakeDevice, monkeypatch: pytest.MonkeyPatch, marked: bool
) -> None:
    """The direct path's futures complete with no host wait (``Direct.done`` used to
    synchronize an event on the work stream for every operation); the caller's stream is still
    ordered after the unpack into its tensors, by the marks alone: without them the model
    reports the read unordered. Two fused operations in a row pack into the same pooled buffer:
    every pack and unpack is queued on the work stream, so the second pack is ordered after the
    first unpack."""
    route, _ = force_direct(monkeypatch)
    if not marked:
        _without_marks(monkeypatch)
    buffers: list[int] = []
    real_pack, real_unpack = fusion.pack, fusion.unpack

    def pack(bucket: list[fusion.Entry], buf: torch.Tensor) -> None:
        world.enqueue("pack")
        buffers.append(buf.data_ptr())
        real_pack(bucket, buf)

    def unpack(bucket: list[fusion.Entry], buf: torch.Tensor) -> None:
        world.enqueue("unpack")
        real_unpack(bucket, buf)

    monkeypatch.setattr(fusion, "pack", pack)
    monkeypatch.setattr(fusion, "unpack", unpack)
    run = next(_runs)
    results = []
    for i in range(2):
        tensors = [torch.full((3,), float(cl.rank() + k)) for k in range(4)]
        world.enqueue("produce")
        results.append(cl.grouped_allreduce_(tensors, op=cl.Sum, name=f"nowait{run}.{i}"))
        world.enqueue("read")
    total = sum(range(cl.size()))
    for out in results:
        assert all(torch.equal(t, torch.full((3,), float(total + k * cl.size())))
                   for k, t in enumerate(out))  # fmt: skip
    work = [w for w in world.log if w.what in ("pack", "unpack")]
    assert [w.what for w in work] == ["pack", "unpack"] * 2, world.log
    assert {w.stream for w in work} == {"work"}, work
    assert buffers[0] == buffers[1], "the second bucket did not reuse the pooled buffer"
    assert not world.unordered("unpack", "pack"), world.log
    assert not world.unordered("produce", "pack"), world.log  # the producer's event
    assert bool(world.unordered("unpack", "read")) is not marked, world.log
    _assert_no_device_wait(world)
    if route.wait == "stream":  # NCCL's route: not even a poll of the producer's event
        assert not world.host_waits, world.host_waits


# -- the staged path: one D2H and one H2D stream, pooled host buffers --------------------------
@pytest.fixture
def staged(world: FakeDevice, monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    """CPU tensors staged like CUDA ones, with the fake streams."""
    monkeypatch.setattr(device, "STAGE_CPU", True)
    return world


def _follow(world: FakeDevice) -> None:
    """What the engine's completion and the caller's wait do after ``unstage`` on this thread:
    marks recorded on its current stream (the work stream), then the side stream follows them."""
    marks = device.marks()
    assert marks is not None
    world.set_current(world.side)
    device.follow(marks)


def test_staged_copies_back_on_their_own_stream(staged: FakeDevice) -> None:
    """Operation a's copy back runs on the H2D stream, after a's copy to the host and after the
    caller's stream at submit, but not behind operation b's copy to the host, submitted later
    (one copy stream for both directions queued it there); no host wait; the caller reads after
    the copy back."""
    world = staged
    a, b = torch.ones(4), torch.full((4,), 2.0)
    world.enqueue("produce")
    _, outs_a, staged_a = device.stage([a], [a])
    _, _, staged_b = device.stage([b], [b])
    assert staged_a is not None and staged_b is not None
    outs_a[0].mul_(3)  # the collective, on the host buffer
    (result,) = staged_a.unstage([outs_a[0]])
    _follow(world)
    read = world.enqueue("read")
    copies = [w for w in world.log if w.what == "copy"]
    assert [w.stream for w in copies] == ["d2h", "d2h", "h2d"], copies
    a_in, b_in, a_back = copies
    produce = world.log[0]
    assert produce.before(a_in) and produce.before(a_back), world.log
    assert a_in.before(a_back), "the copy back is not ordered after its own copy in"
    assert not b_in.before(a_back), "the copy back waits for a later operation's copy in"
    assert a_back.before(read), "the reader is not ordered after the copy back"
    assert result is a and torch.equal(a, torch.full((4,), 3.0))
    assert not world.host_waits, world.host_waits


def _step(x: torch.Tensor) -> torch.Tensor:
    """x staged in place, its host buffer doubled by the "collective" and copied back; the host
    buffer it used."""
    ins, outs, staged = device.stage([x], [x])
    assert staged is not None
    outs[0].mul_(2)
    staged.unstage(list(outs))
    return ins[0]


def test_staged_host_buffers_are_reused_once_their_copies_are_done(staged: FakeDevice) -> None:
    """The host buffers come from a pool: the next step of the same size and dtype gets the
    same buffer (they were allocated anew every step), another size or dtype another buffer; one
    given back is not handed out while its copies back may still run (its event's query says
    not done), nor before its operation has given it back."""
    world = staged
    x = torch.ones(4)
    first = _step(x)
    assert _step(x).data_ptr() == first.data_ptr(), "the next step did not reuse the buffer"
    assert torch.equal(x, torch.full((4,), 4.0))
    assert _step(torch.ones(5)).data_ptr() != first.data_ptr()
    assert _step(torch.ones(4, dtype=torch.float64)).data_ptr() != first.data_ptr()
    world.busy = True  # the copies back of the last step on `first` are still running
    ins, outs, pending = device.stage([x], [x])
    assert ins[0].data_ptr() != first.data_ptr(), "reused while a copy back may still run"
    world.busy = False
    again, _, pending2 = device.stage([x], [x])
    assert again[0].data_ptr() == first.data_ptr(), "not reused once its copies were done"
    held = again[0].data_ptr()
    other, _, _ = device.stage([x], [x])
    assert other[0].data_ptr() not in (held, ins[0].data_ptr()), "handed out twice"
    assert pending is not None and pending2 is not None
    pending.unstage(list(outs))
    assert ("query", "h2d") in world.host_waits  # asked, host-side, without waiting
    assert not [w for w in world.host_waits if w[0] != "query"], world.host_waits
