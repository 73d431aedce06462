"""Partial-local shuffling across the namespace cluster's hosts (tests/system/test_cluster.py's
cluster, started by tests/system/test_cluster_shuffle.py through ``commlayerrun -H
node1:2,node2:2``): the issue's loop as a user writes it, with files stores under <folder>,
shards cut by class (rank r holds a contiguous block of ids), a training step's allreduce per
batch and join() for the uneven shards. Each rank reports its host, what it visited in each
epoch (ids and the values read for them) and its store's ids after the last exchange.
"""

from __future__ import annotations

import os
import socket
import sys

import _worker
import torch
import torch.nn.functional as F  # noqa: N812

import commlayer as cl
from commlayer.data import PartialLocalShuffler, ShardStore

N, EPOCHS = 203, 3  # N not divisible by 4: uneven shards

_worker.start()
cl.init()
data = [(torch.full((16,), float(i)), i % 4) for i in range(N)]
store = ShardStore.from_dataset(
    data, path=os.path.join(sys.argv[1], "shard{rank}"), partition_by="given"
)
initial = store.ids()
shuffler = PartialLocalShuffler(store, fraction=0.3, seed=0, chunks=3)
loader = torch.utils.data.DataLoader(shuffler.dataset, batch_size=8, sampler=shuffler.sampler)
model = torch.nn.Linear(16, 4)
optimizer = cl.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
visited = []
for epoch in range(EPOCHS):
    shuffler.set_epoch(epoch)
    values = []
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        values += [int(v) for v in x[:, 0]]
    cl.join()
    visited.append(values)
shuffler.set_epoch(EPOCHS)  # commits the last exchange
sent_bytes = sum(int(s["sent_bytes"]) for s in shuffler.stats())
_worker.report(
    "shuffle",
    hostname=socket.gethostname(),
    initial=initial,
    visited=visited,
    final=store.ids(),
    sent_bytes=sent_bytes,
)
cl.shutdown()
_worker.report("done")
