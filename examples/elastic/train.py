"""Elastic training: keeps training when workers die or hosts come and go.

    commlayerrun -np 2 --min-np 1 --max-np 3 --blacklist-cooldown-range 2 4 \
        --host-discovery-script examples/elastic/discover_hosts.sh \
        python examples/elastic/train.py --epochs 200

The discovery script names this machine twice (localhost and 127.0.0.1, one slot each), as
Horovod's tests do. Kill a worker (``kill -9 PID``): its host is blacklisted, the other worker
stops at its next collective or commit, goes on alone from the last commit (kept in memory: no
checkpoint file), and once the cooldown ends (4 s here, longer after each failure of that host)
a new worker starts there and the world grows back to 2, the newcomer taking rank 0's state.
Or edit the hosts file the discovery script reads (``ELASTIC_HOSTS_FILE``, e.g. ``localhost:3``
then ``localhost:2``). The sampler deals what is left of the epoch over the new number of
workers, and the learning rate follows the number of workers.

Rank 0 prints each epoch's loss and the number of workers; each worker prints
``rank R of N: parameter checksum X`` at the end: every rank prints the same checksum.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import commlayer as hvd
from commlayer import elastic

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--commit-every", type=int, default=4, help="batches between commits")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
features = torch.randn(512, 8)
labels = (features.sum(dim=1) > 0).long()
dataset = torch.utils.data.TensorDataset(features, labels)

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
BASE_LR = 0.01
optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
# No broadcast here: elastic.run syncs the state from rank 0 before training, and again after
# every re-formation (new workers included).
state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)


def on_reset() -> None:
    """After a re-formation: the learning rate follows the number of workers."""
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * hvd.size()


state.register_reset_callbacks([on_reset])


@elastic.run
def train(state: elastic.TorchState) -> None:
    for epoch in range(state.epoch, args.epochs):
        state.epoch = epoch
        for batch, (x, y) in enumerate(loader):
            state.batch = batch
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            sampler.record_batch(state.batch, args.batch_size)
            if state.batch % args.commit_every == 0:
                state.commit()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}: loss {loss.item():.4f} on {hvd.size()} workers")
        sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"rank {hvd.rank()} of {hvd.size()}: parameter checksum {checksum:.10f}")
