"""barrier (issue #2): no rank leaves a barrier before every rank has entered it.

Each rank leaves a marker file in a directory rank 0 shares (all ranks on one host), then
enters the barrier; on leaving, it must see every rank's marker. One rank per round is slowed
down before writing, so a barrier that does not wait would be caught in the act.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

import commlayer as cl

ROUNDS = 3
_STRAGGLE_S = 0.05  # makes a barrier that does not wait fail; nothing here measures time


def test_no_rank_leaves_before_every_rank_entered() -> None:
    hosts = cl.allgather_object(socket.gethostname(), name="barrier.hosts")
    if len(set(hosts)) > 1:  # the same decision on every rank: hosts were allgathered
        pytest.skip("ranks on several hosts share no temporary directory")
    made = tempfile.mkdtemp(prefix="commlayer-barrier-") if cl.rank() == 0 else None
    directory = Path(cl.broadcast_object(made, root_rank=0, name="barrier.dir"))
    seen = []
    for round_ in range(ROUNDS):
        if cl.rank() == round_ % cl.size():
            time.sleep(_STRAGGLE_S)
        (directory / f"{round_}.{cl.rank()}").touch()
        cl.barrier()
        seen.append(sorted(p.name for p in directory.glob(f"{round_}.*")))
    cl.barrier()
    if made is not None:
        shutil.rmtree(made)

    for round_, names in enumerate(seen):
        expected = sorted(f"{round_}.{r}" for r in range(cl.size()))
        assert names == expected, f"rank {cl.rank()} left barrier {round_} having seen {names}"


def test_barrier_on_a_process_set_and_back_to_back() -> None:
    ps = cl.add_process_set(range(0, cl.size(), 2))
    if ps.included():
        cl.barrier(process_set=ps)
        cl.barrier(process_set=ps)
    cl.barrier()
    cl.barrier()
    removed = cl.remove_process_set(ps)
    assert removed is True
