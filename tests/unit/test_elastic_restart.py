"""A re-formed elastic world starts as the user's init() did (issue 38): ``runtime.restart()``
keeps init()'s keyword settings and process sets, and ``elastic._add_again`` registers the sets
of add_process_set again, or drops them with a warning where new workers joined or their ranks
are gone. One-rank runs in this process (the MPI backend over this process alone, as
test_startup_summary.py does); the world's size does not change here, the old world's sets
are given as they would have been (a set of 2 ranks in a world re-formed at 1)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import commlayer
from commlayer import elastic, kernels
from commlayer.elastic import rendezvous, runtime


@pytest.fixture
def one_rank() -> Iterator[None]:
    if commlayer.is_initialized():
        pytest.skip("commlayer is running in this process")
    before = kernels.configured()
    try:
        yield
    finally:
        commlayer.shutdown()
        kernels.use(before)
        runtime._user_init = (None, [], {})
        runtime._added_sets.clear()


def _sum_over(ps: commlayer.ProcessSet) -> float:
    return float(commlayer.allreduce(torch.ones(2), op=commlayer.Sum, process_set=ps)[0])


def test_restart_keeps_init_settings_and_process_sets(one_rank: None) -> None:
    mine = commlayer.ProcessSet([0])
    commlayer.init(cache_capacity=77, process_sets=[mine])
    first_id = mine.process_set_id
    commlayer.shutdown()
    runtime.restart()
    assert runtime.config().cache_capacity == 77  # not the default (1024)
    assert mine.process_set_id == first_id and mine.included()
    assert _sum_over(mine) == 1.0


def test_restart_names_a_process_set_the_new_world_lacks(one_rank: None) -> None:
    commlayer.init()
    commlayer.shutdown()
    runtime._user_init = (None, [commlayer.ProcessSet([0, 1])], {})  # as at 2 ranks
    with pytest.raises(ValueError) as error:
        runtime.restart()
    message = str(error.value)
    assert "rank 0: the world re-formed at size 1" in message, message
    assert "process set [0, 1] of init(process_sets=...)" in message, message


@pytest.mark.parametrize("joined", [False, True])
def test_added_process_sets_in_the_new_world(
    one_rank: None, joined: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commlayer.init()
    caplog.clear()  # the start-up line: what follows is the re-formation's
    added = commlayer.add_process_set([0])
    removed = commlayer.add_process_set(commlayer.ProcessSet([0]))
    commlayer.remove_process_set(removed)
    gone = commlayer.ProcessSet([0, 1])  # added in a world of 2 ranks
    runtime.remember_process_set(gone, added=True)
    assert runtime.added_process_sets() == [added, gone]
    monkeypatch.setattr(rendezvous, "joined", lambda: joined)
    elastic._add_again(runtime.added_process_sets())  # after a re-formation at 1 rank
    assert gone.process_set_id is None
    assert "process set [0, 1] of add_process_set is not registered" in caplog.text
    assert "the world has 1 ranks" in caplog.text
    if joined:  # a new worker never had the set: nobody keeps it
        assert added.process_set_id is None and runtime.added_process_sets() == []
        assert "new workers joined" in caplog.text
        with pytest.raises(ValueError, match="is not registered"):
            _sum_over(added)
    else:
        assert added.process_set_id is not None and runtime.added_process_sets() == [added]
        assert _sum_over(added) == 1.0
    assert caplog.records and all(r.levelno == logging.WARNING for r in caplog.records)
