"""Partial-local shuffling across hosts (issue 24): one job on the namespace cluster, 2 hosts x
2 ranks over 1 Gbit/s links, started as a user starts it (``commlayerrun -np 4 -H
node1:2,node2:2``), running the issue's loop (scripts/shuffle_cluster.py). Every sample is
visited once per epoch across the hosts, samples cross from one host's stores to the other's,
and after the last exchange the stores hold the dataset once with every shard's size kept.

Needs root and network namespaces; skipped, with the reason, where they are not permitted or a
cluster is already up (as tests/system/test_cluster.py, whose helpers it uses). About 20 s:
the cluster up and down, and the job's start on the loaded 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_cluster import _why_not_permitted, cluster, run_worker

WORKER = Path(__file__).parent / "scripts" / "shuffle_cluster.py"
N, EPOCHS, PER_HOST = 203, 3, 2  # scripts/shuffle_cluster.py
JOB_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def records(harness: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = _why_not_permitted()
    if reason is not None:
        pytest.skip(reason)
    out_dir = tmp_path_factory.mktemp("cluster_shuffle")
    try:
        cluster("up", "2", "--rate", "1gbit")
        yield run_worker(harness, out_dir, WORKER, [str(out_dir / "stores")], JOB_TIMEOUT_S)
    finally:
        cluster("down")


def test_shuffling_across_hosts_keeps_every_sample_once(records: Any) -> None:
    code, output, found = records
    assert code == 0, output
    ranks = sorted((r for r in found if r["event"] == "shuffle"), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], output
    assert [r["hostname"] for r in ranks] == ["node1", "node1", "node2", "node2"], output
    for epoch in range(EPOCHS):
        visited = sorted(i for r in ranks for i in r["visited"][epoch])
        assert visited == list(range(N)), f"epoch {epoch}"
    assert sorted(i for r in ranks for i in r["final"]) == list(range(N))
    assert [len(r["final"]) for r in ranks] == [len(r["initial"]) for r in ranks]
    on_node1 = {i for r in ranks[:PER_HOST] for i in r["initial"]}
    crossed = [i for r in ranks[PER_HOST:] for i in r["final"] if i in on_node1]
    assert crossed, "no sample moved from node1's stores to node2's"
    assert all(r["sent_bytes"] > 0 for r in ranks)
