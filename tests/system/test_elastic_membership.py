"""Every membership change an elastic job meets, in 2-, 3- and 4-worker jobs, ending in a
recovery (issue 48): a worker lost by ``kill`` and by an uncaught exception (``raise``) and the
world growing back after the cooldown (2 -> 1 -> 2: the one-rank identity path of the
DistributedOptimizer switched on and off), a worker dying before the first world trains, one
dying while the others wait at the rendezvous, and two dying in the same step.

The hosts are this machine under several names (localhost, 127.0.0.1, 127.0.0.2, ...: one
slot each), so that a failure blacklists one host, as Horovod's policy does. The workers
(scripts/elastic_worker.py) train one model whose final parameters are, to the bit, those of
one process doing the same steps only if every step was applied once from its committed state
(no silent loss), and a second model through a DistributedOptimizer (reductions in flight when
a rank dies mid-step) whose parameters every rank must end with alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_elastic_driver import _job, _reference

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

_NAMES = ["localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3"]


def _hosts(n: int) -> str:
    return ";".join(f"{name}:1" for name in _NAMES[:n])


def _finished_alike(records: list[dict], code: int, output: str, size: int) -> None:
    """The job ended well: every rank at the same step with the reference's parameters, and
    the DistributedOptimizer's model alike on every rank."""
    assert code == 0, output
    done = [r for r in records if r["kind"] == "done"]
    assert len(done) == size and {r["size"] for r in done} == {size}, (done, output)
    final = done[0]["step"]
    assert {r["step"] for r in done} == {final}
    for r in done:
        assert r["params"] == _reference(final), output  # no step lost or applied twice
    assert all(r["opt_params"] == done[0]["opt_params"] for r in done), output


def _sizes(records: list[dict]) -> list[int]:
    """The world sizes rank 0 trained at, in order."""
    return [r["size"] for r in records if r["kind"] == "start" and r["rank"] == 0]


@pytest.mark.parametrize(
    "n,how,rank",
    [(2, "kill", 1), (2, "raise", 0), (3, "kill", 0), (3, "raise", 2), (4, "kill", 3),
     (4, "raise", 1)],
)  # fmt: skip
def test_a_worker_lost_and_its_host_back(tmp_path: Path, n: int, how: str, rank: int) -> None:
    flags = ["-np", str(n), "--min-np", "1", "--max-np", str(n)]
    flags += ["--blacklist-cooldown-range", "1", "1"]
    code, output, records = _job(
        tmp_path, _hosts(n), flags, 6, [f"{how}:3:{n}:{rank}", f"grown:4:{n}"]
    )
    _finished_alike(records, code, output, n)
    assert _sizes(records)[:3] == [n, n - 1, n], output
    assert "blacklisted for 1.0 s" in output, output


@pytest.mark.parametrize("when", ["before-init", "in-init"])
def test_a_worker_dies_before_the_first_world_trains(tmp_path: Path, when: str) -> None:
    flags = ["-np", "3", "--min-np", "2", "--max-np", "3"]
    code, output, records = _job(tmp_path, _hosts(3), flags, 5, [f"{when}:2"])
    _finished_alike(records, code, output, 2)
    assert set(_sizes(records)) == {2}, output


def test_a_worker_dies_at_the_rendezvous(tmp_path: Path) -> None:
    """Rank 2 is killed mid-step; start rank 1 dies while waiting for world 2."""
    flags = ["-np", "3", "--min-np", "1", "--max-np", "3"]
    events = ["in-rendezvous:2:1", "kill:3:3:2"]
    code, output, records = _job(tmp_path, _hosts(3), flags, 6, events)
    _finished_alike(records, code, output, 1)
    assert _sizes(records) == [3, 1], output


def test_two_workers_die_in_the_same_step(tmp_path: Path) -> None:
    flags = ["-np", "4", "--min-np", "2", "--max-np", "4"]
    code, output, records = _job(tmp_path, _hosts(4), flags, 6, ["kill:3:4:1+2"])
    _finished_alike(records, code, output, 2)
    assert _sizes(records) == [4, 2], output
