"""The worker's side of the elastic driver (commlayer/launch/driver.py): rendezvous, the
torch.distributed store, and the driver's notices.

A worker the driver started has COMMLAYER_ELASTIC_DRIVER (the driver's address),
COMMLAYER_ELASTIC_KEY (the job key) and COMMLAYER_ELASTIC_WORKER (its name) in its environment
(``config.elastic_worker()``). ``init()`` then calls ``init_process_group`` here instead of
reading torchrun's variables: it asks the driver for this worker's rank, the world's size and
the generation (``rendezvous``; it waits until every live worker asked, so survivors and new
workers form one world), and starts torch.distributed (gloo) over ``DriverStore``.

``DriverStore`` is a ``torch.distributed.Store`` written in Python (torch calls its methods for
gloo's address exchange) whose set/get/add/wait travel over the driver's authenticated channel
(protocol.py), with a key prefix of its own per generation: no open TCPStore that anyone on the
network could write, and no stale key of an earlier world read by a later one.

A second connection carries the driver's notices: hosts added or removed (``on_hosts_updated``
of the registered states: ``HostsUpdatedInterrupt`` at the next commit) and workers that died
(``torch_distributed.report_dead``: the engine fails its pending operations with RankDiedError
at its next peer check, also for a peer on another host whose pid it cannot check).

The other way, the same connection carries this worker's heartbeat, every second: the driver
stops a worker it has not heard from for ``--heartbeat-timeout`` (its host's link is down, or
it is frozen) and tells the others, which re-form without it.
"""

from __future__ import annotations

import base64
import logging
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commlayer.backends import torch_distributed
from commlayer.common import config
from commlayer.common.errors import CommlayerError
from commlayer.core import runtime
from commlayer.elastic import protocol

log = logging.getLogger("commlayer")


class WorkerRemoved(SystemExit):
    """The driver took this worker out of the job (its host was removed): it exits with 0."""

    def __init__(self, worker: str) -> None:
        super().__init__(0)
        self.worker = worker


class Client:
    """Request/response calls to the driver over one authenticated connection (thread-safe)."""

    def __init__(self, address: str, key: bytes, worker: str, role: str = "rpc") -> None:
        self.address, self.worker = address, worker
        try:
            self._channel = protocol.connect(address, key)
            self._channel.send({"op": "hello", "worker": worker, "role": role})
            reply = self._channel.recv()
        except (OSError, ConnectionError) as exc:
            raise CommlayerError(
                f"elastic worker {worker}: cannot reach the driver at {address}: {exc}"
            ) from exc
        if reply.get("error"):
            raise CommlayerError(
                f"elastic worker {worker}: the driver refused it: {reply['error']}"
            )
        self._lock = threading.Lock()

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                self._channel.send(message)
                reply: dict[str, Any] = self._channel.recv()
            except (OSError, ConnectionError) as exc:
                raise CommlayerError(
                    f"elastic worker {self.worker}: lost the driver at {self.address} ({exc})"
                ) from exc
        if reply.get("error"):
            raise CommlayerError(f"elastic worker {self.worker}: {reply['error']}")
        return reply

    def recv(self) -> Any:
        return self._channel.recv()

    def send(self, message: dict[str, Any]) -> None:
        """One message, no reply (the event connection's heartbeats; its notices are read by
        another thread: each direction counts its own frames)."""
        self._channel.send(message)

    def close(self) -> None:
        self._channel.close()


def _text(value: Any) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()


class DriverStore(dist.Store):
    """torch.distributed's store over the driver's channel, keys under ``prefix``."""

    def __init__(self, client: Client, prefix: str, timeout_s: float) -> None:
        super().__init__()
        self._client, self._prefix, self._timeout_s = client, prefix, timeout_s

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: Any) -> None:
        self._client.call({"op": "set", "key": self._key(key), "value": _text(value)})

    def get(self, key: str) -> bytes:
        reply = self._client.call({"op": "get", "key": self._key(key), "timeout": self._timeout_s})
        return base64.b64decode(reply["value"])

    def add(self, key: str, amount: int) -> int:
        return int(
            self._client.call({"op": "add", "key": self._key(key), "amount": amount})["value"]
        )

    def check(self, keys: list[str]) -> bool:
        return bool(self._client.call({"op": "check", "keys": [self._key(k) for k in keys]})["ok"])

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self._timeout_s
        self._client.call({"op": "wait", "keys": [self._key(k) for k in keys], "timeout": seconds})

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        reply = self._client.call(
            {
                "op": "compare_set",
                "key": self._key(key),
                "expected": _text(expected),
                "desired": _text(desired),
            }
        )
        return base64.b64decode(reply["value"])

    def delete_key(self, key: str) -> bool:
        return bool(self._client.call({"op": "delete", "key": self._key(key)})["ok"])


_lock = threading.Lock()
_client: Client | None = None
_store: DriverStore | None = None  # torch keeps a C++ reference only: the Python object lives here
_generation = -1
_states: weakref.WeakSet[Any] = weakref.WeakSet()


def client() -> Client:
    """This worker's connection to the driver (made on first use; the notices' thread too)."""
    global _client
    with _lock:
        if _client is None:
            worker = config.elastic_worker()
            if worker is None:
                raise CommlayerError(
                    "not started by commlayerrun's elastic driver (no COMMLAYER_ELASTIC_DRIVER)"
                )
            _client = Client(worker.driver, worker.key, worker.worker)
            events = Client(worker.driver, worker.key, worker.worker, role="events")
            threading.Thread(
                target=_notices, args=(events,), name="commlayer-elastic-notices", daemon=True
            ).start()
            threading.Thread(
                target=_heartbeats, args=(events,), name="commlayer-elastic-heartbeat", daemon=True
            ).start()
        return _client


def register_state(state: Any) -> None:
    """Tell ``state`` (``on_hosts_updated``) of the driver's host changes."""
    _states.add(state)


def join(state: Any) -> None:
    """``state`` trains in the world this worker last joined: its host checks start from when
    that world formed (``State.joined_world``), with the host changes the driver has reported
    in it so far (one that came before the state was registered, or while it re-formed, would
    be lost otherwise: the world would never grow)."""
    with _lock:
        state.joined_world(_formed)
        for timestamp, removed_only in _host_notices:
            state.on_hosts_updated(timestamp, removed_only)


_joined = True
_formed = 0.0
_skip_sync_ok = False
_state_lost = False
# set when a worker of the world this one is joining or in died (the driver said so)
_broken_event = threading.Event()
# How long an elastic worker whose world's set-up failed waits for the driver's word that a
# worker of it died (world_broken) before taking the error as its own: the driver reaps every
# 0.2 s and tells at once; a peer on a host cut off is known after --heartbeat-timeout only,
# and its world fails its set-up's store waits itself.
BROKEN_WAIT_S = 5.0
_dead_ranks: set[int] = set()  # those workers' ranks
_host_notices: list[tuple[float, bool]] = []  # the driver's host changes since the world formed


def formed() -> float:
    """When (the driver's clock) the world this worker last joined formed: host updates
    notified up to then are part of it; every rank starts its host checks from there, so that
    all raise HostsUpdatedInterrupt at the same commit, new workers included."""
    return _formed


def joined() -> bool:
    """Whether the world this worker last joined has workers the one before had not (then
    every rank syncs its state from rank 0, even after a removal)."""
    return _joined


def skip_sync_ok() -> bool:
    """Whether the world this worker last joined has the last one's members only, none of
    which died: after HostsUpdatedInterrupt (hosts removed only) they all hold the commit they
    raised it at, and the sync can be skipped."""
    return _skip_sync_ok


def state_lost() -> bool:
    """Whether the world this worker last joined has no worker of the one before it, which
    held the last commit (commlayerrun --on-state-lost reset formed it anyway): the state's
    reset callbacks restore it from the user's own checkpoint before the sync."""
    return _state_lost


def generation() -> int:
    """The generation (world) this worker last joined; -1 before the first."""
    return _generation


def world_broken(wait_s: float = BROKEN_WAIT_S) -> bool:
    """Whether the driver reported a worker of this worker's current world dead: an error while
    that world starts is then the death's, and the rendezvous starts over. Waits up to
    ``wait_s`` for the report: the others see a peer's death in gloo ("Connection reset by
    peer") before the driver reaps it and sends its notice (every 0.2 s), and an elastic
    worker's first world crashed so (benchmarks/elastic_recovery.py --changes, 1 of 30)."""
    return _broken_event.wait(wait_s)


def init_process_group(timeout_s: float) -> None:
    """Join the driver's next world and start torch.distributed over it (module docstring);
    WorkerRemoved (exit code 0) when the driver has taken this worker out of the job. A world
    whose worker dies while torch.distributed starts over it (the driver fails the store's
    waits of a broken world at once) is left, and the rendezvous starts over."""
    me = client()
    began = time.monotonic()
    while True:
        reply = me.call({"op": "rendezvous", "worker": me.worker})
        if reply.get("exit"):
            log.warning("commlayer elastic worker %s: removed from the job; exiting", me.worker)
            raise WorkerRemoved(me.worker)
        rank, size, gen = int(reply["rank"]), int(reply["size"]), int(reply["generation"])
        _enter(reply, gen)
        store = DriverStore(me, f"commlayer/elastic/{gen}/", timeout_s)
        try:
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=timeout_s),
            )
        except Exception as exc:  # torch's own types vary (DistStoreError, RuntimeError)
            if not world_broken():
                raise
            log.warning(
                "commlayer elastic worker %s: world %d broke while it formed (%s); rendezvous "
                "again",
                me.worker,
                gen,
                exc,
            )
            if dist.is_initialized():
                dist.destroy_process_group()
            continue
        global _store
        _store = store
        break
    log.info(
        "commlayer elastic worker %s: rank %d of %d, generation %d (rendezvous %.2f s)",
        me.worker,
        rank,
        size,
        gen,
        time.monotonic() - began,
    )


def _enter(reply: dict[str, Any], gen: int) -> None:
    """This worker is in world ``gen`` from now: notices of older worlds are stale (under the
    lock the notices' thread applies them with)."""
    global _generation, _joined, _formed, _skip_sync_ok, _state_lost
    with _lock:
        _generation = gen
        _broken_event.clear()
        _dead_ranks.clear()
        torch_distributed.report_dead([])
        _joined, _formed = bool(reply.get("joined", True)), float(reply["timestamp"])
        # the changes this world already has (the driver's clock: up to when it formed)
        _host_notices[:] = [n for n in _host_notices if n[0] > _formed]
    _skip_sync_ok = bool(reply.get("skip_sync_ok", False))
    _state_lost = bool(reply.get("state_lost", False))


HEARTBEAT_S = 1.0


def _heartbeats(events: Client) -> None:
    """Tell the driver this worker is alive, every HEARTBEAT_S: a worker it has not heard
    from for --heartbeat-timeout (its host's link down, or frozen) is stopped and the others
    re-form without it (driver.py). Ends when the connection does (``_notices`` then exits)."""
    while True:
        try:
            events.send({"op": "alive"})
        except (OSError, ConnectionError):
            return
        time.sleep(HEARTBEAT_S)


def _notices(events: Client) -> None:
    while True:
        try:
            notice = events.recv()
        except (OSError, ConnectionError) as exc:
            # the driver is gone (killed: it could not stop its workers): no world can form
            # any more, and a worker left alone would hold its slot and memory for ever
            sys.stderr.write(
                f"commlayer elastic worker {events.worker}: lost the driver ({exc}); exiting\n"
            )
            sys.stderr.flush()
            os._exit(1)
        kind = notice.get("event")
        if kind == "hosts_updated":
            with _lock:
                change = (float(notice["timestamp"]), bool(notice["removed_only"]))
                _host_notices.append(change)
                for state in list(_states):
                    state.on_hosts_updated(*change)
        elif kind == "dead":
            _dead(int(notice["generation"]), [int(r) for r in notice["ranks"]])


def _dead(gen: int, ranks: list[int]) -> None:
    """The driver's notice that ``ranks`` of world ``gen`` died: for this worker's current
    world only (a notice of an older world, arriving late, names other workers)."""
    with _lock:
        if gen != _generation:
            return
        _broken_event.set()
        _dead_ranks.update(ranks)  # every death of this world, not the newest one only
        torch_distributed.report_dead(sorted(_dead_ranks))


runtime.use_elastic_rendezvous(runtime.ElasticRendezvous(init_process_group, world_broken))
