"""ElasticSampler resumes an epoch after a re-formation at another size with no sample processed
twice and none skipped (issue 38), as Horovod's does: the ranks' records of processed indices
are merged at a commit (as TorchState's sampler handler does) and what is left is partitioned
over the new world. The worlds are simulated: each rank a sampler of its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from commlayer.elastic import sampler as sampler_module

BATCH = 4


def _world(monkeypatch: pytest.MonkeyPatch, size: int, states: list[dict] | None) -> list:
    """One sampler per rank of a world of ``size``, loaded with ``states[rank]`` if given."""
    samplers = []
    for rank in range(size):
        monkeypatch.setattr(
            sampler_module, "runtime", SimpleNamespace(size=lambda s=size: s, rank=lambda r=rank: r)
        )
        s = sampler_module.ElasticSampler(list(range(70)), shuffle=True, seed=3)
        if states is not None:
            s.load_state_dict(states[rank])
        samplers.append(s)
    return samplers


def _commit(samplers: list) -> list[dict]:
    """What a commit keeps on each rank: the union of every rank's record."""
    union = sorted({i for s in samplers for i in s.state_dict()["processed_indices"]})
    return [{**s.state_dict(), "processed_indices": union} for s in samplers]


def _train(samplers: list, batches: int, seen: list[int]) -> None:
    """Every rank processes ``batches`` batches of its part, recording each."""
    for s in samplers:
        part = list(s)
        for b in range(batches):
            seen.extend(part[b * BATCH : (b + 1) * BATCH])
            s.record_batch(b, BATCH)


def test_resume_across_size_changes_processes_each_sample_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    world = _world(monkeypatch, 3, None)
    _train(world, 2, seen)  # 3 ranks x 2 batches x 4 = 24 samples
    committed = _commit(world)
    lost: list[int] = []
    _train(world, 1, lost)  # done after the commit, then a rank dies: rolled back
    world = _world(monkeypatch, 2, committed[:2])  # re-formed at 2 ranks from the commit
    assert all(len(s) == (70 - 24) // 2 for s in world)
    _train(world, 3, seen)  # 2 x 3 x 4 = 24 more
    committed = _commit(world)
    assert len(seen) == len(set(seen)) == 48  # nothing twice so far
    world = _world(monkeypatch, 3, [committed[0]] * 3)  # a new worker synced from rank 0
    last: list[int] = []
    _train(world, 2, last)  # to the end of the epoch: 22 left, 8 a rank (2 padding repeats)
    assert len(last) == 24 and len(set(last)) == 22 and not set(last) & set(seen)
    assert set(seen) | set(last) == set(range(70))  # nothing skipped


def test_set_epoch_starts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    (s,) = _world(monkeypatch, 1, None)
    s.record_batch(0, BATCH)
    s.reset()  # (a reset repartitions; recording alone leaves the iteration as it is)
    assert s.processed_num == BATCH and len(s) == 70 - BATCH
    s.set_epoch(1)
    assert s.processed_num == 0 and sorted(s) == list(range(70))
