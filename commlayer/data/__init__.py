"""Partial-local shuffling (issue 24): shard stores, and the exchange of a fraction Q of every
rank's shard per epoch through commlayer's collectives.

    from commlayer.data import PartialLocalShuffler, ShardStore
    store = ShardStore.from_dataset(dataset, path="/local/shard{rank}")  # or ShardStore(path)
    shuffler = PartialLocalShuffler(store, fraction=0.1, seed=0)  # same arguments on every rank
    loader = DataLoader(shuffler.dataset, batch_size=b, sampler=shuffler.sampler)
    for epoch in range(epochs):
        shuffler.set_epoch(epoch)  # commits the last epoch's exchange, plans this one's
        for x, y in loader: ...    # Q of the shard moves to other ranks meanwhile
        hvd.join()                 # shards may differ by a sample: uneven batch counts

``path=None`` keeps the shard in memory; with a path the samples are kept in append-only pack
files with an index (packs.py: 32 bytes per sample, the files within 10% of the samples' own
bytes), and a job run again opens the stores its last run left (``overwrite=True`` writes them
anew; a log line says which). The sampler yields global sample ids; the dataset reads them from
this rank's store. The exchange's reading, packing and writing run on the shuffler's I/O thread;
``shuffler.stats()`` says per epoch what moved and how much of it the training thread waited for.
"""

from commlayer.data.shuffler import PartialLocalShuffler, ShardDataset, ShuffleSampler
from commlayer.data.store import ShardStore

__all__ = ["PartialLocalShuffler", "ShardDataset", "ShardStore", "ShuffleSampler"]
