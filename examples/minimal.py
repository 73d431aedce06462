"""The smallest commlayer training script: DistributedOptimizer with a DistributedSampler.

    commlayerrun -np 2 python examples/minimal.py
    torchrun --standalone --nproc_per_node 2 examples/minimal.py

Every rank makes the same synthetic data set, reads its own shard of it (the sampler), starts
from rank 0's weights, and DistributedOptimizer averages the gradients, so the ranks end with
the same weights: each prints a checksum of them, the same on every rank.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import commlayer as hvd

hvd.init()
torch.manual_seed(0)  # the same data set on every rank
data = TensorDataset(torch.randn(1024, 20), torch.randint(0, 2, (1024,)))
sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())  # a shard each
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the same start on every rank
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # gradients are reduced while backward runs
        optimizer.step()  # waits for what is still in flight

checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"rank {hvd.rank()} of {hvd.size()}: parameter checksum {checksum:.10f}", flush=True)
