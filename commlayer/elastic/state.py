"""Elastic state: what a training function commits, rolls back to and shares (Horovod's State,
ObjectState, TorchState).

``commit()`` saves a copy in memory (and checks for host updates), ``restore()`` rolls back to
the last commit, ``sync()`` gives every rank rank 0's state. TorchState keeps models, optimizers,
LR schedulers and ElasticSamplers through one handler each; other keyword arguments are plain
Python objects.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable, Iterable
from typing import Any

import torch

from commlayer import ops, state_sync
from commlayer.common import config
from commlayer.common.errors import HostsUpdatedInterrupt
from commlayer.common.reduce_ops import Max
from commlayer.core import runtime
from commlayer.elastic.sampler import ElasticSampler


class State:
    """Base of the elastic states: reset callbacks and host-update checks; subclasses define
    ``save``, ``restore`` and ``sync``.

    ``bcast_object`` / ``get_rank``: Horovod passes its functions; commlayer's by default.
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or state_sync.broadcast_object
        self._rank = get_rank or runtime.rank
        self._host_messages: queue.Queue[tuple[float, bool]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._pending: tuple[Any, float] | None = None  # check_host_updates' in flight
        self._deferred: bool | None = None  # whether it is (under the elastic driver)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call after a reset (a retry of the training function), in order."""
        callbacks = list(callbacks)
        bad = [c for c in callbacks if not callable(c)]
        if bad:
            raise ValueError(f"register_reset_callbacks: not callable: {bad!r}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self._pending = None
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, removed_only: bool = False) -> None:
        """Record a host update (Horovod's driver calls this; under MPI nothing does, since the
        world cannot change: it is here for code that watches hosts itself)."""
        self._host_messages.put((timestamp, removed_only))

    def joined_world(self, formed: float) -> None:
        """Elastic driver: this rank joined a world formed at ``formed`` (the driver's clock);
        host updates up to then are part of it (every rank starts from the same point)."""
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = formed
        self._pending = None  # a check of the old world: its engine is gone

    def commit(self) -> None:
        """Save the state in memory (a copy), then check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank if any rank recorded a host update newer
        than the last one seen (collective: every rank calls it, as commit does).

        Under commlayerrun's elastic driver the check is one commit behind: each call starts
        the agreement on what this rank has seen now (an allreduce in the background) and
        reads the one the call before started, which is done by then. The driver's notices
        come whenever they come, so every rank still raises at the same commit, one commit
        later; the commit no longer waits for the other ranks (that wait was ~90% of a
        commit's time, benchmarks/elastic_recovery.py's MLP at 3 ranks). Elsewhere (updates
        recorded by the code itself) the check is immediate."""
        if self._deferred is None:
            self._deferred = config.elastic_worker() is not None
        pending, self._pending = self._pending, None
        if pending is not None:
            self._agree(*pending)
        started = self._start_check()
        if self._deferred:
            self._pending = started
        else:
            self._agree(*started)

    def _start_check(self) -> tuple[Any, float]:
        newest, removed_only = self._last_updated_timestamp, True
        while not self._host_messages.empty():
            timestamp, removed = self._host_messages.get()
            if timestamp > newest:
                newest, removed_only = timestamp, removed_only and removed
        # Every rank must raise together: the newest update any rank saw, and whether any rank
        # saw a newer one that added hosts: one allreduce (Max) of two float64s (the driver's
        # timestamps travel exactly).
        previous = self._last_updated_timestamp
        mine = torch.tensor(
            [newest, float(newest > previous and not removed_only)], dtype=torch.float64
        )
        return ops.allreduce_async_(mine, name="elastic.host_updates", op=Max), previous

    def _agree(self, handle: Any, previous: float) -> None:
        seen = ops.synchronize(handle)
        self._last_updated_timestamp = max(self._last_updated_timestamp, float(seen[0]))
        if float(seen[0]) > previous:
            self._pending = None
            raise HostsUpdatedInterrupt(bool(seen[1] == 0))

    def save(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define save() (see ObjectState)")

    def restore(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define restore() (see ObjectState)")

    def sync(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define sync() (see ObjectState)")


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and read and written as
    attributes (``state.epoch += 1``); ``sync`` broadcasts them from rank 0."""

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


class _Handler:
    """Saves, restores and syncs one object that has state_dict()/load_state_dict()."""

    def __init__(self, value: Any) -> None:
        self.value = value
        _Handler.save(self)  # this rank's own: no collective when a state is made (a worker
        # joining a running job makes its state while the others sync theirs)

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(state_sync.broadcast_object(self.value.state_dict()))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        state_sync.broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        state_sync.broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        # Samples any rank processed are done for all: the union of every rank's record.
        state = copy.deepcopy(self.value.state_dict())
        done: set[int] = set()
        for indices in state_sync.allgather_object(
            state["processed_indices"], name="elastic.sampler"
        ):
            done.update(indices)
        state["processed_indices"] = sorted(done)
        self.value.load_state_dict(copy.deepcopy(state))  # every rank holds the union
        self._saved = state


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _SamplerHandler),
]


class TorchState(ObjectState):
    """State of a PyTorch training process: ``model``, ``optimizer`` and any keyword arguments;
    modules, optimizers, LR schedulers and ElasticSamplers are saved through their state_dict,
    synced with broadcast_parameters / broadcast_optimizer_state / broadcast_object; anything
    else is a plain object (ObjectState). Assigning a new model or optimizer to the attribute
    saves it at once."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                plain[name] = value
            else:
                handlers[name] = kind(value)
        self._handlers: dict[str, _Handler]
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def on_reset(self) -> None:
        # the world may have another size now: samplers repartition what is left of the epoch
        for handler in self._handlers.values():
            if isinstance(handler.value, ElasticSampler):
                handler.value.reset()
        super().on_reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)
