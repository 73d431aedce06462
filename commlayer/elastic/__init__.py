"""Elastic training API (Horovod's ``hvd.elastic``) on a fixed MPI world.

```python
state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        ...
        state.commit()          # every few batches: a copy in memory to roll back to

train(state)
```

Under commlayerrun's elastic driver (``commlayerrun --min-np/--max-np/--host-discovery-script``,
commlayer/launch/driver.py) the world changes as in Horovod. ``run`` does, in a loop:

1. ``state.sync()`` (unless the last interrupt said to skip it), then call the function.
2. On a ``HorovodInternalError`` (a peer died: RankDiedError; or any commlayer error): shut the
   engine down without waiting on dead peers, destroy the process group, ask the driver for
   this worker's new rank and size, start commlayer again over the new world (gloo, a store
   prefix of its own per generation), ``state.restore()`` the last commit (in memory, no
   checkpoint), run the reset callbacks, and go to 1 (the sync gives every rank, new workers
   included, rank 0's state). ``--reset-limit`` of commlayerrun bounds how often. What was
   made for the old world is dropped once this worker joins the new one: every
   DistributedOptimizer starts over at the new size, and every ``on_new_world`` callback runs
   (the DDP hook's CommStates make their communicators again).
3. On ``HostsUpdatedInterrupt`` (raised by ``state.commit()`` on every rank at the same commit
   once the driver reported a host change): the same, without the restore (the state was
   just committed), and without the sync when hosts were only removed.

A worker whose host was removed exits with code 0 at its rendezvous (``WorkerRemoved``).
The new world starts as the user's ``init()`` did (``runtime.restart``): its keyword settings
and its process sets (a set with a rank the new world lacks is a ValueError naming it and the
size, on every rank, new workers included: the job ends). Sets of ``add_process_set`` are
registered again when every rank had them (no worker joined) and their ranks exist; else they
are dropped with a warning (using one is a clear "not registered" error, never a hang): a
reset callback can add them again on every rank.

Without the driver (mpiexec, torchrun, a plain process) the world is fixed, and MPI cannot
re-form it once a process has died. ``run`` then does:

1. ``state.sync()`` (unless the last interrupt said to skip it), then call the function.
2. On a ``HorovodInternalError`` (``CommlayerError``) while the world is intact (a mismatch, a
   stall that was failed, a bad payload, or one raised by the function): ``state.restore()``,
   run the reset callbacks, and go to 1, at most ``reset_limit`` times in a row.
3. On ``HostsUpdatedInterrupt``: run the reset callbacks and go to 1.
4. A rank that died or shut down (``RankDiedError``, ``ShutdownError``: the engine has stopped)
   ends the job: the error is raised, as nothing can be retried without that rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from commlayer.common import config
from commlayer.common.errors import HorovodInternalError, HostsUpdatedInterrupt, ShutdownError
from commlayer.core import runtime
from commlayer.elastic import rendezvous  # registers the worker's rendezvous with the runtime
from commlayer.elastic.sampler import ElasticSampler
from commlayer.elastic.state import ObjectState, State, TorchState

log = logging.getLogger("commlayer")

R = TypeVar("R")

# Retries in a row before run() gives up: an error that repeats on a fixed world (a shape
# mismatch in the code) would otherwise loop for ever; Horovod leaves this to --reset-limit.
DEFAULT_RESET_LIMIT = 3


def run(func: Callable[..., R], reset_limit: int | None = DEFAULT_RESET_LIMIT) -> Callable[..., R]:
    """Wrap ``func(state, *args, **kwargs)`` so it is retried from the last commit after an
    error the world survives (module docstring). ``reset_limit=None``: no limit."""
    if reset_limit is not None and (
        isinstance(reset_limit, bool) or not isinstance(reset_limit, int) or reset_limit < 0
    ):
        raise ValueError(f"run(reset_limit={reset_limit!r}): must be None or an int >= 0")

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise ValueError(
                f"{getattr(func, '__name__', func)!r} wrapped by commlayer.elastic.run needs a "
                f"commlayer.elastic State as its first argument, got {type(state).__name__}"
            )
        elastic = config.elastic_worker() is not None
        if elastic:
            rendezvous.register_state(state)
            rendezvous.join(state)
            _restore_lost(state)
        skip_sync, resets = False, 0
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if elastic:
                    log.warning(
                        "commlayer rank %d: %s; re-forming the world from the last commit",
                        runtime.rank() if runtime.is_initialized() else -1,
                        exc,
                    )
                    _reform(state)
                    state.restore()
                    skip_sync = False
                    state.on_reset()
                    continue
                if isinstance(exc, ShutdownError) or not _world_intact():
                    raise
                resets += 1
                if reset_limit is not None and resets > reset_limit:
                    raise
                log.warning(
                    "commlayer rank %d: %s; restoring the last commit and retrying (%d of %s)",
                    runtime.rank(),
                    exc,
                    resets,
                    reset_limit,
                )
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
                if elastic:
                    _reform(state)
                    skip_sync = skip_sync and rendezvous.skip_sync_ok()
            state.on_reset()

    return wrapper


# What else holds things made for a world (on_new_world): the layers above this package
# (integrations/) register here, as this package may not import them.
_new_world_callbacks: list[Callable[[], None]] = []


def on_new_world(callback: Callable[[], None]) -> None:
    """Have ``callback()`` run on every elastic re-formation of the world, once this worker has
    joined the new one, after the DistributedOptimizers started over (integrations/ddp.py's
    ``new_world``); registered once, whatever the number of calls."""
    if callback not in _new_world_callbacks:
        _new_world_callbacks.append(callback)


def _reform(state: State) -> None:
    """Join the driver's next world (``_reform_once``), again if a worker of it dies before
    this rank is back in training."""
    while True:
        try:
            _reform_once(state)
            return
        except HorovodInternalError as exc:
            log.warning("commlayer: the new world broke while this rank joined it (%s); again", exc)


def _reform_once(state: State) -> None:
    """Leave this world (the engine stops without waiting on dead peers: its thread has
    already stopped on their death) and join the driver's next one: what was in flight is
    dropped, and every DistributedOptimizer starts over at the new size (its one-rank
    identity on or off with it)."""
    from commlayer import optimizer

    added = runtime.added_process_sets()
    runtime.shutdown()
    runtime.restart()  # the user's init() arguments and process sets, in the new world
    rendezvous.join(state)
    _add_again(added)
    optimizer.new_world()
    for callback in list(_new_world_callbacks):
        callback()
    _restore_lost(state)


def _restore_lost(state: State) -> None:
    """A world with no worker of the last one (commlayerrun --on-state-lost reset): the reset
    callbacks restore the state from the user's own checkpoint before the sync."""
    if rendezvous.state_lost():
        log.warning(
            "commlayer rank %d: this world has no worker of the last one (which held the last "
            "commit): running the reset callbacks to restore the state from your checkpoint",
            runtime.rank(),
        )
        state.on_reset()


def _add_again(added: list[Any]) -> None:
    """The process sets add_process_set registered in the last world: registered again
    (collective) where every rank of the new one had them, that is no worker joined and each
    set's ranks exist; else dropped (unregistered: using one is a clear error), saying so."""
    from commlayer import ops

    size, fits = runtime.size(), [ps for ps in added if max(ps.ranks) < runtime.size()]
    kept = fits if not rendezvous.joined() else []
    for ps in added:
        if ps in kept:
            ops.add_process_set(ps)
            continue
        ps.process_set_id = None
        runtime.remember_process_set(ps, added=False)
        if runtime.rank() == 0:
            why = "new workers joined" if ps in fits else f"the world has {size} ranks"
            log.warning(
                "commlayer: process set %s of add_process_set is not registered in the new "
                "world (%s): add it again on every rank (a reset callback), or pass it to "
                "init(process_sets=...)",
                ps.ranks,
                why,
            )


def _world_intact() -> bool:
    """Whether every rank can still take part: commlayer runs and its engine has not stopped."""
    return runtime.is_initialized() and runtime.engine().running


__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]
