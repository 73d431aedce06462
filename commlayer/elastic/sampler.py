"""ElasticSampler: shards a dataset over the ranks and resumes an epoch where the last commit left
it (Horovod's ``hvd.elastic.ElasticSampler``)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from commlayer import runtime


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Like DistributedSampler; ``record_batch(batch_idx, batch_size)`` after each batch counts
    the samples processed by all ranks, so a TorchState that holds this sampler restores to the
    last committed position and the retried epoch skips what was done. ``set_epoch(e)`` at the
    end of an epoch starts the next (reshuffled with ``seed + epoch`` when ``shuffle``)."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.remaining_indices: list[int] = []
        self.num_replicas = self.rank = self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_num = int(state["processed_num"])
        self.reset()

    def reset(self) -> None:
        self.num_replicas, self.rank = runtime.size(), runtime.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        if indices:  # pad by repeating, so every rank gets num_samples
            indices += (indices * math.ceil(self.total_size / len(indices)))[
                : self.total_size - len(indices)
            ]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
