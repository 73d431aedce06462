"""A worker for Horovod's elastic scenarios (tests/system/test_elastic_horovod.py), written to
the same contract as Horovod's test/integration/data/elastic_torch_main.py, so that the
scenarios' schedules and assertions carry over unchanged:

    elastic_epochs.py --logfile F [--epochs N] [--batches-per-epoch B] [--epoch-wait S]
        [--discovery-schedule JSON] [--exit-schedule JSON] [--exit-mode exception|kill]

Trains a tiny model with ``hvd.elastic.run``, committing after every batch. At the end of each
epoch rank 0 appends one JSON line to F (epoch, batch, commits, the host and rank the worker was
started as: HOROVOD_HOSTNAME and HOROVOD_RANK, its rank and size now, and how many times the
training function was entered: ``rendezvous``). The discovery script of a scenario counts those
lines to decide the hosts it prints, so when the schedule changes the hosts after an epoch,
rank 0 waits (up to 3 s) until the driver's notice of the change has arrived, as Horovod's
script does. The exit schedule maps "(epoch, batch)" to the start ranks that leave there: by
raising an error, or by SIGKILLing themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import commlayer as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--logfile", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--epoch-wait", type=float, default=0.0)
parser.add_argument("--discovery-schedule", default="[]")
parser.add_argument("--discovery-wait", type=float, default=3.0)
parser.add_argument("--exit-schedule", default="{}")
parser.add_argument("--exit-mode", choices=("exception", "kill"), default="exception")
args = parser.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())
inputs, targets = torch.randn(32, 2), torch.randint(0, 2, (32,))
model = torch.nn.Linear(2, 2)
base_lr = 0.001
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size()),
    named_parameters=model.named_parameters(),
)

started_as = os.environ.get("HOROVOD_HOSTNAME"), int(os.environ.get("HOROVOD_RANK", 0))
schedule = json.loads(args.discovery_schedule)
hosts_at = {epoch: hosts for epoch, hosts in schedule if epoch is not None}
hosts_after = schedule[-1][1] if schedule else []
leaving = json.loads(args.exit_schedule)


def maybe_leave(epoch: int, batch: int) -> None:
    if started_as[1] not in leaving.get(str((epoch, batch)), []):
        return
    if args.exit_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"scheduled exit at epoch {epoch} batch {batch}, start rank {started_as[1]}")


def end_of_epoch(state: hvd.elastic.ObjectState) -> None:
    """Rank 0's log line; then, if the schedule changes the hosts now, the driver's notice."""
    line = {
        "epoch": state.epoch,
        "batch": state.batch,
        "commits": state.commits,
        "hostname": started_as[0],
        "start_rank": started_as[1],
        "rank": hvd.rank(),
        "size": hvd.size(),
        "rendezvous": state.rendezvous,
    }
    with open(args.logfile, "a") as f:
        f.write(json.dumps(line) + "\n")
    now, then = (hosts_at.get(e, hosts_after) for e in (state.epoch, state.epoch + 1))
    if args.discovery_wait > 0 and now != then:
        # the notice must raise HostsUpdatedInterrupt even if its time is not newer than the
        # last one this rank saw
        state._last_updated_timestamp = 0
        deadline = time.monotonic() + args.discovery_wait
        while state._host_messages.empty():
            if time.monotonic() > deadline:
                wait = args.discovery_wait
                raise TimeoutError(f"no host-change notice from the driver in {wait} s")
            time.sleep(0.1)


@hvd.elastic.run
def train(state: hvd.elastic.ObjectState) -> None:
    state.rendezvous += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            maybe_leave(state.epoch, state.batch)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            state.batch += 1
            state.commits += 1
            state.commit()
        if hvd.rank() == 0:
            end_of_epoch(state)
        if args.epoch_wait > 0:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        state.commit()


def on_reset() -> None:
    for group in optimizer.param_groups:
        group["lr"] = base_lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0)
state.register_reset_callbacks([on_reset])
train(state)
