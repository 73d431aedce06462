"""The torch backend naming the peers behind a transport error (``TorchBackend.lost_peers``):
gloo reports a peer's death on another host only as a closed connection from its address."""

from __future__ import annotations

from types import SimpleNamespace

from commlayer.backends.peers import PeerTable
from commlayer.backends.torch_distributed import TorchBackend

# 2 hosts x 2 ranks, as the namespace cluster's: node2's ranks resolve to 10.213.0.2
_JOB = SimpleNamespace(
    _peers=PeerTable(
        0,
        [("node1", 11, "m"), ("node1", 12, "m"), ("node2", 21, "m"), ("node2", 22, "m")],
        [{"10.213.0.1"}, {"10.213.0.1"}, {"10.213.0.2"}, {"10.213.0.2"}],
    )
)
_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [{}]:59012. This is typically caused by a remote worker crashing."
)


def test_a_closed_connection_names_the_host_and_ranks_of_its_address() -> None:
    error = RuntimeError(_CLOSED.format("10.213.0.2"))
    assert TorchBackend.lost_peers(_JOB, error) == ("node2", [2, 3])  # type: ignore[arg-type]


def test_this_hosts_address_names_the_other_local_ranks_only() -> None:
    error = RuntimeError(_CLOSED.format("10.213.0.1"))
    assert TorchBackend.lost_peers(_JOB, error) == ("node1", [1])  # type: ignore[arg-type]


def test_an_error_naming_no_peer_address_names_nobody() -> None:
    for text in ("Connection reset", _CLOSED.format("192.168.7.7"), _CLOSED.format("::1")):
        assert TorchBackend.lost_peers(_JOB, RuntimeError(text)) is None  # type: ignore[arg-type]


def test_the_negotiations_byte_gathers_go_over_gloos_group_whatever_moves_cpu_data() -> None:
    """iallgather_bytes (the negotiation's) is posted on the backend's own gloo group even where
    CPU data is routed over another group (tests route it so, tests/parallel/direct_cpu.py):
    ranks whose routing differs for a moment (one rank's test set it, another's not yet) must
    still meet on one group; they hung in the negotiation for 60 s when the gather followed the
    data routing."""
    import torch

    from commlayer.backends.torch_distributed import _GatherBytesRequest

    main, data = object(), object()
    groups: list[object] = []

    class Stub:
        size = 2
        _group = main
        _data = {"cpu": data}

        def _on(self, tensor: torch.Tensor) -> object:
            return self._data["cpu"]

        def _gather_equal(
            self, send: torch.Tensor, recv: torch.Tensor, group: object = None
        ) -> object:
            groups.append(self._on(recv) if group is None else group)
            recv.fill_(1)
            return SimpleNamespace(test=lambda: True)

        def iallgatherv(
            self, send: torch.Tensor, recv: torch.Tensor, counts: object, group: object = None
        ) -> object:
            groups.append(self._on(recv) if group is None else group)
            return SimpleNamespace(test=lambda: True)

    out: list[bytes] = []
    request = _GatherBytesRequest(Stub(), b"x", out)  # type: ignore[arg-type]
    assert request.test()
    assert groups == [main, main]
