"""The cost of a compressed reduction, flat or once per host (issue 51; costmodel/compressed.py):
its phases, the bytes a host sends to the others, and the time on known links."""

from __future__ import annotations

import pytest

from commlayer.common.topology import Topology
from commlayer.costmodel import Calibration, compressed

NUMEL = 1 << 20  # a 4 MiB bucket
TWO_BY_TWO = Topology((0, 0, 1, 1))
INTER_S_PER_BYTE = 1e-9  # 1 GB/s between nodes
INTRA_S_PER_BYTE = 1e-11  # 100 GB/s inside a node


def _cal(size: int, nodes: int) -> Calibration:
    """alpha 1 us inside a node, 10 us across; beta as above (straight lines, read off the
    curve log-log between powers of two: within 0.5%)."""
    points = [1 << k for k in range(31)]
    return Calibration(
        size, nodes, 1e-6, INTRA_S_PER_BYTE, 0.0, 0.0, {},
        exchange=[(n, 1e-6 + INTRA_S_PER_BYTE * n) for n in points],
        exchange_inter=[(n, 1e-5 + INTER_S_PER_BYTE * n) for n in points],
    )  # fmt: skip


def test_the_squarest_matrix_and_the_declared_payload() -> None:
    assert tuple(compressed.matrix(1 << 20)) == (1024, 1024)
    assert tuple(compressed.matrix(3 * 512)) == (32, 48)
    summable, rounds = compressed.payload("powersgd:rank=4", 1 << 20)
    assert summable and rounds == [1024 * 4 * 4, 1024 * 4 * 4]  # P then Q, float32
    summable, rounds = compressed.payload("topk:ratio=0.01", 1 << 20)
    assert not summable and rounds == [10486 * 8]  # values and int32 indices


def test_a_gathered_payload_leaves_a_host_once_per_host() -> None:
    """2 x 2: flat, recursive doubling sends each rank's payload p, then 2p across (rank 0
    with 2, rank 1 with 3): 4p out of a node; per host one leader a node sends p."""
    cal = _cal(4, 2)
    p = compressed.payload("topk:ratio=0.01", NUMEL)[1][0]
    flat = compressed.plan("topk:ratio=0.01", NUMEL, TWO_BY_TWO, cal, per_host=False)
    host = compressed.plan("topk:ratio=0.01", NUMEL, TWO_BY_TWO, cal, per_host=True)
    assert [name for name, _ in flat.phases] == ["allgather"]
    assert [name for name, _ in host.phases] == ["host sum", "allgather", "share"]
    assert compressed.cross_bytes(flat, TWO_BY_TWO) == 4 * p
    assert compressed.cross_bytes(host, TWO_BY_TWO) == p
    # the leaders' exchange takes one step across instead of two (the second shared by two
    # ranks of the node): per host wins on a slow link despite two passes inside the node
    assert compressed.seconds(host, cal, TWO_BY_TWO) < compressed.seconds(flat, cal, TWO_BY_TWO)


def test_the_time_counts_the_node_link_shared_by_its_ranks() -> None:
    """Flat 2 x 2 top-k: step one inside (p at 100 GB/s), step two 2p by each of two ranks
    through the node's link: 4p at 1 GB/s."""
    cal = _cal(4, 2)
    p = compressed.payload("topk:ratio=0.01", NUMEL)[1][0]
    flat = compressed.plan("topk:ratio=0.01", NUMEL, TWO_BY_TWO, cal, per_host=False)
    want = (1e-6 + INTRA_S_PER_BYTE * p) + (1e-5 + INTER_S_PER_BYTE * 4 * p)
    assert compressed.seconds(flat, cal, TWO_BY_TWO) == pytest.approx(want, rel=5e-3)


def test_per_host_is_flat_where_no_node_holds_two_ranks() -> None:
    one_each = Topology((0, 1, 2, 3))
    cal = _cal(4, 4)
    for spec in ("topk:ratio=0.01", "powersgd:rank=2", "fp16"):
        host = compressed.plan(spec, NUMEL, one_each, cal, per_host=True)
        flat = compressed.plan(spec, NUMEL, one_each, cal, per_host=False)
        assert not host.per_host and host.phases == flat.phases


def test_a_summable_payload_is_allreduced_round_by_round() -> None:
    cal = _cal(4, 2)
    host = compressed.plan("powersgd:rank=4", NUMEL, TWO_BY_TWO, cal, per_host=True)
    names = [name for name, _ in host.phases]
    assert names == ["host sum", "allreduce round 1", "allreduce round 2", "share"]
    leaders = host.phases[1][1]
    assert leaders[1] == [] and leaders[3] == [] and leaders[0] and leaders[2]
    streams = host.streams()  # a rank's phases one after the other, for the replay
    assert len(streams[0]) == sum(len(phase[0]) for _, phase in host.phases)
    got = compressed.predict("powersgd:rank=4", NUMEL, cal, TWO_BY_TWO, per_host=True)
    assert got.cross_bytes == compressed.cross_bytes(host, TWO_BY_TWO) > 0
