"""Rank topology (issue #2): rank, size, local_rank, local_size, cross_rank and cross_size agree
with each other, with the launcher's world (MPI or torchrun), and with the hosts the ranks run
on (ranks on one host share a node).

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

import socket

from conftest import _world

import commlayer as cl
from commlayer.backends import peers
from commlayer.core import runtime


def test_topology_is_consistent_on_every_rank() -> None:
    mine = {
        "rank": cl.rank(),
        "size": cl.size(),
        "local_rank": cl.local_rank(),
        "local_size": cl.local_size(),
        "cross_rank": cl.cross_rank(),
        "cross_size": cl.cross_size(),
        "homogeneous": cl.is_homogeneous(),
        "host": socket.gethostname(),
    }
    every = cl.allgather_object(mine, name="topology")
    n = cl.size()

    world = _world()  # MPI's COMM_WORLD, or torch.distributed's default group under torchrun
    assert (cl.rank(), n) == (world.rank, world.size)
    assert [info["rank"] for info in every] == list(range(n))
    assert all(info["size"] == n for info in every)
    for r, info in enumerate(every):
        on_host = [q for q in range(n) if every[q]["host"] == info["host"]]
        peers = [q for q in range(n) if every[q]["local_rank"] == info["local_rank"]]
        expected = (on_host.index(r), len(on_host), peers.index(r), len(peers))
        got = (info["local_rank"], info["local_size"], info["cross_rank"], info["cross_size"])
        assert got == expected, f"rank {r}: (local_rank, local_size, cross_rank, cross_size) {got}"
    homogeneous = len({info["local_size"] for info in every}) == 1
    assert all(info["homogeneous"] == homogeneous for info in every)


def test_ranks_sharing_a_kernel_share_a_machine_index() -> None:
    """The backend numbers machines by the kernel's boot id (what the wait policy counts ranks
    on), in order of the lowest rank, for MPI and torch.distributed alike."""
    machines = runtime.engine()._global.backend.machines()
    ids = cl.allgather_object(peers.machine_id(), name="machine_ids")
    order = list(dict.fromkeys(ids))
    assert machines == [order.index(machine) for machine in ids]
