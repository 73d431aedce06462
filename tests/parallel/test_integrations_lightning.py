"""commlayer.integrations.lightning (issue #7): a LightningModule trained on the digits data
with ``CommlayerStrategy`` under mpiexec. Skipped where Lightning is not installed
(``pip install "commlayer[lightning]"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as cl

pl = pytest.importorskip("lightning.pytorch")
datasets = pytest.importorskip("sklearn.datasets")

from commlayer.integrations.lightning import CommlayerStrategy  # noqa: E402


class Digits(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_lightning_trains_digits_with_commlayer(tmp_path: Path) -> None:
    x, y = datasets.load_digits(return_X_y=True)
    x_t, y_t = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    train = torch.utils.data.TensorDataset(x_t[:1400], y_t[:1400])
    torch.manual_seed(cl.rank())  # different initial weights: the strategy must broadcast them
    model = Digits()
    trainer = pl.Trainer(
        strategy=CommlayerStrategy(),
        accelerator="cpu",
        devices=1,
        max_epochs=3 * cl.size(),  # ~130 optimizer steps at any size
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=32, shuffle=True))
    with torch.no_grad():
        accuracy = float((model.net(x_t[1400:]).argmax(1) == y_t[1400:]).float().mean())
    params = cl.allgather_object([p.detach().clone() for p in model.parameters()])
    batches = cl.allgather_object(trainer.num_training_batches)
    same = all(torch.equal(a, b) for other in params for a, b in zip(other, params[0]))
    assert same, "parameters differ between ranks"
    # DistributedSampler: each rank sees its 1/size share of the 1400 rows.
    assert batches == [-(-1400 // cl.size() // 32)] * cl.size() or cl.size() == 1, batches
    assert accuracy > 0.85, accuracy  # held-out rows; 0.88-0.92 measured at 1-4 ranks
    assert all(hasattr(opt, "synchronize") for opt in trainer.strategy.optimizers)
