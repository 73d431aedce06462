"""Device order on a GPU (issue 35, item 6): what consumes a future's value on its own stream
is ordered after all the device work queued for it, on whatever stream and thread that work
was queued; tests/parallel/test_stream_order.py checks the same logic on the CPU with fake
streams. Here a ~0.1 s device sleep queued before the write (slow_cast.py) makes a missing
order visible in the values: the consumer would read what was there before.

1. A commlayer Future completed on another thread, after work queued on that thread's stream:
   ``wait()`` (and ``to_torch().wait()``, DDP's way) orders the caller's stream after it.
2. DistributedOptimizer with fp16 compression, staged over MPI (mpiexec) and through the direct
   path (torchrun, NCCL): the step applies the reduced gradient, written ~0.1 s late by the
   engine's callbacks (order_worker.py, in a job of its own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

from slow_cast import SLEEP_CYCLES  # noqa: E402

from commlayer.core import device  # noqa: E402
from commlayer.core.future import Future  # noqa: E402

WORKER = Path(__file__).with_name("order_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _complete_late(future: Future, out: torch.Tensor) -> None:
    """On a thread of its own and a stream of its own: a sleep, then ``out`` filled with ones,
    then ``future`` completed (at once: the host does not wait for the device)."""

    def run() -> None:
        torch.cuda.set_device(out.device)
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(SLEEP_CYCLES)
            out.fill_(1.0)
            future.set_result(out)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


@pytest.mark.parametrize("consume", ["wait", "to_torch"])
def test_future_orders_the_waiting_stream(consume: str) -> None:
    device.mark_futures_on(torch.device("cuda", torch.cuda.current_device()))
    out = torch.zeros(1 << 20, device="cuda")
    future = Future("late")
    _complete_late(future, out)
    value = future.wait() if consume == "wait" else future.to_torch().wait()
    seen = value.clone()  # on this thread's stream: after the fill only if ordered
    assert torch.equal(seen, torch.ones_like(seen)), "read before the fill was done"


def _run(launch: list[str], env: dict[str, str]) -> None:
    environ = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
        "COMMLAYER_FORCE_FULL_PATH": "1",  # one rank: the whole path all the same
        **env,
    }
    done = subprocess.run([*launch, str(WORKER)], env=environ, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "ORDER OK" in out, out[-4000:]


def test_optimizer_staged_over_mpi() -> None:
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    _run(["mpiexec", "-n", "1", sys.executable], {"COMMLAYER_BACKEND": "mpi",
                                                  "COMMLAYER_CUDA_AWARE_MPI": "0"})  # fmt: skip


def test_optimizer_direct_over_nccl() -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"],
         {"COMMLAYER_NCCL": "1"})  # fmt: skip
