"""The smallest commlayer training script: DistributedOptimizer with a DistributedSampler.

    commlayerrun -np 2 python examples/minimal.py
    torchrun --standalone --nproc_per_node 2 examples/minimal.py

Every rank makes the same synthetic data set (the label: the sign of the first feature), reads
its own shard of it (the sampler), starts from rank 0's weights, and DistributedOptimizer
averages the gradients while backward runs. Rank 0 prints the loss of each epoch averaged over
the ranks (it falls: 0.64, 0.50, 0.40 at 2 ranks), each rank's checksum of its weights, and
whether they are the same on every rank, as averaged gradients make them.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import commlayer as hvd  # commlayer

hvd.init()  # commlayer: this process joins the others
torch.manual_seed(0)  # the same data set on every rank
features = torch.randn(1024, 20)
data = TensorDataset(features, (features[:, 0] > 0).long())
sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())  # commlayer
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())  # commlayer: scaled
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # commlayer: rank 0's weights
# commlayer: gradients averaged over the ranks while backward runs
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
for epoch in range(3):
    sampler.set_epoch(epoch)
    total = torch.zeros(())
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # reductions start while backward runs
        optimizer.step()  # waits for what is still in flight
        total += loss.detach()
    mean = hvd.allreduce(total / len(loader), name="loss")  # this epoch's, over every rank
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {mean:.4f}", flush=True)

checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
checksums = hvd.allgather_object(checksum)  # every rank's, in rank order, on every rank
if hvd.rank() == 0:  # one rank prints: the lines of several would come out interleaved
    for rank, value in enumerate(checksums):
        print(f"rank {rank} of {hvd.size()}: parameter checksum {value:.10f}")
    same = len(set(checksums)) == 1
    ranks = f"{hvd.size()} rank" + ("s" if hvd.size() > 1 else "")
    print(f"{ranks}, " + ("the same weights on every rank" if same else "DIFFERENT weights: "
          "the gradients were not averaged"), flush=True)  # fmt: skip
