"""Train a LightningModule on commlayer: ``CommlayerStrategy`` in the Trainer.

    commlayerrun -np 2 python examples/lightning_trainer.py
    torchrun --standalone --nproc_per_node 2 examples/lightning_trainer.py

One process per rank (``devices=1``; the launcher makes the ranks): the strategy broadcasts
rank 0's weights, wraps the optimizer in DistributedOptimizer, gives each rank its shard of the
data (Lightning's DistributedSampler) and averages what is logged with ``sync_dist=True``.
Each rank prints its number of batches an epoch (its shard) and a checksum of its weights; rank
0 then prints the logged loss, the accuracy on the whole data set (from 50%, chance) and whether
every rank holds the same weights. Needs Lightning: ``pip install -e ".[lightning]"``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import commlayer as hvd
from commlayer.integrations.lightning import CommlayerStrategy


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)
        )

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # averaged over the ranks
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--compression", default=None, help="fp16, topk:ratio=0.01, ...")
    args = parser.parse_args()
    hvd.init()  # here for hvd.rank() below; else the strategy would call it in fit()
    torch.manual_seed(0)  # the same data set on every rank; the label: feature 0's sign
    features = torch.randn(512, 20)
    data = TensorDataset(features, (features[:, 0] > 0).long())
    torch.manual_seed(1 + hvd.rank())  # different first weights: the strategy broadcasts rank 0's
    model = Classifier(lr=0.05 * hvd.size())  # the strategy does not scale the rate: do it here
    trainer = pl.Trainer(
        strategy=CommlayerStrategy(compression=args.compression),
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(
        f"rank {hvd.rank()} of {hvd.size()}: {trainer.num_training_batches} batches an epoch, "
        f"parameter checksum {checksum:.10f}",
        flush=True,
    )
    same = len(set(hvd.allgather_object(checksum))) == 1
    if hvd.rank() == 0:
        with torch.no_grad():
            accuracy = float((model.net(features).argmax(1) == data.tensors[1]).float().mean())
        print(
            f"{args.epochs} epochs: train_loss {float(trainer.callback_metrics['train_loss']):.4f} "
            f"(the last step's, averaged over the ranks), accuracy on the whole set "
            f"{accuracy:.1%}; {hvd.size()} ranks, "
            + ("the same weights on every rank" if same else "DIFFERENT weights"),
            flush=True,
        )


if __name__ == "__main__":
    main()
