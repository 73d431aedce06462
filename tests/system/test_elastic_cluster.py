"""commlayerrun's elastic driver on the namespace cluster (scripts/cluster.sh; issue 38): hosts,
not slots of this machine.

One job (the suite's time is short: one startup for every event), 3 hosts of one slot each,
``-np 3 --min-np 1``, as a user starts it: ``commlayerrun ... --host-discovery-script S``
whose hosts are node1..node3. commlayerrun runs its driver on node1 (entered through the
cluster's launcher, as it runs mpiexec there), which starts node1's worker as its child and the
others through the launcher. The events, in order (scripts/elastic_worker.py):

1. the discovery script loses node3 (3 -> 2): its worker is told to exit;
2. it gets node3 back (2 -> 3): a new worker starts there and joins at a commit;
3. node2's worker is SIGKILLed mid-step (3 -> 2): the survivors resume from the last commit,
   the parameters equal on both;
4. node3 pulls its own cable (``cluster.sh link node3 down``) mid-step, then waits in the
   allreduce it can never finish (3 -> 1): the driver hears no heartbeat from it for
   ``--heartbeat-timeout`` (3 s here), stops it, and node1's worker, blocked in the same
   allreduce, is told of the death and re-forms alone. The time from the cut to training again
   is printed (not asserted: the harness's limit turns a hang into a failure).

The final parameters equal those of one process doing the same steps, to the bit: no committed
step lost or applied twice at any size. The cluster is always taken down at the end (every
namespace and link it made). Skipped like test_cluster.py where namespaces are not permitted
or a cluster is already up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cluster import cluster, permitted
from test_elastic_driver import _job, _reference

__all__ = ["permitted"]  # a fixture of test_cluster.py, used here

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


@pytest.fixture(scope="module")
def up(permitted: None) -> Iterator[None]:
    """3 hosts on 1 Gbit/s links; down at the end whatever happened (namespaces, links)."""
    try:
        cluster("up", "3", "--rate", "1gbit")
        yield
    finally:
        cluster("down")


def test_hosts_removed_added_killed_and_cut(up: None, tmp_path: Path) -> None:
    hosts = str(tmp_path / "hosts")
    code, output, records = _job(
        tmp_path,
        "node1:1;node2:1;node3:1",
        ["-np", "3", "--min-np", "1", "--max-np", "3", "--heartbeat-timeout", "3"],
        12,
        [
            f"hosts:2:3:{hosts}:node1:1;node2:1",
            f"hosts:4:2:{hosts}:node1:1;node2:1;node3:1",
            "kill:6:3:1",
            "cut:8:2:1",
        ],
    )
    assert code == 0, output
    starts = [r for r in records if r["kind"] == "start"]
    done = [r for r in records if r["kind"] == "done"]
    # 3 -> 2 (node3 removed) -> 3 (node3 back) -> 2 (node2's worker killed) -> 1 (node3 cut)
    sizes = [r["size"] for r in starts if r["rank"] == 0]
    assert sizes == [3, 2, 3, 2, 1], (sizes, output)
    assert {r["host"] for r in starts if r["rank"] == 0} == {"node1"}  # the driver's host
    worlds: dict[int, list[dict]] = {}  # type: ignore[type-arg]
    for r in starts:
        worlds.setdefault(r["generation"], []).append(r)
    hosts_of = [sorted(r["host"] for r in worlds[g]) for g in sorted(worlds)]
    assert hosts_of == [
        ["node1", "node2", "node3"],
        ["node1", "node2"],
        ["node1", "node2", "node3"],
        ["node1", "node3"],
        ["node1"],
    ], (hosts_of, output)
    assert "removed from the job; exiting" in output
    assert {r["cache"] for r in starts} == {512}  # init()'s setting, in every world
    # after the kill: both survivors resumed from the step being done (committed before it),
    # with equal parameters
    killed_at = int((tmp_path / "done-2").read_text().split()[0])
    after_kill = worlds[sorted(worlds)[3]]
    assert {r["step"] for r in after_kill} == {killed_at}, (after_kill, killed_at)
    assert after_kill[0]["params"] == after_kill[1]["params"]
    # after the cut: the driver stopped the silent worker, node1 went on alone from the commit
    cut_at, cut_time = (tmp_path / "done-3").read_text().split()
    [alone] = worlds[sorted(worlds)[4]]
    assert alone["step"] == int(cut_at), (alone, cut_at)
    assert "sent no heartbeat" in output and "host node3 unreachable" in output, output
    took = alone["time"] - float(cut_time)
    print(f"node3's cable pulled: training again at size 1 after {took:.2f} s")
    assert len(done) == 1 and done[0]["size"] == 1, done
    final = done[0]["step"]
    assert done[0]["params"] == _reference(final)  # to the bit: no step lost or applied twice
    assert done[0]["params"] != _reference(final - 1)
