"""ElasticSampler: shards a dataset over the ranks and resumes an epoch where the last commit left
it, at whatever size the world has then (Horovod's ``hvd.elastic.ElasticSampler``).

As Horovod's: each rank records the indices it processed (``record_batch``); a commit gathers
every rank's record into one set (TorchState's sampler handler), and ``reset()`` partitions the
indices not yet processed over the current ranks. After a re-formation at another size, the
epoch goes on with no sample processed twice and none skipped; only the padding that evens out
the last partition (repeats of remaining samples, as DistributedSampler pads) can repeat one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from commlayer.core import runtime


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Like DistributedSampler; call ``record_batch(batch_idx, batch_size)`` after each batch
    (``batch_idx`` counted from 0 in the current iteration over the sampler), so a TorchState
    that holds this sampler restores to the last committed position and the retried epoch
    skips what was done. ``set_epoch(e)`` at the end of an epoch starts the next (reshuffled
    with ``seed + epoch`` when ``shuffle``)."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.remaining_indices: list[int] = []
        self.num_replicas = self.rank = self.num_samples = self.total_size = 0
        self.reset()

    @property
    def processed_num(self) -> int:
        return len(self.processed_indices)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record the ``batch_idx``-th batch of ``batch_size`` samples of this rank's part as
        processed."""
        start = batch_idx * batch_size
        self.record_indices(self._mine()[start : start + batch_size])

    def record_indices(self, indices: list[int]) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Partition what is left of the epoch over the ranks of the current world."""
        self.num_replicas, self.rank = runtime.size(), runtime.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = [i for i in indices if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _mine(self) -> list[int]:
        indices = list(self.remaining_indices)
        if indices:  # pad by repeating, so every rank gets num_samples
            indices += (indices * math.ceil(self.total_size / len(indices)))[
                : self.total_size - len(indices)
            ]
        return indices[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine())

    def __len__(self) -> int:
        return self.num_samples
