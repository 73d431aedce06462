"""A worker of commlayerrun's elastic driver (tests/system/test_elastic_driver.py).

    elastic_worker.py OUT STEPS [EVENT ...]

Trains a Linear(4, 1) for STEPS steps with hvd.elastic.run, committing after each step. The
data depend on the step only, and gradients are averaged: the final parameters are those of
one process doing STEPS steps, whatever the world's size was at each step, if and only if every
step was applied exactly once from its committed state. Each worker appends JSON lines to
OUT/<pid>.jsonl: ``start`` (rank, size, generation, host, time, and the step when the
function starts: after a re-formation, the step it resumed from, and the parameters then),
``done`` (final step, size, parameters).

A second model is trained by a DistributedOptimizer in the same steps (its gradients reduced
while backward runs, so a rank that dies mid-step leaves reductions in flight on the others);
``done`` has its parameters too (``opt_params``): every rank must end with the same ones.

EVENTs, each done once in the whole job (a marker file OUT/done-I holds the step it was done
in), in order (an event waits for the one before it), in the first step >= STEP done at world
size SIZE:
- ``kill:STEP:SIZE:RANK``: the rank RANK SIGKILLs itself, after its backward and before its
  allreduce (mid-step); ``R1+R2``: two ranks at once.
- ``raise:STEP:SIZE:RANK``: the same, by an uncaught RuntimeError (exit code 1).
- ``grown:STEP:SIZE``: nothing; done once a step >= STEP runs at SIZE (the job goes on until
  the world has grown back to SIZE).
- ``cut:STEP:SIZE:RANK``: the rank RANK pulls its own host's cable (scripts/cluster.sh link
  HOST down, on the namespace cluster) mid-step, as ``kill``, and goes on into the allreduce.
- ``fail:STEP:SIZE``: every rank exits with code 3.
- ``hosts:STEP:SIZE:FILE:TEXT``: rank 0 writes TEXT (``;`` for newlines) into FILE, the
  discovery script's input, after the step.
Training goes on past STEPS until every event was done.

Events outside training (``START_RANK``: the worker started as that rank, HOROVOD_RANK):
- ``before-init:START_RANK``: that worker SIGKILLs itself before init(), once in the job.
- ``in-init:START_RANK``: that worker SIGKILLs itself 0.5 s into init() (at the rendezvous or
  while torch.distributed starts: before the first world trains), once in the job.
- ``in-rendezvous:GEN:START_RANK``: that worker SIGKILLs itself while it waits at the
  rendezvous for world GEN (the others come 2 s late), once in the job.
Rank 0 also writes the driver's address to OUT/driver (the test connects to it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

import commlayer as hvd
from commlayer import elastic
from commlayer.elastic import rendezvous

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
    marked = (out / f"done-{i}").read_text().split() if (out / f"done-{i}").exists() else None
    # every rank fails; the ranks of one kill (R1+R2) die in the same step
    together = kind == "fail" or (kind in ("kill", "raise") and marked and marked[0] == str(step))
    if marked is not None and not together:
        return None
    return [kind, *rest] if i == 0 or (out / f"done-{i - 1}").exists() else None


def done(i: int, step: int, shared: bool = False) -> bool:
    """Mark event ``i`` done in ``step``; False when another worker did first (``shared``:
    True for every rank of that step, for an event several ranks carry out together)."""
    try:
        fd = os.open(out / f"done-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        marked = (out / f"done-{i}").read_text().split()
        return shared and bool(marked) and marked[0] == str(step)
    os.write(fd, f"{step} {time.time()}".encode())
    os.close(fd)
    return True


start_rank = int(os.environ.get("HOROVOD_RANK", "-1"))


def once(name: str) -> bool:
    """True the first time in the whole job (a marker file OUT/once-NAME)."""
    try:
        os.close(os.open(out / f"once-{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def die_later(seconds: float) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()


def die_in_rendezvous(world: int, victim: int, event: str) -> None:
    """The worker started as ``victim`` SIGKILLs itself 0.5 s after it asks for world
    ``world``; the others ask 2 s late, so that the world cannot form before (the victim dies
    while it waits there)."""
    call = rendezvous.Client.call

    def call_and_die(self: rendezvous.Client, message: dict) -> dict:
        asking = message.get("op") == "rendezvous" and rendezvous.generation() == world - 1
        if asking and start_rank == victim and once(event):
            die_later(0.5)
        elif asking:
            time.sleep(2.0)
        return call(self, message)

    rendezvous.Client.call = call_and_die  # type: ignore[method-assign]


for event in events:
    kind, _, rest = event.partition(":")
    if kind == "before-init" and int(rest) == start_rank and once(event):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "in-init" and int(rest) == start_rank and once(event):
        die_later(0.5)
    if kind == "in-rendezvous":
        die_in_rendezvous(int(rest.split(":")[0]), int(rest.split(":")[1]), event)
events = [e for e in events if e.split(":")[0] not in ("before-init", "in-init", "in-rendezvous")]

hvd.init(cache_capacity=512)  # a keyword setting every world keeps (runtime.restart)
if hvd.rank() == 0:
    (out / "driver").write_text(os.environ["COMMLAYER_ELASTIC_DRIVER"])
torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
opt_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(opt_model.parameters(), lr=0.01), named_parameters=opt_model.named_parameters()
)
state = elastic.TorchState(model, optimizer, opt_model=opt_model, opt=opt, step=0)


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
        opt.zero_grad()
        opt_model(torch.ones(4, 8) * (step % 7)).pow(2).mean().backward()  # reduced meanwhile
        for i in range(len(events)):
            event = due(i, step)
            leaving = event and event[0] in ("kill", "raise")
            if leaving and str(hvd.rank()) in event[1].split("+") and done(i, step, True):
                if event[0] == "raise":
                    raise RuntimeError(f"scheduled failure of rank {hvd.rank()} at step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            if event and event[0] == "grown":
                done(i, step)
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
        opt.step()
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
    opt_params=[p.detach().reshape(-1).tolist() for p in opt_model.parameters()],
)
