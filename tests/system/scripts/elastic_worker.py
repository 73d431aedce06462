"""A worker of commlayerrun's elastic driver (tests/system/test_elastic_driver.py).

    elastic_worker.py OUT STEPS [EVENT ...]

Trains a Linear(4, 1) for STEPS steps with hvd.elastic.run, committing after each step. The
data depend on the step only, and gradients are averaged: the final parameters are those of
one process doing STEPS steps, whatever the world's size was at each step, if and only if every
step was applied exactly once from its committed state. Each worker appends JSON lines to
OUT/<pid>.jsonl: ``start`` (rank, size, generation, host, time, and the step when the
function starts: after a re-formation, the step it resumed from, and the parameters then),
``done`` (final step, size, parameters).

EVENTs, each done once in the whole job (a marker file OUT/done-I holds the step it was done
in), in order (an event waits for the one before it), in the first step >= STEP done at world
size SIZE:
- ``kill:STEP:SIZE:RANK``: the rank RANK SIGKILLs itself, after its backward and before its
  allreduce (mid-step).
- ``cut:STEP:SIZE:RANK``: the rank RANK pulls its own host's cable (scripts/cluster.sh link
  HOST down, on the namespace cluster) mid-step, as ``kill``, and goes on into the allreduce.
- ``fail:STEP:SIZE``: every rank exits with code 3.
- ``hosts:STEP:SIZE:FILE:TEXT``: rank 0 writes TEXT (``;`` for newlines) into FILE, the
  discovery script's input, after the step.
Training goes on past STEPS until every event was done.
Rank 0 also writes the driver's address to OUT/driver (the test connects to it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import commlayer as hvd
from commlayer import elastic
from commlayer.core import rendezvous

out, steps, events = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
log = out / f"{os.getpid()}.jsonl"


def record(kind: str, **fields: object) -> None:
    with log.open("a") as f:
        f.write(json.dumps({"kind": kind, **fields}) + "\n")


def due(i: int, step: int) -> list[str] | None:
    """Event ``i``'s fields when it is due in ``step`` (not done yet, the one before done)."""
    kind, at, size, *rest = events[i].split(":", 3)
    if step < int(at) or hvd.size() != int(size):
        return None
    if kind != "fail" and (out / f"done-{i}").exists():  # every rank fails
        return None
    return [kind, *rest] if i == 0 or (out / f"done-{i - 1}").exists() else None


def done(i: int, step: int) -> bool:
    """Mark event ``i`` done in ``step``; False when another worker did first."""
    try:
        fd = os.open(out / f"done-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, f"{step} {time.time()}".encode())
    os.close(fd)
    return True


hvd.init(cache_capacity=512)  # a keyword setting every world keeps (runtime.restart)
if hvd.rank() == 0:
    (out / "driver").write_text(os.environ["COMMLAYER_ELASTIC_DRIVER"])
torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = elastic.TorchState(model, optimizer, step=0)


@elastic.run
def train(state: elastic.TorchState) -> None:
    record(
        "start",
        rank=hvd.rank(),
        size=hvd.size(),
        generation=rendezvous.generation(),
        host=socket.gethostname(),
        time=time.time(),
        step=state.step,
        cache=hvd.runtime.config().cache_capacity,
        params=[p.detach().reshape(-1).tolist() for p in model.parameters()],
    )
    while True:
        pending = not all((out / f"done-{i}").exists() for i in range(len(events)))
        more = torch.tensor([float(state.step < steps or pending)])
        if hvd.allreduce(more, name="more", op=hvd.Sum).item() == 0:  # all ranks agree
            break
        step = state.step
        x = torch.arange(16, dtype=torch.float32).reshape(4, 4) / (step + 1)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        for i in range(len(events)):
            event = due(i, step)
            if event and event[0] == "kill" and hvd.rank() == int(event[1]) and done(i, step):
                os.kill(os.getpid(), signal.SIGKILL)
            if event and event[0] == "cut" and hvd.rank() == int(event[1]) and done(i, step):
                cluster_sh = Path(__file__).resolve().parents[3] / "scripts" / "cluster.sh"
                host = socket.gethostname()
                subprocess.run(["bash", str(cluster_sh), "link", host, "down"], check=True)
            if event and event[0] == "fail":
                done(i, step)
                os._exit(3)
        for p in model.parameters():
            assert p.grad is not None
            # Max of equal gradients: exactly each, at any size (an average rounds)
            p.grad.copy_(hvd.allreduce(p.grad, name=f"grad.{p.shape}", op=hvd.Max))
        optimizer.step()
        state.step = step + 1
        for i in range(len(events)):
            event = due(i, step)
            if event and event[0] == "hosts" and hvd.rank() == 0 and done(i, step):
                path, text = event[1].split(":", 1)
                Path(path + ".new").write_text(text.replace(";", "\n") + "\n")
                os.replace(path + ".new", path)  # the driver never reads half a file
        time.sleep(0.05)
        state.commit()


train(state)
record(
    "done",
    rank=hvd.rank(),
    size=hvd.size(),
    step=state.step,
    params=[p.detach().reshape(-1).tolist() for p in model.parameters()],
)
