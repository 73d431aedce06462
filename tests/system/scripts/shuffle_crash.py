"""A rank dies during partial-local shuffling's exchange; a new job resumes from the stores.

``crash <folder> <when>``: every rank builds stores of N samples under <folder>/shard{rank} and
runs epoch 0, then in epoch 1 rank 1 dies (``os._exit``, no goodbye): ``mid`` halfway through
its shard, some chunks of the exchange sent and staged, none committed; ``committing`` in
phase 2, after it recorded the commit and before it moved a file. ``resume <folder>``: opens
the stores (recovering the interrupted exchange), reports each rank's samples, runs one epoch
and reports what it visited. The stores are pack files (issue 40): received samples appended to
a staging pack, the index replaced at the commit.
"""

from __future__ import annotations

import os
import sys

import _worker
import torch

import commlayer as hvd
from commlayer.data import PartialLocalShuffler, ShardStore

N = 41
SETTINGS = {"fraction": 0.5, "seed": 3, "chunks": 4}

_worker.start()
mode, folder = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
path = os.path.join(folder, "shard{rank}")


class DyingStore(ShardStore):
    """Rank 1's store in the ``committing`` case: dies right after recording the commit of
    epoch 1's exchange (in ``set_epoch(2)``)."""

    __slots__ = ()

    def _save(self) -> None:
        super()._save()
        pending = self._pending
        if pending is not None and pending["state"] == "committed" and pending["epoch"] == 1:
            _worker.report("dying")
            os._exit(1)


if mode == "crash":
    when = sys.argv[3]
    data = [(torch.full((3,), float(i)), i % 4) for i in range(N)]
    kind = DyingStore if rank == 1 and when == "committing" else ShardStore
    store = kind.from_dataset(data, path=path, partition_by="given")
    shuffler = PartialLocalShuffler(store, **SETTINGS)
    list(shuffler.sampler)
    shuffler.set_epoch(1)
    for position, _ in enumerate(shuffler.sampler):
        if rank == 1 and when == "mid" and position == 10:
            _worker.report("dying")
            os._exit(1)
    shuffler.set_epoch(2)
    _worker.report("not killed")
else:
    shuffler = PartialLocalShuffler(ShardStore(path), **SETTINGS)
    stray = [str(f) for f in shuffler.store.stray_files()] + shuffler.store.staged()
    _worker.report(
        "stores",
        ids=shuffler.store.ids(),
        epoch=shuffler.epoch,
        staged=stray,
        layout=shuffler.store.layout.kind,
    )
    visited = list(shuffler.sampler)
    values = [int(shuffler.dataset[i][0][0]) for i in visited]
    _worker.report("visited", ids=visited, values=values)
hvd.shutdown()
_worker.report("done")
