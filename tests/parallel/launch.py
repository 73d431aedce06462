"""How this parallel test run was launched: ``mpiexec -n N pytest`` (commlayer over MPI) or
``torchrun --nproc_per_node N -m pytest`` (commlayer over torch.distributed's gloo), and a
backend over all ranks of either kind for tests that drive the algorithms directly."""

from __future__ import annotations

from typing import Any

import pytest

import commlayer


def under_torchrun() -> bool:
    """Whether torchrun started this run: commlayer (COMMLAYER_BACKEND=auto) and the harness
    then run over torch.distributed."""
    return commlayer.common.config.launch().launcher == "torchrun"


def own_backend() -> Any:
    """A backend of its own over every rank (collective: every rank makes it at this point):
    a duplicate of COMM_WORLD under MPI, a new gloo group under torchrun."""
    if under_torchrun():
        import torch.distributed as dist

        from commlayer.backends.torch_distributed import TorchBackend

        return TorchBackend(dist.new_group(list(range(dist.get_world_size())), backend="gloo"))
    from commlayer.backends.mpi import MPIBackend

    return MPIBackend()


# Tests of MPI-only machinery (MPI-3 shared-memory windows): skipped under torchrun, the same
# way on every rank.
mpi_only = pytest.mark.skipif(
    under_torchrun(), reason="MPI-only: shared-memory windows need the MPI backend"
)


def start_gloo() -> None:
    """torch.distributed's gloo over commlayer's ranks (rank 0 picks a free port and broadcasts
    it), for the tests of the DDP hook. Left up until the process exits: destroying it in a test
    aborted the process in a later one ("Resource deadlock avoided": a gloo worker thread
    released the group's last reference and its destructor joined that very thread), in 2 of 4
    runs of test_ddp_hook.py with the next ones at 4 ranks."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = 0
    if commlayer.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = commlayer.broadcast_object(port, root_rank=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=commlayer.rank(),
        world_size=commlayer.size(),
    )
