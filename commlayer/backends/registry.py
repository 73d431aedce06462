"""The registry of backends: names to the modules that start them, and ``auto``'s choice.

A backend is one module and one registration (``register``, in backends/__init__.py). The
registration holds what must be known before the module is imported, since importing one may
start its library (``from mpi4py import MPI`` initializes MPI): which launchers start its jobs,
whether the script may already have started it, whether it re-forms its world under the elastic
driver. The module itself offers the runtime :class:`Lifecycle`. Everything else reads the
registry: config checks ``COMMLAYER_BACKEND`` against ``available()`` (core/registries.py), and
core/runtime.py starts and stops whatever is chosen, naming no backend.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from commlayer.common.config import Config, Launch
from commlayer.common.errors import ConfigError

if TYPE_CHECKING:
    from commlayer.backends.base import Backend

AUTO = "auto"


class Lifecycle(Protocol):
    """What a backend's module offers the runtime (module-level functions)."""

    def start(
        self, comm: Any, settings: Config, launch: Launch, join: Callable[[float], None] | None
    ) -> Backend:
        """The backend init() runs on, over ``comm`` (a communicator or process group of the
        library, a list of global ranks, or None: every rank). ``join(timeout_s)``, given to a
        backend registered ``elastic``: the elastic driver's rendezvous, which starts this
        generation's world; call it first."""
        ...

    def end_job(self, what: str, exc: BaseException) -> bool:
        """This rank raised ``exc`` and nobody caught it (``what`` says so): arrange for the
        whole job to end, telling the user how. True when the job aborts at this process's exit
        (shutdown then says no goodbye)."""
        ...

    def finish(self, stopped: bool, peer_died: bool) -> None:
        """After the engine's shutdown (``stopped``: its thread ended; ``peer_died``: it saw a
        peer die): release what ``start`` took, as far as that is safe."""
        ...


@dataclasses.dataclass(frozen=True)
class Registration:
    """A backend: its ``name`` (COMMLAYER_BACKEND), the ``module`` that implements it (imported
    when it starts), ``title`` (how messages name its library), and for ``auto``: the
    ``launchers`` whose processes it takes (config.Launch.launcher; "" a plain process),
    ``launched_by`` (those launchers as a user knows them), ``ready()`` (the script has
    started its library already: a plain process then takes it), ``elastic`` (it re-forms its
    world when ranks come and go)."""

    name: str
    module: str
    title: str
    launchers: tuple[str, ...] = ()
    launched_by: str = ""
    ready: Callable[[], bool] | None = None
    elastic: bool = False

    def load(self) -> Lifecycle:
        return cast(Lifecycle, importlib.import_module(self.module))


_REGISTERED: dict[str, Registration] = {}


def register(registration: Registration) -> None:
    """Make a backend available under its name (ValueError if the name is taken)."""
    if registration.name in _REGISTERED or registration.name == AUTO:
        raise ValueError(f"a backend named {registration.name!r} is already registered")
    _REGISTERED[registration.name] = registration


def unregister(name: str) -> None:
    """Remove backend ``name`` (ValueError if it is not one)."""
    if _REGISTERED.pop(name, None) is None:
        raise ValueError(f"{name!r} is not a registered backend")


def available() -> list[str]:
    """Every name COMMLAYER_BACKEND accepts: auto, then the backends in registration order."""
    return [AUTO, *_REGISTERED]


def registrations() -> list[Registration]:
    """Every registered backend, in registration order."""
    return list(_REGISTERED.values())


def registration(name: str) -> Registration:
    found = _REGISTERED.get(name)
    if found is None:
        raise ValueError(f"unknown backend {name!r}; allowed: {', '.join(available())}")
    return found


def ready() -> list[str]:
    """The backends whose library the script has started already (``Registration.ready``)."""
    return [r.name for r in _REGISTERED.values() if r.ready is not None and r.ready()]


def auto(launcher: str, started: Sequence[str]) -> str:
    """COMMLAYER_BACKEND=auto: the backend that takes the launcher's processes (mpiexec and
    commlayerrun make one MPI job, even where the script also starts torch.distributed, say for
    a DDP hook); for a plain process, the first whose library the script ``started``, else the
    one that takes plain processes."""
    if launcher:
        for r in _REGISTERED.values():
            if launcher in r.launchers:
                return r.name
    if started:
        return started[0]
    for r in _REGISTERED.values():
        if "" in r.launchers:
            return r.name
    raise ConfigError(f"COMMLAYER_BACKEND=auto: no backend takes this process ({launcher!r})")


def choose(setting: str, launch: Launch, elastic_worker: bool) -> Registration:
    """The backend init() starts for COMMLAYER_BACKEND=``setting`` (auto: ``auto``), for a
    process that ``launch`` started (``elastic_worker``: by the elastic driver, before the
    script started any library). ConfigError, before its library starts, where it cannot run:

    1. an elastic worker needs a backend that re-forms its world;
    2. a launcher that tells the job's size (torchrun) made one job of several processes,
       which a backend that does not take its processes would make jobs of one each."""
    if elastic_worker:
        can = [r for r in registrations() if r.elastic]
        if setting == AUTO and can:
            return can[0]
        chosen = registration(setting)
        if not chosen.elastic:
            raise ConfigError(
                f"COMMLAYER_BACKEND={setting}, but commlayerrun's elastic driver started this "
                f"worker: {chosen.title} cannot re-form its world when ranks come and go; "
                f"elastic training runs on the {' or '.join(r.name for r in can)} backend "
                f"(COMMLAYER_BACKEND={' or '.join(r.name for r in can)} or auto)"
            )
        return chosen
    chosen = registration(auto(launch.launcher, ready()) if setting == AUTO else setting)
    if launch.world_size > 1 and launch.launcher not in chosen.launchers:
        takes = [r for r in _REGISTERED.values() if launch.launcher in r.launchers]
        instead = " or ".join(r.name for r in takes) or "another backend"
        raise ConfigError(
            f"COMMLAYER_BACKEND={chosen.name}, but {launch.launcher} started this process as one "
            f"of WORLD_SIZE={launch.world_size}: {chosen.title} would make each process a job "
            f"of its own (size() 1 everywhere, training apart). Under {launch.launcher} use "
            f"COMMLAYER_BACKEND={instead} (or auto); for {chosen.name} launch with "
            f"{chosen.launched_by or 'what starts its jobs'}"
        )
    return chosen
