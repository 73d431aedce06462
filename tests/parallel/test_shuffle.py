"""Partial-local shuffling (issue 24) under real MPI, at any number of ranks.

The invariants: after every epoch the stores together hold the dataset, no sample lost or
duplicated, with every shard's size unchanged; every sample is visited once per epoch across
ranks; no store holds more than (1 + Q) times its shard while an exchange is in flight; the
same seed gives the same shards; Q = 0 moves nothing, Q = 1 deals all samples anew. Then the
uneven-shard join() path, files on disk, recovery of an interrupted exchange, resume from
state_dict, and bad input failing on every rank with the rank named.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import commlayer as cl
from commlayer.common.errors import ShardStoreError, ShuffleMismatchError
from commlayer.data import PartialLocalShuffler, ShardStore
from commlayer.data.exchange import Exchange

EPOCHS = 3


def _dataset(n: int) -> list[tuple[torch.Tensor, int]]:
    # samples of different sizes: the exchange moves variable-length records
    return [(torch.full((1 + i % 4,), float(i)), i % 5) for i in range(n)]


def _samples(size: int) -> int:
    return 7 * size + (size > 1)  # N not divisible by M: uneven shards


def _everyone(value: Any) -> list[Any]:
    return cl.allgather_object(value)


def _first_number(sample: Any) -> int:
    while not (isinstance(sample, torch.Tensor) and sample.dim() == 0):
        sample = sample[0]
    return int(sample)


def _run_epochs(shuffler: PartialLocalShuffler, epochs: int) -> list[dict[str, Any]]:
    """Per epoch: what this rank visited, its store during and after the exchange."""
    seen = []
    for epoch in range(epochs):
        shuffler.set_epoch(epoch)
        visited = list(shuffler.sampler)
        during = len(shuffler.store.ids()) + len(shuffler.store.staged())
        values = [_first_number(shuffler.dataset[i]) for i in visited]
        seen.append({"visited": visited, "values": values, "held": during})
    shuffler.set_epoch(epochs)  # commits the last epoch's exchange
    seen.append({"visited": [], "values": [], "held": 0})
    return seen


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("partition", ["given", "random"])
def test_every_sample_once_per_epoch(fraction: float, partition: str) -> None:
    n = _samples(cl.size())
    data = _dataset(n)
    store = ShardStore.from_dataset(data, partition_by=partition)
    initial = store.ids()
    shuffler = PartialLocalShuffler(store, fraction=fraction, seed=3, chunks=3)
    sizes = list(shuffler.shard_sizes)
    epochs = _everyone(_run_epochs(shuffler, EPOCHS))
    final = _everyone(store.ids())
    moved = _everyone(len(set(initial) - set(store.ids())))

    for epoch in range(EPOCHS):
        visited = [i for rank in epochs for i in rank[epoch]["visited"]]
        assert sorted(visited) == list(range(n)), f"epoch {epoch}: visited {sorted(visited)}"
        for rank, per_epoch in enumerate(epochs):
            assert per_epoch[epoch]["values"] == per_epoch[epoch]["visited"], f"rank {rank}"
            bound = math.floor((1 + fraction) * sizes[rank])
            assert per_epoch[epoch]["held"] <= bound, f"rank {rank} epoch {epoch}"
    assert sorted(i for ids in final for i in ids) == list(range(n))
    assert [len(ids) for ids in final] == sizes, "shard sizes must not change"
    if fraction == 0.0 or cl.size() == 1:
        assert sum(moved) == 0
    else:
        assert sum(moved) > 0


def test_same_seed_same_shards_other_seed_other_shards() -> None:
    n = 12 * cl.size()
    data = _dataset(n)
    shards = []
    for seed in (5, 5, 6):
        shuffler = PartialLocalShuffler(ShardStore.from_dataset(data), fraction=0.5, seed=seed)
        _run_epochs(shuffler, 2)
        shards.append(shuffler.store.ids())
    orders = []
    for seed in (5, 5, 6):
        shuffler = PartialLocalShuffler(ShardStore.from_dataset(data), fraction=0.0, seed=seed)
        orders.append(list(shuffler.sampler))
    assert shards[0] == shards[1] and orders[0] == orders[1]
    assert orders[0] != orders[2]
    if cl.size() > 1:
        assert _everyone(shards[0]) != _everyone(shards[2])


def test_full_fraction_deals_like_a_global_shuffle() -> None:
    # Q = 1: each epoch's shards are a fresh random cut of the dataset; about 1/M of a shard
    # stays (its samples dealt to their own rank). 60 samples per rank keep the count near.
    if cl.size() == 1:
        pytest.skip("one rank: nothing to deal")
    n = 60 * cl.size()
    store = ShardStore.from_dataset(_dataset(n), partition_by="given")
    before = set(store.ids())
    shuffler = PartialLocalShuffler(store, fraction=1.0, seed=0)
    _run_epochs(shuffler, 1)
    kept = _everyone(len(before & set(store.ids())))
    expected = 60 / cl.size()
    assert all(abs(k - expected) < 4 * math.sqrt(expected) + 1 for k in kept), kept


def test_uneven_shards_with_allreduce_and_join() -> None:
    # Rank r has more samples than rank r-1: batches per rank differ, and a training step's
    # allreduce runs between the exchange's chunks; the ranks with fewer batches join.
    size = cl.size()
    shards = [list(range(sum(range(4, 4 + r)), sum(range(4, 5 + r)))) for r in range(size)]
    n = sum(len(s) for s in shards)
    shuffler = PartialLocalShuffler(
        ShardStore.from_dataset(_dataset(n), partition_by=shards), fraction=0.5, seed=1, chunks=2
    )
    loader = torch.utils.data.DataLoader(
        shuffler.dataset, batch_size=3, sampler=shuffler.sampler, collate_fn=list
    )
    visited: list[list[int]] = []
    for epoch in range(2):
        shuffler.set_epoch(epoch)
        visited.append([])
        for batch in loader:
            cl.allreduce(torch.ones(1), name="shuffle.join.step")
            visited[-1] += [int(x[0]) for x, _ in batch]
        cl.join()
    shuffler.set_epoch(2)
    gathered = _everyone(visited)
    final = _everyone(shuffler.store.ids())
    for epoch in range(2):
        assert sorted(i for rank in gathered for i in rank[epoch]) == list(range(n))
    assert [len(ids) for ids in final] == [len(s) for s in shards]


def test_files_resume_and_state_dict(tmp_path: Path) -> None:
    n = _samples(cl.size())
    path = tmp_path / "shard{rank}"
    store = ShardStore.from_dataset(_dataset(n), path=path)
    shuffler = PartialLocalShuffler(store, fraction=0.4, seed=2, chunks=2)
    _run_epochs(shuffler, 2)
    state = shuffler.state_dict()
    # a new process opens what is on disk and resumes
    again = PartialLocalShuffler(ShardStore(path), fraction=0.4, seed=2, chunks=2)
    again.load_state_dict(state)
    order = list(again.sampler)
    again.set_epoch(state["epoch"] + 1)
    visited = _everyone(order)
    final = _everyone(again.store.ids())
    assert state["epoch"] == 2 and again.epoch == 3
    assert sorted(i for ids in visited for i in ids) == list(range(n))
    assert sorted(i for ids in final for i in ids) == list(range(n))
    assert again.dataset[final[cl.rank()][0]][0][0] == final[cl.rank()][0]


class _Died(Exception):
    """A process dying in the middle of a commit, as far as its files can tell."""


def _make_store(tmp_path: Path, layout: str, n: int) -> tuple[str, ShardStore]:
    """Stores of ``n`` samples whose first number is their original index, in ``layout``."""
    import numpy as np
    from PIL import Image

    mine = list(range(n))[cl.rank() :: cl.size()]
    if layout == "files":
        path = str(tmp_path / "shard{rank}")
        return path, ShardStore.from_dataset(_dataset(n), path=path)
    if layout == "imagefolder":
        folder = tmp_path / f"img{cl.rank()}"
        for i in mine:
            (folder / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (1, 1), (i, 0, 0)).save(folder / f"c{i % 3}" / f"s{i:03d}.png")
        path = str(tmp_path / "img{rank}")
    else:
        path = str(tmp_path / "shard{rank}.npz")
        np.savez(path.format(rank=cl.rank()), x=np.array(mine, dtype=np.float32)[:, None])
    return path, ShardStore(path)


@pytest.mark.parametrize("layout", ["files", "imagefolder", "npz"])
@pytest.mark.parametrize("when", ["back", "forward", "midcommit"])
def test_interrupted_exchange_recovers(tmp_path: Path, layout: str, when: str) -> None:
    # Every rank staged its part of epoch 0's exchange and "died" before phase 2; rank 0, in
    # the forward case, after committing, and in the midcommit case halfway through taking in
    # what it received. Reopening rolls every rank back, or forward when any rank had
    # committed, and no sample is lost, duplicated or changed either way.
    n = _samples(cl.size())
    path, store = _make_store(tmp_path, layout, n)
    before = {i: _first_number(store.load(i)) for i in store.ids()}
    shuffler = PartialLocalShuffler(store, fraction=0.5, seed=4)
    exchange, died = shuffler._exchange, None
    if exchange is not None:  # None at one rank
        exchange.finish()
        store.prepare(0, exchange.plan.sent_ids, store.staged())
        if when != "back" and cl.rank() == 0:
            take, taken, last = store.layout.take, [], len(store.staged()) - 1
            if when == "midcommit":

                def dying_take(sample_id: int) -> None:
                    if len(taken) == min(1, last):
                        raise _Died
                    taken.append(sample_id)
                    take(sample_id)

                store.layout.take = dying_take  # type: ignore[method-assign]
            try:
                store.commit()
            except _Died:
                died = len(taken)
    cl.barrier()
    recovered = PartialLocalShuffler(ShardStore(path), fraction=0.5, seed=4)
    now = {i: _first_number(recovered.store.load(i)) for i in recovered.store.ids()}
    final, first = _everyone(now), _everyone(before)
    staged = recovered.store.staged() + recovered.store.stray_files()

    assert sorted(i for d in final for i in d) == sorted(i for d in first for i in d)
    merged = {i: v for d in first for i, v in d.items()}
    assert all(merged[i] == v for d in final for i, v in d.items()), "a sample changed"
    assert sorted(merged.values()) == list(range(n))
    if when == "back":
        assert now == before
    if when == "midcommit" and cl.rank() == 0 and exchange is not None:
        assert died is not None, "the commit was to die midway"
    assert not staged


@pytest.mark.parametrize("layout", ["files", "imagefolder", "npz"])
def test_persistent_dataloader_workers_read_what_each_exchange_brought(
    tmp_path: Path, layout: str
) -> None:
    # A persistent worker keeps the store as it was when it started: it must still find the
    # samples later exchanges took in (the ImageFolder index is reread from disk).
    n = _samples(cl.size())
    _, store = _make_store(tmp_path, layout, n)
    shuffler = PartialLocalShuffler(store, fraction=0.5, seed=5, chunks=2)
    loader = torch.utils.data.DataLoader(
        shuffler.dataset,
        batch_size=4,
        sampler=shuffler.sampler,
        num_workers=1,
        persistent_workers=True,
        collate_fn=list,
    )
    seen = []
    for epoch in range(3):
        shuffler.set_epoch(epoch)
        seen.append([_first_number(sample) for batch in loader for sample in batch])
    shuffler.set_epoch(3)
    everyone = _everyone(seen)
    for epoch in range(3):
        assert sorted(v for rank in everyone for v in rank[epoch]) == list(range(n)), epoch


def test_bad_fraction_is_refused_before_any_collective() -> None:
    store = ShardStore.from_dataset(_dataset(4))
    for fraction in (-0.1, 1.5, float("nan"), "0.1"):
        with pytest.raises(ValueError, match=rf"rank {cl.rank()}: fraction {fraction!r}"):
            PartialLocalShuffler(store, fraction=fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize("setting", ["fraction", "seed"])
def test_settings_differing_across_ranks_fail_on_every_rank(setting: str) -> None:
    if cl.size() == 1:
        pytest.skip("one rank cannot differ from another")
    store = ShardStore.from_dataset(_dataset(4 * cl.size()))
    kwargs: dict[str, Any] = {"fraction": 0.1, "seed": 0}
    if cl.rank() == 1:
        kwargs[setting] = {"fraction": 0.2, "seed": 1}[setting]
    with pytest.raises(ShuffleMismatchError, match=rf"same {setting} on every rank.*rank 1: "):
        PartialLocalShuffler(store, **kwargs)


@pytest.mark.parametrize("path", [False, True])
def test_datasets_of_different_lengths_fail_on_every_rank(path: bool, tmp_path: Path) -> None:
    if cl.size() == 1:
        pytest.skip("one rank cannot differ from another")
    data = _dataset(4 * cl.size() + (1 if cl.rank() == 1 else 0))
    where = str(tmp_path / "shard{rank}") if path else None
    with pytest.raises(ShuffleMismatchError, match=r"same dataset on every rank.*rank 1: \d+"):
        ShardStore.from_dataset(data, path=where)


def test_overlapping_stores_fail_on_every_rank() -> None:
    if cl.size() == 1:
        pytest.skip("one rank cannot overlap another")
    data = _dataset(4 * cl.size())
    store = ShardStore.from_dataset(data, partition_by=[[0, 1]] * cl.size())
    with pytest.raises(ShuffleMismatchError, match="sample 0 is in the stores of ranks 0 and 1"):
        PartialLocalShuffler(store, fraction=0.1)


def test_unreadable_sample_fails_on_every_rank_naming_rank_and_file(tmp_path: Path) -> None:
    if cl.size() == 1:
        pytest.skip("one rank sends nothing")
    path = tmp_path / "shard{rank}"
    store = ShardStore.from_dataset(_dataset(8 * cl.size()), path=path)
    shuffler = PartialLocalShuffler(store, fraction=1.0, seed=0, chunks=2)
    assert shuffler._exchange is not None
    if cl.rank() == 0:  # the pack is cut short before a sample rank 0 must send
        sample = shuffler._exchange.plan.sends[1][0][0]
        pack, offset, _ = store.layout.packs.index[sample]  # type: ignore[union-attr]
        os.truncate(store.layout.packs.pack_file(pack), offset + 4)  # type: ignore[union-attr]
    cl.barrier()
    with pytest.raises(
        ShardStoreError, match=r"rank 0: shard store: cannot read sample \d+ from .*truncated"
    ):
        list(shuffler.sampler)
    with pytest.raises(ShardStoreError, match="shard0/packs/1.pack"):
        shuffler.set_epoch(1)  # the exchange is aborted: every store as before
    assert not store.staged() and not store.stray_files()


def test_a_sample_lost_on_the_way_fails_the_vote_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last rank stages all but one of the samples it received: the vote fails on every
    # rank, naming that rank's counts, and every store is as before the exchange.
    if cl.size() == 1:
        pytest.skip("one rank receives nothing")
    last = cl.size() - 1
    store = ShardStore.from_dataset(_dataset(8 * cl.size()), path=tmp_path / "shard{rank}")
    before = store.ids()
    shuffler = PartialLocalShuffler(store, fraction=1.0, seed=0, chunks=2)
    if cl.rank() == last:
        stage, lost = Exchange._stage, []

        def losing(self: Exchange, sender: int, frame: bytes) -> None:
            stage(self, sender, frame)
            if not lost and self.received[sender]:
                lost.append(sender)
                self.received[sender] -= 1

        monkeypatch.setattr(Exchange, "_stage", losing)
    list(shuffler.sampler)
    with pytest.raises(ShuffleMismatchError, match=rf"incomplete \(rank {last} got .*expected"):
        shuffler.set_epoch(1)
    assert store.ids() == before
    assert not store.staged()


def test_opening_a_folder_without_a_store_names_it(tmp_path: Path) -> None:
    (tmp_path / f"nothing{cl.rank()}").mkdir()
    with pytest.raises(
        ShardStoreError, match=rf"rank {cl.rank()}: .*nothing{cl.rank()}'.* holds no"
    ):
        ShardStore(tmp_path / "nothing{rank}")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_an_image_folder_without_pillow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pillow is an extra ('commlayer[images]'): without it, opening an ImageFolder-like store
    # with the default loader fails at once on every rank, naming the rank and what to install;
    # a loader of the user's own needs no Pillow.
    folder = tmp_path / f"img{cl.rank()}" / "c0"
    folder.mkdir(parents=True)
    (folder / "s0.png").write_bytes(b"not decoded")
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL fails; find_spec gives None
    with pytest.raises(
        ShardStoreError,
        match=rf"rank {cl.rank()}: shard store: .*Pillow, which is not installed: "
        r"pip install 'commlayer\[images\]'",
    ):
        ShardStore(tmp_path / "img{rank}")
    store = ShardStore(tmp_path / "img{rank}", loader=lambda path: Path(path).read_bytes())
    assert [store.load(i)[0] for i in store.ids()] == [b"not decoded"]


def _check_moved(
    store: ShardStore, original: dict[int, Any], shuffler: PartialLocalShuffler
) -> tuple[dict[int, Any], list[dict[int, Any]]]:
    """After 2 epochs: every id once in all stores, each loading as it was first read."""
    _run_epochs(shuffler, 2)
    now = {i: _plain(store.load(i)) for i in store.ids()}
    every = _everyone(now)
    first = _everyone(original)
    merged = {i: v for d in first for i, v in d.items()}
    return merged, every


def _plain(sample: Any) -> Any:
    if isinstance(sample, torch.Tensor):
        return sample.tolist()
    return [_plain(x) for x in sample] if isinstance(sample, tuple | list) else sample


def test_image_folder_store_numbers_moves_and_reopens(tmp_path: Path) -> None:
    # Each rank's folder holds classes c<r> and c<r+1>, files named alike on every rank
    # (img<k>.png): ids are numbered rank by rank, classes over the union, and files of one
    # name from two ranks are both kept.
    from PIL import Image

    me, size = cl.rank(), cl.size()
    folder = tmp_path / f"img{me}"
    for k in range(3 + me):
        (folder / f"c{me + k % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (1, 1), (me, k, 7)).save(folder / f"c{me + k % 2}" / f"img{k}.png")
    store = ShardStore(tmp_path / "img{rank}")
    original = {i: _plain(store.load(i)) for i in store.ids()}
    first_id = sum(3 + r for r in range(me))
    shuffler = PartialLocalShuffler(store, fraction=0.5, seed=1)
    merged, every = _check_moved(store, original, shuffler)
    reopened = ShardStore(tmp_path / "img{rank}")
    again = {i: _plain(reopened.load(i)) for i in reopened.ids()}
    files = sorted(str(p.relative_to(folder)) for p in folder.glob("c*/*"))

    assert sorted(original) == list(range(first_id, first_id + 3 + me))
    assert original[first_id] == [[[[me]], [[0]], [[7]]], me]  # a 3x1x1 uint8 tensor, class
    assert {label for _, label in original.values()} == {me, me + 1}
    assert sorted(i for d in every for i in d) == sorted(merged)
    assert all(d[i] == merged[i] for d in every for i in d), "a sample changed on its way"
    assert again == every[me]
    assert len(files) == len(every[me]), f"files {files} against {sorted(every[me])}"
    assert all(
        f.endswith(".png") and f.split("/")[0] in {f"c{c}" for c in range(size + 1)} for f in files
    )


@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_array_file_store_numbers_moves_and_reopens(tmp_path: Path, suffix: str) -> None:
    import numpy as np

    me = cl.rank()
    rows = 4 + me
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 100 * me
    file = tmp_path / f"shard{me}{suffix}"
    if suffix == ".npz":
        np.savez(file, x=x, y=np.arange(rows) % 3)
    else:
        np.save(file, x)
    store = ShardStore(tmp_path / f"shard{{rank}}{suffix}")
    original = {i: _plain(store.load(i)) for i in store.ids()}
    shuffler = PartialLocalShuffler(store, fraction=0.5, seed=2, chunks=2)
    merged, every = _check_moved(store, original, shuffler)
    reopened = ShardStore(tmp_path / f"shard{{rank}}{suffix}")
    again = {i: _plain(reopened.load(i)) for i in reopened.ids()}

    first_id = sum(4 + r for r in range(me))
    row0 = [100.0 * me, 100.0 * me + 1]
    assert original[first_id] == ([row0, 0] if suffix == ".npz" else row0)
    assert sorted(i for d in every for i in d) == sorted(merged)
    assert all(d[i] == merged[i] for d in every for i in d), "a sample changed on its way"
    assert again == every[me]
    assert np.array_equal(np.load(file)["x"] if suffix == ".npz" else np.load(file), x), (
        "the array file is only read"
    )


def test_a_rank_that_cannot_open_its_store_fails_every_rank_naming_it(tmp_path: Path) -> None:
    import numpy as np

    bad = cl.size() - 1
    file = tmp_path / f"shard{cl.rank()}.npy"
    if cl.rank() == bad:
        file.write_bytes(b"not an array")
    else:
        np.save(file, np.zeros((2, 2)))
    with pytest.raises(
        ShardStoreError, match=rf"rank {bad}: shard store: cannot read .*shard{bad}"
    ):
        ShardStore(tmp_path / "shard{rank}.npy")


# -- pack files (issue 40) -------------------------------------------------------------------


def test_pack_store_stays_within_ten_percent_of_the_samples_bytes(tmp_path: Path) -> None:
    # 800 samples of ~1.1 kB per rank in pack files: after writing, and after each of three
    # exchanges at Q = 0.3 (each leaves the records sent away in the packs, 30% of the shard,
    # until the I/O thread compacts the packs), the store's files and folders take at most 10%
    # more disk blocks than the samples' own bytes.
    from commlayer.data.store import encode

    n = 800 * cl.size()
    data = [(torch.arange(256, dtype=torch.float32) + i, i % 7) for i in range(n)]
    store = ShardStore.from_dataset(data, path=tmp_path / "shard{rank}")
    sizes = [store.disk_bytes()]
    shuffler = PartialLocalShuffler(store, fraction=0.3, seed=0, chunks=2)
    for epoch in range(3):
        shuffler.set_epoch(epoch)  # commits the previous epoch's exchange
        list(shuffler.sampler)
    shuffler.set_epoch(3)
    if shuffler._exchange is not None:  # the I/O thread compacts as the next epoch starts
        shuffler._exchange.start()
        assert shuffler._exchange.compaction is not None
        shuffler._exchange.compaction.result()
    sizes.append(store.disk_bytes())
    own = sum(len(encode(data[i])) for i in store.ids())
    everyone = _everyone(sizes)
    stray = store.stray_files()

    assert sizes[-1][1] == own, "live bytes are the samples' encoded bytes"
    for rank, measured in enumerate(everyone):
        for on_disk, samples in measured:
            assert samples > 700 * 1000, f"rank {rank}: {samples} B of samples"
            assert on_disk <= 1.10 * samples, f"rank {rank}: {on_disk} B on disk for {samples}"
    assert not stray


def test_a_digits_sized_store_stays_within_ten_percent_and_compacts_little(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Digits-sized shards (360 samples per rank of a 1 x 8 x 8 float32 image and an int label:
    # 264 bytes of their own each) in packs of a sixteenth of the shard. After six exchanges
    # at Q = 0.1 and the compaction the next epoch starts with, the store's files (packs,
    # index, journal) take at most 10% more than the samples' own bytes; and since the oldest
    # packs are sent first and die whole, no compaction copies more than a fifth of the shard
    # (copying every pack with a hole, as before, was ~90% of it each epoch).
    from commlayer.data import packs

    monkeypatch.setattr(packs, "MIN_PACK_BYTES", 1024)
    n = 360 * cl.size()
    images = torch.arange(n * 64, dtype=torch.float32).reshape(n, 1, 8, 8) / n
    data = [(images[i], i % 10) for i in range(n)]
    store = ShardStore.from_dataset(data, path=tmp_path / "shard{rank}", partition_by="given")
    written = store.storage()
    shuffler = PartialLocalShuffler(store, fraction=0.1, seed=0)
    for epoch in range(6):
        shuffler.set_epoch(epoch)
        list(shuffler.sampler)
    shuffler.set_epoch(6)
    if shuffler._exchange is not None:  # the I/O thread compacts as the next epoch starts
        shuffler._exchange.start()
        assert shuffler._exchange.compaction is not None
        shuffler._exchange.compaction.result()
    storage = store.storage()
    own = (256 + 8) * len(store)
    copied = [s["compacted_bytes"] for s in shuffler.stats()]
    everyone = _everyone((written, storage, own, copied, store.stray_files()))

    for rank, (written, storage, own, copied, stray) in enumerate(everyone):
        assert storage["samples_bytes"] == own, f"rank {rank}: {storage}"
        for measured in (written, storage):
            assert measured["overhead"] <= 0.10, f"rank {rank}: {measured}"
        assert max(copied, default=0) <= own / 5, f"rank {rank}: compactions copied {copied}"
        assert not stray
    if cl.size() > 1:
        assert all(len(copied) == 6 for _, _, _, copied, _ in everyone)


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        ("index", "the index '{}' is truncated"),
        ("pack", "the pack '{}' is truncated"),
        ("header", "'{}' is not a pack index \\(malformed"),
    ],
)
def test_a_truncated_or_malformed_index_or_pack_fails_every_rank_naming_rank_and_file(
    tmp_path: Path, damage: str, what: str
) -> None:
    bad = cl.size() - 1
    path = tmp_path / "shard{rank}"
    store = ShardStore.from_dataset(_dataset(6 * cl.size()), path=path)
    packs = store.layout.packs  # type: ignore[union-attr]
    file = packs.pack_file(1) if damage == "pack" else packs.index_file(packs.gen)
    if cl.rank() == bad and damage == "header":
        with open(file, "r+b") as out:
            out.write(b"NOTINDEX")
    elif cl.rank() == bad:
        os.truncate(file, file.stat().st_size - 3)
    cl.barrier()
    name = f"[^']*shard{bad}/{file.relative_to(tmp_path / f'shard{cl.rank()}')}"
    with pytest.raises(ShardStoreError, match=rf"rank {bad}: shard store: " + what.format(name)):
        ShardStore(path)


def test_the_io_thread_does_the_exchange_and_stats_count_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading what is sent and writing what is received run on the shuffler's I/O thread, not
    # the training thread; stats() gives one entry per committed exchange, whose counts agree
    # across ranks (what all sent, all received).
    import threading

    from commlayer.data.exchange import THREAD_NAME
    from commlayer.data.layouts import PackFiles

    threads: set[str] = set()
    for method in ("dump", "stage"):
        original = getattr(ShardStore, method)

        def spy(self: ShardStore, *args: Any, _original: Any = original) -> Any:
            threads.add(threading.current_thread().name.split("_")[0])
            return _original(self, *args)

        monkeypatch.setattr(ShardStore, method, spy)
    n = _samples(cl.size())
    store = ShardStore.from_dataset(_dataset(n), path=tmp_path / "shard{rank}")
    shuffler = PartialLocalShuffler(store, fraction=0.5, seed=1, chunks=3)
    _run_epochs(shuffler, 2)
    stats = shuffler.stats()
    everyone = _everyone(stats)

    assert isinstance(store.layout, PackFiles)
    if cl.size() == 1:
        assert stats == [] and not threads
        return
    assert threads == {THREAD_NAME}, threads
    assert [[s["epoch"] for s in rank] for rank in everyone] == [[0, 1]] * cl.size()
    for epoch in range(2):
        per_rank = [rank[epoch] for rank in everyone]
        sent = sum(s["sent_samples"] for s in per_rank)
        assert sent > 0 and sent == sum(s["received_samples"] for s in per_rank)
        assert sum(s["sent_bytes"] for s in per_rank) == sum(s["received_bytes"] for s in per_rank)
        for s in per_rank:
            assert 0 <= s["hidden_s"] <= s["io_s"]
            parts = s["busy_s"] + s["wait_s"] + s["set_epoch_s"]
            assert s["waited_s"] == pytest.approx(parts)


def test_an_error_on_the_io_thread_reaches_every_rank_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last rank's disk is full when its I/O thread stages a received chunk: that rank
    # raises it at the end of its shard, naming itself, the thread and the chunk, with the
    # OSError as its cause; at set_epoch every rank raises it (the vote carries it), and every
    # store is as before the exchange.
    if cl.size() == 1:
        pytest.skip("one rank receives nothing")
    last = cl.size() - 1
    store = ShardStore.from_dataset(_dataset(8 * cl.size()), path=tmp_path / "shard{rank}")
    before = store.ids()
    shuffler = PartialLocalShuffler(store, fraction=1.0, seed=0, chunks=2)
    if cl.rank() == last:

        def full(sample_id: int, data: bytes) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(store.layout, "stage", full)
    first: ShardStoreError | None = None
    try:
        list(shuffler.sampler)
    except ShardStoreError as exc:
        first = exc
    with pytest.raises(ShardStoreError) as later:
        shuffler.set_epoch(1)

    named = rf"rank {last}: the shuffler's I/O thread failed staging chunk \d .*OSError: .*No space"
    if cl.rank() == last:
        assert first is not None and re.search(named, str(first)), first
        assert isinstance(first.__cause__, OSError)
    else:
        assert first is None
        assert "failed on another rank" in str(later.value)
    assert re.search(named, str(later.value)), later.value
    assert store.ids() == before
    assert not store.staged() and not store.stray_files()


def test_an_existing_store_is_opened_or_overwritten_as_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    n = _samples(cl.size())
    path = tmp_path / "shard{rank}"
    store = ShardStore.from_dataset(_dataset(n), path=path, partition_by="given")
    initial = store.ids()
    _run_epochs(PartialLocalShuffler(store, fraction=0.5, seed=0), 1)
    moved = store.ids()
    with caplog.at_level(logging.WARNING, logger="commlayer"):
        kept = ShardStore.from_dataset(_dataset(n), path=path, partition_by="given")
        opened = caplog.text
        caplog.clear()
        fresh = ShardStore.from_dataset(
            _dataset(n), path=path, partition_by="given", overwrite=True
        )
        replaced = caplog.text
    with pytest.raises(ShardStoreError, match=rf"hold {n} samples in all, the dataset {n + 1}"):
        ShardStore.from_dataset(_dataset(n + 1), path=path)

    assert kept.ids() == moved and kept.epoch == (1 if cl.size() > 1 else 0)
    assert fresh.ids() == initial and fresh.epoch == 0
    if cl.rank() == 0:
        assert "opening the existing shard stores" in opened and "overwrite=True" in opened
        assert "replacing the existing shard stores" in replaced and "overwrite=True" in replaced
    else:
        assert "shard stores" not in opened + replaced


def test_a_compaction_dying_midway_leaves_the_store_as_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After epoch 0's exchange is committed, rank 0 "dies" compacting its packs: the new pack is
    # written, the index naming it is not saved. Reopening finds every sample once, as it was,
    # and removes the half-done compaction's pack.
    from commlayer.data.packs import PackSet

    n = 12 * cl.size()
    path = tmp_path / "shard{rank}"
    store = ShardStore.from_dataset(_dataset(n), path=path)
    before = {i: _first_number(store.load(i)) for i in store.ids()}
    shuffler = PartialLocalShuffler(store, fraction=0.5, seed=4)
    exchange = shuffler._exchange
    left: set[str] = set()
    if exchange is not None:  # None at one rank
        exchange.finish()
        store.prepare(0, exchange.plan.sent_ids, store.staged())
        store.commit()
        if cl.rank() == 0:
            compact = PackSet.compact

            def dying(self: PackSet) -> bool:
                assert compact(self), "Q = 0.5 leaves the packs due a compaction"
                raise _Died

            monkeypatch.setattr(PackSet, "compact", dying)
            packs = tmp_path / "shard0" / "packs"
            earlier = set(os.listdir(packs))
            with pytest.raises(_Died):
                store.compact()
            left = set(os.listdir(packs)) - earlier  # the compaction's new pack
            monkeypatch.undo()
    cl.barrier()
    recovered = PartialLocalShuffler(ShardStore(path), fraction=0.5, seed=4)
    now = {i: _first_number(recovered.store.load(i)) for i in recovered.store.ids()}
    final, first = _everyone(now), _everyone(before)
    stray = recovered.store.stray_files()

    merged = {i: v for d in first for i, v in d.items()}
    assert sorted(i for d in final for i in d) == list(range(n))
    assert all(merged[i] == v for d in final for i, v in d.items()), "a sample changed"
    if cl.rank() == 0 and exchange is not None:
        assert left, "the compaction was to leave its pack behind"
    assert recovered.store.epoch == (1 if cl.size() > 1 else 0)
    assert not stray
