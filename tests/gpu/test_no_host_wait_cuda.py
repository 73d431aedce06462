"""No host wait on the GPU paths (issue 35; commlayer/core/device.py, **Direct** and **Staged**), on
CUDA: the same checks tests/parallel/test_stream_order.py makes on the CPU with fake streams.

A long device sleep (``torch.cuda._sleep``, ~1 s, queued before the work that matters) makes a
host wait, or a copy queued behind the wrong one, visible as a state rather than a time: right
after the call, an event after the slept work has not completed (``query()`` is False) unless
the call waited for it. Nothing here measures a duration.

1. ``Direct.done`` returns while the engine's work (on the work stream) is still queued, and a
   reader that waits on the future (its marks) still reads the finished values.
2. Staged: an operation's copy back runs on the H2D stream, so it completes while a later
   operation's copy to the host is still held back (behind a sleep on its caller's stream);
   one copy stream for both directions queued it behind that copy.
3. Staged: pinned host buffers are reused across steps, and not while a copy back that reads
   them is still queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

from slow_cast import SLEEP_CYCLES  # noqa: E402

from commlayer.core import device  # noqa: E402
from commlayer.core.future import Future  # noqa: E402

LONG_SLEEP = 10 * SLEEP_CYCLES  # ~1 s: far longer than the host steps between call and check


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """This process's CUDA device, futures marked for it, a pool of host buffers of its own."""
    where = torch.device("cuda", torch.cuda.current_device())
    device.mark_futures_on(where)
    monkeypatch.setattr(device, "_host_pool", device._HostPool())
    yield where
    torch.cuda.synchronize()


def _on_engine_thread(where: torch.device, work: Callable[[], Any]) -> Any:
    """``work()`` on a thread of its own whose current stream is the engine's work stream (as
    the engine thread's is once it has run a device operation); its result."""
    out: list[Any] = []

    def run() -> None:
        torch.cuda.set_device(where)
        torch.cuda.set_stream(device._work_stream(where))
        out.append(work())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def test_direct_done_does_not_wait_and_readers_follow_the_marks(dev: torch.device) -> None:
    x = torch.zeros(1 << 20, device=dev)
    future = Future("direct")
    direct = device.Direct(dev, device.Path("stream"), None)

    def engine() -> bool:
        torch.cuda._sleep(LONG_SLEEP)  # the collective, slow
        x.fill_(1.0)  # the unpack into the caller's tensor
        after = torch.cuda.Event()
        after.record()
        future.set_result(direct.done(x))
        return bool(after.query())

    finished_when_done = _on_engine_thread(dev, engine)
    assert not finished_when_done, "Direct.done waited for the engine's device work"
    reader = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(reader):
        seen = future.wait().clone()  # on the reader's stream: after the fill only if ordered
    reader.synchronize()
    assert torch.equal(seen, torch.ones_like(seen)), "read before the unpack was done"


def test_staged_copy_back_not_behind_a_later_copy_in(dev: torch.device) -> None:
    a = torch.ones(1 << 16, device=dev)
    b = torch.full((1 << 16,), 2.0, device=dev)
    caller = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(caller):
        _, outs_a, staged_a = device.stage([a], [a])
        torch.cuda._sleep(LONG_SLEEP)  # b is produced late: its copy in waits for this
        _, _, staged_b = device.stage([b], [b])
    assert staged_a is not None and staged_b is not None
    while not staged_a.ready.test():  # the engine polls a's copies in (they do not wait)
        pass
    outs_a[0].mul_(3)  # the collective, on the host buffer
    future = Future("staged")
    _on_engine_thread(dev, lambda: future.set_result(staged_a.unstage([outs_a[0]])))
    reader = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(reader):
        (result,) = future.wait()
        seen = result.clone()
    reader.synchronize()  # a's copy back is done: the reader's stream followed it
    assert not staged_b.ready.test(), "a's copy back waited for b's copy in (one copy stream)"
    assert torch.equal(seen, torch.full_like(seen, 3.0))


def test_staged_host_buffers_reused_not_while_copies_run(dev: torch.device) -> None:
    x = torch.ones(1 << 16, device=dev)

    def submit() -> tuple[torch.Tensor, torch.Tensor, device.Staged]:
        ins, outs, staged = device.stage([x], [x])
        assert staged is not None
        while not staged.ready.test():
            pass
        return ins[0], outs[0], staged

    first, out, staged = submit()
    assert first.is_pinned()
    out.mul_(2)  # the collective: x becomes 2 (the later steps leave it so)
    _on_engine_thread(dev, lambda: staged.unstage([out]))
    torch.cuda.synchronize()
    second, out, staged = submit()
    assert second.data_ptr() == first.data_ptr(), "the next step did not reuse the buffer"
    with torch.cuda.stream(device._h2d_stream(dev)):
        torch.cuda._sleep(LONG_SLEEP)  # the copy back below stays queued behind this
    _on_engine_thread(dev, lambda: staged.unstage([out]))
    third, out3, staged3 = submit()
    assert third.data_ptr() != first.data_ptr(), "reused while its copy back was queued"
    torch.cuda.synchronize()
    fourth, _, _ = submit()
    assert fourth.data_ptr() == first.data_ptr(), "not reused once its copies were done"
    _on_engine_thread(dev, lambda: staged3.unstage([out3]))
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2.0))
