"""export.pairwise: a sparse step's many streams replayed in pairwise-exchange rounds."""

from __future__ import annotations

import pytest

from commlayer import cli
from commlayer.algorithms.sparse import cost as sparse_cost
from commlayer.algorithms.topology import Topology
from commlayer.sim import export


def _pairs(streams: export.Streams) -> tuple[dict, dict]:
    sent: dict[tuple[int, int], list[float]] = {}
    received: dict[tuple[int, int], list[float]] = {}
    for rank, steps in enumerate(streams):
        for sends, recvs in steps:
            for peer, nbytes in sends:
                sent.setdefault((rank, peer), []).append(nbytes)
            for peer, nbytes in recvs:
                received.setdefault((peer, rank), []).append(nbytes)
    return sent, received


@pytest.mark.parametrize("ranks", [5, 16])  # not a power of two too
@pytest.mark.parametrize("name", ["dsar", "ssar_split_allgather"])
def test_rounds_keep_every_message_in_order(name: str, ranks: int) -> None:
    topology = Topology(tuple(r // 4 for r in range(ranks)))
    streams = sparse_cost.streams(name, ranks, 1 << 16, 1 << 10, topology)
    cut, was_cut = export.pairwise(streams, 4)
    assert was_cut
    # the same messages between the same pairs, in the same order, at both ends
    assert _pairs(cut) == _pairs(streams)
    assert _pairs(cut)[0] == _pairs(cut)[1]
    for rank, steps in enumerate(cut):
        for sends, recvs in steps:
            # a round talks to one offset: sends to r + d, receives from r - d
            offsets = {(p - rank) % ranks for p, _ in sends} | {(rank - p) % ranks for p, _ in recvs}
            if len(sends) + len(recvs) > 4:  # a cut step's rounds
                assert len(offsets) == 1
    # a step to and from every other rank became p - 1 rounds, the others stayed
    full = sum(1 for s, r in streams[0] if len(s) + len(r) == 2 * (ranks - 1))
    assert full >= 1
    assert len(cut[0]) == len(streams[0]) + full * (ranks - 2)


def test_small_steps_are_left_as_posted() -> None:
    streams = sparse_cost.streams("topo_sparse", 8, 1 << 16, 1 << 10, Topology((0,) * 4 + (1,) * 4))
    cut, was_cut = export.pairwise(streams, 1000)
    assert not was_cut and cut == streams


def test_negative_max_streams_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--sparse", "dsar", "--platform", "flat:ranks=4", "--max-streams", "-1"]
    assert cli.main(argv) == 2
    assert "--max-streams -1" in capsys.readouterr().err
