"""Partial-local shuffling (issue 24): shard stores, and the exchange of a fraction Q of every
rank's shard per epoch through commlayer's collectives."""

from commlayer.data.shuffler import PartialLocalShuffler, ShardDataset, ShuffleSampler
from commlayer.data.store import ShardStore

__all__ = ["PartialLocalShuffler", "ShardDataset", "ShardStore", "ShuffleSampler"]
