"""Pieces the benchmarks share: torch.distributed (gloo) set up beside MPI."""

from __future__ import annotations

import socket

import torch.distributed as dist

from commlayer.backends.mpi import MPI  # through commlayer: it sets mpi4py.rc first


def init_gloo(world: MPI.Comm) -> None:
    """torch.distributed over gloo, rendezvous on a TCP port rank 0 picked (shared over MPI)."""
    port = 0
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.size
    )
