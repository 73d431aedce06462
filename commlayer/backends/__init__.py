"""Backends: point-to-point and collective transport under the engine, registered by name
(``COMMLAYER_BACKEND``).

Each backend is one module implementing :class:`Backend` (base.py: the required protocol, and
the optional capabilities a backend declares) and one registration below (registry.py). The
modules are imported only when their backend starts (importing mpi.py initializes MPI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commlayer.backends.base import Backend, Request
from commlayer.backends.registry import (
    AUTO,
    Lifecycle,
    Registration,
    auto,
    available,
    choose,
    register,
    registration,
    registrations,
    unregister,
)


def _torch_started() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


register(
    Registration(
        "mpi",
        "commlayer.backends.mpi",
        "MPI",
        launchers=("mpi", ""),
        launched_by="commlayerrun or mpiexec",
    )
)
register(
    Registration(
        "torch",
        "commlayer.backends.torch_distributed",
        "torch.distributed",
        launchers=("torchrun",),
        launched_by="torchrun",
        ready=_torch_started,
        elastic=True,
    )
)
register(
    Registration(
        "loopback",
        "commlayer.backends.loopback",
        "the loopback backend",
        launched_by="a plain process (one rank; tests run more as threads: loopback.run_ranks)",
    )
)

if TYPE_CHECKING:  # mypy proves each registered module offers the runtime its Lifecycle
    from commlayer.backends import loopback, mpi, torch_distributed

    _conform: tuple[Lifecycle, ...] = (mpi, torch_distributed, loopback)

__all__ = [
    "AUTO",
    "Backend",
    "Lifecycle",
    "Registration",
    "Request",
    "auto",
    "available",
    "choose",
    "register",
    "registration",
    "registrations",
    "unregister",
]
