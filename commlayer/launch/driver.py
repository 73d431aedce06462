"""commlayerrun's elastic driver (Horovod's ``horovodrun --min-np/--max-np/
--host-discovery-script``): starts the workers, runs their rendezvous, watches them and the
hosts, and on a death or a change of hosts has the survivors form a new world.

    commlayerrun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        [--elastic-timeout 600] [--reset-limit K] [--blacklist-cooldown-range 10 60] \\
        python train.py

It follows Horovod's elastic driver where Horovod's own tests state its behaviour
(test/integration/elastic_common.py):

1. Hosts: the discovery script prints ``host:slots`` lines (a bare ``host`` has ``--slots``
   slots). It runs on a thread of its own every second; a run that fails or hangs is retried
   with backoff while the last good host list stands, and the job fails only after
   ``--elastic-timeout`` seconds without one good run. Without a script, ``-H host:slots,...``
   is a fixed set of hosts. A host that is this machine (``localhost``, ``127.0.0.1``, its
   name) gets its workers as child processes; a host of the namespace cluster
   (scripts/cluster.sh, ``nodeK``) through the cluster's launcher (launcher.py runs the driver
   itself on the cluster's first host: the root namespace has no route into the cluster).
   Loopback addresses (127.0.0.0/8) are this machine too: several names for one machine.
2. Ranks (Horovod's ``get_host_assignments``): hosts in the order they were first seen, each
   host's slots in turn, at most ``--max-np`` workers. Every worker still alive keeps its place,
   and the hosts and slots that hold one come first, so rank 0 of a new world holds the last
   commit, as the state's sync from rank 0 needs; new slots come after. A worker gets its place
   in the environment when it starts (HOROVOD_HOSTNAME, HOROVOD_RANK, HOROVOD_SIZE,
   HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE).
3. Failures: a worker that exits non-zero (killed, an uncaught error, stopped by the heartbeat
   watch) blacklists its host, as Horovod does; ``--blacklist-scope slot`` blames its slot only
   (the other workers of that host stay). A blacklisted host comes back after a cooldown drawn
   as Horovod draws it from ``--blacklist-cooldown-range LO HI``: ``LO * 2**failures + U(0, 1) *
   LO`` seconds, clamped to [LO, HI], longer with every failure of that host; without the range
   it stays out for the rest of the job (Horovod's default). The members of the world the dead
   worker was in get a notice (their engine fails with RankDiedError; on this host it also sees
   the pid gone) and come back to the rendezvous.
4. Host changes: as soon as discovery shows hosts that would change the world (added, removed,
   or back from the blacklist), every worker of the current world gets a ``hosts_updated``
   notice, those on removed hosts included, and every rank raises HostsUpdatedInterrupt at the
   same commit (State.check_host_updates). Workers for the new slots are started at once, so
   that their start-up (torch's import) overlaps the training that goes on until that commit;
   slots found in one discovery join in one re-formation.
5. The rendezvous: a world breaks when one of its workers comes back to the rendezvous or
   dies; once every one of them has come back or exited, the world re-forms (a reset: more than
   ``--reset-limit`` of them ends the job, counted as Horovod counts them). It forms when every
   slot of the plan has its worker waiting, at least ``--min-np`` of them (``-np`` for the
   first world, until a worker fails); fewer than that for longer than ``--elastic-timeout``
   ends the job. Workers whose slot is not in the plan (their host removed or blacklisted) are
   told to exit with code 0. A member that dies while a world forms breaks it (the others'
   torch.distributed set-up fails at once instead of waiting for its key) and the rendezvous
   starts over.
6. The last commit lives in the workers' memory. A new world with no worker of the last one
   (every one died, or their hosts are gone) would start from scratch: the job fails naming it
   (Horovod: "No hosts from previous set remaining"), unless ``--on-state-lost reset``, where
   the world forms and every rank runs the state's reset callbacks before the sync (restore
   from your own checkpoint there). Every worker failing is an error too.
7. Ending: when a worker exits 0 the job is finishing: no world forms any more, workers waiting
   for one are told to exit, and the job's exit code is 0 once every worker has exited. On an
   error the driver prints it, stops every worker (SIGTERM, then SIGKILL) and exits 1.
8. Lost workers: each worker sends a heartbeat every second on its event connection; one not
   heard from for ``--heartbeat-timeout`` seconds (default 10: its host's link is down, or it
   is frozen) is SIGKILLed and is dead as in 3.
9. Security (elastic/protocol.py): a job key of 32 random bytes, handed to the workers in their
   environment (to a cluster host on the launcher's stdin, never on a command line); every
   message signed (HMAC-SHA256, per-connection nonce and counters); a connection that fails the
   handshake, or names no worker this driver started, is refused and logged. The rendezvous
   store is the driver's dictionary reached over that channel (elastic/rendezvous.py), not an open
   TCPStore.
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import logging
import math
import os
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from commlayer.elastic import protocol
from commlayer.launch import hosts as hostlist
from commlayer.launch.server import Server

log = logging.getLogger("commlayer.launch.driver")

_POLL_S = 0.2
_DISCOVERY_S = 1.0  # Horovod's DISCOVER_HOSTS_FREQUENCY_SECS
_DISCOVERY_TIMEOUT_S = 30.0
_DISCOVERY_BACKOFF_MAX_S = 30.0
# A worker whose heartbeats (one a second) stopped this long ago is lost: its host's link is
# down, or it is frozen. commlayerrun --heartbeat-timeout changes it.
HEARTBEAT_TIMEOUT_S = 10.0
SCOPES = ("host", "slot")
ON_STATE_LOST = ("fail", "reset")
_STORE_PREFIX = "commlayer/elastic/"  # + generation + "/": elastic/rendezvous.py's DriverStore


def local_names() -> set[str]:
    """Host names that mean this machine (besides the loopback addresses: ``is_local``)."""
    names = {"localhost", "127.0.0.1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: one of its names, or a loopback address (127.0.0.0/8:
    distinct host names for one machine, as Horovod's tests use localhost and 127.0.0.1)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in local_names()


def route_to(host: str) -> str:
    """This machine's address that packets to ``host`` leave from (a UDP socket's connect asks
    the routing table; nothing is sent); JobError when ``host`` cannot be reached."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise JobError(
            f"host {host!r}: no route to it from this machine ({exc}); give --driver-address "
            "with this machine's address that reaches the hosts"
        ) from None


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def parse_hosts(text: str, default_slots: int = 1, what: str = "hosts") -> dict[str, int]:
    """``{host: slots}`` from ``host:slots`` entries (lines or commas; launch/hosts.py); {} for
    none; ValueError naming the bad entry."""
    return hostlist.parse(text, what, default_slots)


def discovery_script(path: str, default_slots: int) -> Callable[[], dict[str, int]]:
    """A function running the discovery script: its hosts, or ValueError when it fails, hangs
    past _DISCOVERY_TIMEOUT_S (it is stopped, with whatever it started) or prints garbage."""
    command = [path] if os.access(path, os.X_OK) else ["sh", path]

    def discover() -> dict[str, int]:
        try:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise ValueError(f"host discovery script {path}: {exc}") from None
        try:
            out, err = proc.communicate(timeout=_DISCOVERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)  # and what it started, which holds its pipes
            proc.communicate()
            raise ValueError(
                f"host discovery script {path} ran past {_DISCOVERY_TIMEOUT_S:g} s; stopped"
            ) from None
        if proc.returncode != 0:
            raise ValueError(
                f"host discovery script {path} exited with {proc.returncode}: {err.strip()}"
            )
        return parse_hosts(out, default_slots, f"host discovery script {path}")

    return discover


@dataclasses.dataclass(frozen=True)
class Slot:
    """One place in a world, as Horovod's SlotInfo: the host's slot number ``slot`` (0 to the
    host's slot count - 1, what discovery counts), the world rank, the position among the
    host's workers (local) and among the hosts' workers of that local rank (cross)."""

    host: str
    slot: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def environ(self) -> dict[str, str]:
        """What a worker started for this slot finds in its environment (Horovod's names)."""
        return {
            "HOROVOD_HOSTNAME": self.host,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def assign(
    order: Sequence[str],
    hosts: Mapping[str, int],
    free: Callable[[str, int], bool],
    kept: Mapping[tuple[str, int], int],
    max_np: int,
) -> list[Slot]:
    """The next world's slots in rank order (module docstring, 2.): ``order``, the hosts in the
    order they were first seen; ``hosts``, their slot counts; ``free(host, slot)``, whether a
    slot is not blacklisted; ``kept``, the slots of the workers that stay, with their rank in
    the last world (they all stay, up to ``max_np``). New slots fill what is left of ``max_np``
    in host order. Hosts that keep a worker come first, and on each host its kept workers
    (by their old rank) before its new slots: rank 0 holds the last commit whenever any
    worker does."""
    place = {host: i for i, host in enumerate(order)}
    usable = [(h, s) for h in order for s in range(hosts.get(h, 0)) if free(h, s)]
    chosen = sorted((s for s in kept if s in set(usable)), key=lambda s: kept[s])[:max_np]
    taken = set(chosen)
    chosen += [s for s in usable if s not in taken][: max(0, max_np - len(chosen))]
    keeps = {h for h, _ in taken}
    by_host: dict[str, list[tuple[str, int]]] = {}
    for host, slot in chosen:
        by_host.setdefault(host, []).append((host, slot))
    host_order = sorted(by_host, key=lambda h: (h not in keeps, place[h]))
    cross: dict[int, list[str]] = {}
    for host in host_order:
        for local_rank in range(len(by_host[host])):
            cross.setdefault(local_rank, []).append(host)
    world: list[Slot] = []
    size = len(chosen)
    for host in host_order:
        # kept workers in their old rank order (the order chosen has them in), then new slots
        members = by_host[host]
        for local_rank, (_, slot) in enumerate(members):
            world.append(
                Slot(
                    host,
                    slot,
                    len(world),
                    size,
                    local_rank,
                    len(members),
                    cross[local_rank].index(host),
                    len(cross[local_rank]),
                )
            )
    return world


class Blacklist:
    """Failed hosts (or slots, scope "slot") kept out for a cooldown that grows with each
    failure (module docstring, 3.): Horovod's ``HostState``."""

    def __init__(self, cooldown_s: tuple[float, float] | None, scope: str) -> None:
        if scope not in SCOPES:
            raise ValueError(f"--blacklist-scope {scope!r}: expected one of {', '.join(SCOPES)}")
        self.cooldown_s, self.scope = cooldown_s, scope
        self._until: dict[Any, float] = {}
        self._failures: dict[Any, int] = {}

    def _key(self, host: str, slot: int) -> Any:
        return host if self.scope == "host" else (host, slot)

    def add(self, host: str, slot: int, now: float) -> float:
        """Blacklist ``host`` (or its ``slot``); the seconds it stays out (inf: for good). A
        host still cooling down keeps its end time, as Horovod's does."""
        key = self._key(host, slot)
        until = self._until.get(key, 0.0)
        if until > now:
            return until - now
        if self.cooldown_s is None:
            self._until[key] = math.inf
            return math.inf
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        lo, hi = self.cooldown_s
        delay = lo * 2 ** min(failures, 60) + random.uniform(0, 1) * lo
        self._until[key] = now + max(lo, min(hi, delay))
        return self._until[key] - now

    def blocked(self, host: str, slot: int, now: float) -> bool:
        return self._until.get(self._key(host, slot), 0.0) > now

    def host_blocked(self, host: str, now: float) -> bool:
        """Whether the whole host is out (scope "host"); with scope "slot" a host never is."""
        return self.scope == "host" and self.blocked(host, 0, now)

    def back(self, now: float) -> list[Any]:
        """Hosts (slots) whose cooldown has ended since the last call: discovery treats them
        as added (Horovod: resurrected)."""
        ended = [key for key, until in self._until.items() if until <= now]
        for key in ended:
            del self._until[key]
        return ended

    def what(self, host: str, slot: int) -> str:
        return f"host {host}" if self.scope == "host" else f"slot {host}:{slot}"


@dataclasses.dataclass
class Worker:
    name: str
    host: str
    slot: int
    proc: subprocess.Popen[bytes]
    order: int  # start order
    start_rank: int  # HOROVOD_RANK: its rank in the world planned when it started
    rank: int = -1  # in the world ``generation``; -1 until it joins one
    generation: int = 0  # the last world it joined (0: none yet)
    removed: bool = False  # its slot is gone: told to exit at its rendezvous
    exit_code: int | None = None


class JobError(RuntimeError):
    """Why the elastic job failed."""


class Driver:
    def __init__(
        self,
        command: Sequence[str],
        np: int,
        min_np: int,
        max_np: int,
        discover: Callable[[], dict[str, int]],
        environ: dict[str, str],
        elastic_timeout_s: float = 600.0,
        reset_limit: int | None = None,
        cooldown_s: tuple[float, float] | None = None,
        cluster: Any = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        blacklist_scope: str = "host",
        on_state_lost: str = "fail",
        hosts: dict[str, int] | None = None,
        bind: str | None = None,
    ) -> None:
        if not 1 <= min_np <= np <= max_np:
            raise ValueError(f"need 1 <= --min-np ({min_np}) <= -np ({np}) <= --max-np ({max_np})")
        if on_state_lost not in ON_STATE_LOST:
            raise ValueError(
                f"--on-state-lost {on_state_lost!r}: expected one of {', '.join(ON_STATE_LOST)}"
            )
        self.command, self.np, self.min_np, self.max_np = list(command), np, min_np, max_np
        self.discover, self.environ, self.cluster = discover, environ, cluster
        self.elastic_timeout_s, self.reset_limit = elastic_timeout_s, reset_limit
        self.heartbeat_timeout_s, self.on_state_lost = heartbeat_timeout_s, on_state_lost
        self.blacklist = Blacklist(cooldown_s, blacklist_scope)
        self.key = secrets.token_bytes(32)
        self.refused = 0  # connections refused (tests read it)
        self._cv = threading.Condition()
        self._store: dict[str, bytes] = {}
        self._broken: set[int] = set()  # worlds a member died in: their store waits fail
        self._workers: dict[str, Worker] = {}
        self._waiting: set[str] = set()
        self._replies: dict[str, dict[str, Any]] = {}
        self._events: dict[str, tuple[threading.Lock, protocol.Channel]] = {}
        self._seen: dict[str, float] = {}  # worker -> its last heartbeat (time.monotonic())
        self._generation = 0  # the last world formed (0: none yet)
        self._members: list[str] = []  # its workers, in rank order
        self._reformed = False  # the current round's reset is counted
        self._death = False  # a member of the current world died
        self._resets = 0
        self._started = 0
        self._failures = 0
        self._hosts: dict[str, int] = dict(hosts) if hosts is not None else {}
        self._order: list[str] = []  # hosts in the order first seen (Horovod's assignment order)
        self._changed = True  # hosts or the blacklist changed since the plan was last checked
        self._discovered: dict[str, int] | None = None  # the discovery thread's newest result
        self._discovery_ok = time.monotonic()  # when discovery last succeeded
        self._discovery_error = ""
        self._short_since: float | None = None  # when the plan fell below the workers needed
        self._short_said = False
        self._finishing = False
        self._stopping = False
        # the control channel's address (``_address``): None for loopback when every host is
        # this machine, else the address that reaches the others
        self.bind = bind or None
        self._server: Server | None = None  # listening from the first worker's start
        self._update_order(time.monotonic())

    # -- control channel (the server: commlayer/launch/server.py) --------------------------
    def _refuse(self, peer: str, why: object) -> None:
        with self._cv:
            self.refused += 1
        log.warning("commlayerrun: refused a connection from %s: %s", peer, why)

    def _connection(self, channel: protocol.Channel, hello: Any, peer: str) -> None:
        """A connection whose greeting verified (the server's ``serve``, in a thread of its
        own): a worker of this job's requests, or its event stream."""
        name = hello.get("worker") if isinstance(hello, dict) else None
        with self._cv:
            known = isinstance(name, str) and name in self._workers and hello.get("op") == "hello"
        if not known or not isinstance(name, str):
            self._refuse(peer, f"signed, but names no worker of this job ({name!r})")
            channel.close()
            return
        try:
            channel.send({"ok": True})
            if hello.get("role") == "events":
                with self._cv:
                    self._events[name] = (threading.Lock(), channel)
                    self._seen[name] = time.monotonic()
                try:
                    while True:  # the worker's heartbeats (rendezvous.py's _heartbeats)
                        channel.recv()
                        self._seen[name] = time.monotonic()
                finally:  # closed: the worker exited (_reap sees how), nothing to watch
                    self._seen.pop(name, None)
            while True:
                message = channel.recv()
                channel.send(self._handle(name, message))
        except (OSError, ConnectionError) as exc:
            if isinstance(exc, protocol.AuthError):
                self._refuse(peer, exc)
            channel.close()

    def _handle(self, name: str, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        with self._cv:
            if op == "rendezvous":
                self._waiting.add(name)
                self._replies.pop(name, None)
                self._cv.notify_all()
                self._cv.wait_for(lambda: name in self._replies or self._stopping)
                return self._replies.pop(name, {"error": "the elastic driver stopped"})
            if op == "set":
                self._store[message["key"]] = base64.b64decode(message["value"])
                self._cv.notify_all()
                return {}
            if op in ("get", "wait"):
                keys = [message["key"]] if op == "get" else list(message["keys"])
                timeout = float(message.get("timeout") or 300)
                world = _world_of(keys[0])

                def done() -> bool:
                    return (
                        self._stopping
                        or world in self._broken
                        or all(k in self._store for k in keys)
                    )

                if not self._cv.wait_for(done, timeout):
                    return {"error": f"rendezvous store: waited {timeout:g} s for {keys}"}
                if world in self._broken and not all(k in self._store for k in keys):
                    return {"error": f"world {world} broke while it formed: a worker of it died"}
                if op == "get" and keys[0] in self._store:
                    return {"value": base64.b64encode(self._store[keys[0]]).decode()}
                return {} if op == "wait" else {"error": "the elastic driver stopped"}
            if op == "add":
                value = int(self._store.get(message["key"], b"0")) + int(message["amount"])
                self._store[message["key"]] = str(value).encode()
                self._cv.notify_all()
                return {"value": value}
            if op == "check":
                return {"ok": all(k in self._store for k in message["keys"])}
            if op == "compare_set":
                key = message["key"]
                current_value: bytes | None
                expected = base64.b64decode(message["expected"])
                desired = base64.b64decode(message["desired"])
                current_value = self._store.get(key)
                if (current_value is None and not expected) or current_value == expected:
                    self._store[key] = current_value = desired
                    self._cv.notify_all()
                now_set = expected if current_value is None else current_value
                return {"value": base64.b64encode(now_set).decode()}
            if op == "delete":
                return {"ok": self._store.pop(message["key"], None) is not None}
        return {"error": f"unknown request {op!r}"}

    def _notify(self, names: Sequence[str], notice: dict[str, Any]) -> None:
        for name in names:
            found = self._events.get(name)
            if found is None:
                continue
            lock, channel = found
            try:
                with lock:
                    channel.send(notice)
            except OSError:
                pass

    # -- workers --------------------------------------------------------------------------------
    def _address(self) -> str:
        """What the workers connect to: the control channel's address. The server starts at
        the first call, listening on ``bind``, else on loopback when every host is this
        machine, else on the address that reaches the first other host. Listening on every
        interface (0.0.0.0), the workers get loopback or that address alike."""
        remote = [host for host in self._hosts if not is_local(host)]
        if self._server is None:
            listen = self.bind or (route_to(remote[0]) if remote else "127.0.0.1")
            try:
                self._server = Server(self.key, self._connection, self._refuse, listen)
            except OSError as exc:
                raise JobError(f"the driver cannot listen on {listen!r}: {exc}") from None
            self._server.start()
        host = self._server.host
        if host == "0.0.0.0":
            host = route_to(remote[0]) if remote else "127.0.0.1"
        elif remote and _loopback(host) and not _loopback(route_to(remote[0])):
            raise JobError(
                f"host {remote[0]!r} is not this machine, and the driver listens on {host} only "
                "(as --driver-address said, or every host was this machine when the first worker "
                "started): give --driver-address with this machine's address that reaches the "
                "hosts, or 0.0.0.0 for all of its addresses"
            )
        return f"{host}:{self._server.port}"

    def _spawn(self, place: Slot) -> Worker:
        self._started += 1
        host = place.host
        name = f"{host}:{place.slot}:{self._started}"
        env = dict(self.environ)
        env.update(place.environ())
        env.update(COMMLAYER_ELASTIC_DRIVER=self._address(), COMMLAYER_ELASTIC_WORKER=name)
        if is_local(host):
            env["COMMLAYER_ELASTIC_KEY"] = self.key.hex()
            proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        elif self.cluster is not None:
            names = [k for k in env if k.startswith(("COMMLAYER_", "HOROVOD_", "OMP_", "PYTHON"))]
            names += list(self.cluster.environ)
            exports = " ".join(f"{k}={shlex.quote(env[k])}" for k in sorted(set(names)) if k in env)
            remote = (
                f"cd {shlex.quote(os.getcwd())} && read -r COMMLAYER_ELASTIC_KEY && "
                f"export COMMLAYER_ELASTIC_KEY && exec env {exports} {shlex.join(self.command)}"
            )
            proc = subprocess.Popen(
                [self.cluster.launch, host, remote], stdin=subprocess.PIPE, start_new_session=True
            )
            assert proc.stdin is not None
            proc.stdin.write(self.key.hex().encode() + b"\n")
            proc.stdin.close()
        else:
            raise JobError(
                f"host {host!r}: not this machine and not a host of the namespace cluster; the "
                "elastic driver starts workers locally or on scripts/cluster.sh's hosts"
            )
        worker = self._workers[name] = Worker(
            name, host, place.slot, proc, self._started, place.rank
        )
        log.info("commlayerrun: started worker %s (pid %d) as rank %d", name, proc.pid, place.rank)
        return worker

    def _live(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.exit_code is None and not w.removed]

    def _member_workers(self) -> list[Worker]:
        return [self._workers[name] for name in self._members]

    def _update_order(self, now: float) -> None:
        """Horovod's host assignment order: the hosts still there (and not blacklisted) keep
        their place, new ones (and those back from the blacklist) go after them."""
        there = [h for h in self._hosts if not self.blacklist.host_blocked(h, now)]
        self._order = [h for h in self._order if h in there]
        self._order += [h for h in there if h not in self._order]

    def _plan(self, now: float, kept: Sequence[Worker]) -> list[Slot]:
        return assign(
            self._order,
            self._hosts,
            lambda host, slot: not self.blacklist.blocked(host, slot, now),
            {(w.host, w.slot): w.rank for w in kept},
            self.max_np,
        )

    # -- what happened --------------------------------------------------------------------------
    def _take_discovery(self, now: float) -> None:
        """The discovery thread's newest hosts, and hosts back from the blacklist."""
        hosts, self._discovered = self._discovered, None
        if hosts is not None and hosts != self._hosts:
            log.info("commlayerrun: hosts %s -> %s", self._hosts, hosts)
            self._hosts, self._changed = hosts, True
        back = self.blacklist.back(now)
        if back:
            log.info("commlayerrun: back from the blacklist: %s", back)
            self._changed = True
        if self._changed:
            self._update_order(now)
        if self._discovery_error and now - self._discovery_ok > self.elastic_timeout_s:
            raise JobError(
                f"host discovery has not succeeded for more than --elastic-timeout "
                f"{self.elastic_timeout_s:g} s: {self._discovery_error}"
            )

    def _reap(self, now: float) -> None:
        for worker in self._workers.values():
            if worker.exit_code is not None:
                continue
            code = worker.proc.poll()
            if code is None:
                continue
            worker.exit_code = code
            self._waiting.discard(worker.name)
            if worker.removed:
                log.info("commlayerrun: worker %s (slot removed) exited %d", worker.name, code)
            elif code == 0:
                if not self._finishing:
                    log.info("commlayerrun: worker %s finished; the job is finishing", worker.name)
                self._finishing = True
            else:
                self._died(worker, now)
        for name in list(self._waiting):
            # once finishing, no world forms any more: all leave; removed workers always do
            if self._finishing or self._workers[name].removed:
                self._replies[name] = {"exit": True}
                self._waiting.discard(name)
        self._cv.notify_all()

    def _died(self, worker: Worker, now: float) -> None:
        self._failures += 1
        out = self.blacklist.add(worker.host, worker.slot, now)
        what = self.blacklist.what(worker.host, worker.slot)
        when = "for the rest of the job" if math.isinf(out) else f"for {out:.1f} s"
        rank = f"rank {worker.rank} of world {worker.generation}" if worker.rank >= 0 else "no rank"
        print(
            f"commlayerrun: worker {worker.name} ({rank}) exited with "
            f"{worker.proc.returncode}; {what} blacklisted {when}",
            file=sys.stderr,
            flush=True,
        )
        self._changed = True
        self._update_order(now)
        if worker.name in self._members and worker.generation == self._generation:
            self._death = True
            self._broken.add(self._generation)
            notice = {"event": "dead", "generation": self._generation, "ranks": [worker.rank]}
            self._notify([w.name for w in self._member_workers() if w.exit_code is None], notice)
        if not any(w.exit_code is None for w in self._workers.values()) and not self._finishing:
            every = [w for w in self._workers.values() if not w.removed]
            if all(w.exit_code for w in every):
                codes = sorted({w.exit_code for w in every if w.exit_code})
                raise JobError(
                    f"every worker failed (exit codes {codes}); nothing is left to continue "
                    "from (the last commit lives in the workers' memory)"
                )

    def _watch(self, now: float) -> None:
        """Stop the workers whose heartbeats stopped (their host's link is down, or they are
        frozen): SIGKILL to their process group; ``_reap`` then sees them dead and tells the
        survivors, whose collectives with them would otherwise wait on a silent peer."""
        for worker in self._live():
            seen = self._seen.get(worker.name)
            if seen is None or now - seen <= self.heartbeat_timeout_s:
                continue
            del self._seen[worker.name]
            print(
                f"commlayerrun: worker {worker.name} (rank {worker.rank}) sent no heartbeat for "
                f"{now - seen:.1f} s (more than --heartbeat-timeout "
                f"{self.heartbeat_timeout_s:g} s): host {worker.host} unreachable (link down?) "
                "or the worker frozen; stopping it",
                file=sys.stderr,
                flush=True,
            )
            _signal_group(worker.proc, signal.SIGKILL)

    # -- worlds ---------------------------------------------------------------------------------
    def _breaking(self) -> bool:
        """Whether the current world is being left: no world yet, or every member has come
        back to the rendezvous or exited (Horovod's barrier of the last world's workers)."""
        if self._generation == 0:
            return True
        return all(
            w.exit_code is not None or w.removed or w.name in self._waiting
            for w in self._member_workers()
        )

    def _running(self, now: float) -> None:
        """The world trains: when the hosts changed so that the world would (module
        docstring, 4.), tell every member at once and start the new slots' workers."""
        if not self._changed or self._death:
            return  # (a member died: every member is told and comes back; _form plans)
        self._changed = False
        members = [w for w in self._member_workers() if w.exit_code is None]
        plan = self._plan(now, [w for w in members if not w.removed])
        now_slots = {(w.host, w.slot) for w in members}
        planned = {(s.host, s.slot) for s in plan}
        if planned == now_slots:
            return  # Horovod: no notice when the assignments would not change
        if len(plan) >= self.min_np:
            self._start_missing(plan)
        notice = {"event": "hosts_updated", "timestamp": now, "removed_only": planned <= now_slots}
        log.info("commlayerrun: hosts changed: telling world %d (%s)", self._generation, notice)
        self._notify([w.name for w in members], notice)

    def _start_missing(self, plan: Sequence[Slot]) -> dict[tuple[str, int], Worker]:
        """Workers for the plan's slots that have none (a live worker on a slot keeps it);
        the plan's occupants."""
        occupant: dict[tuple[str, int], Worker] = {}
        for worker in sorted(self._live(), key=lambda w: (w.name not in self._members, w.order)):
            occupant.setdefault((worker.host, worker.slot), worker)
        for place in plan:
            if (place.host, place.slot) not in occupant and not self._finishing:
                occupant[(place.host, place.slot)] = self._spawn(place)
        return occupant

    def _form(self, now: float) -> None:
        """Every member of the last world is back or gone: count the reset, plan the next
        world, tell the workers not in it to leave, start workers for its new slots, and form
        it once every one of them waits (module docstring, 5. and 6.)."""
        first = self._generation == 0
        if not first and not self._reformed:
            if self.reset_limit is not None and self._resets >= self.reset_limit:
                raise JobError(
                    f"the world re-formed --reset-limit {self.reset_limit} times; one more "
                    "was needed (number of resets exceeded the limit)"
                )
            self._resets += 1
            self._reformed = True
        survivors = [w for w in self._member_workers() if w.exit_code is None]
        if not first and self.on_state_lost == "fail":
            self._check_holders(survivors, now)
        plan = self._plan(now, survivors)
        needed = self.np if first and not self._failures else self.min_np
        if len(plan) < needed:
            self._short(now, len(plan), needed, first)
            return
        self._short_since, self._short_said = None, False
        planned = {(s.host, s.slot) for s in plan}
        keeps = [w for w in survivors if (w.host, w.slot) in planned]
        if not first and not keeps and self.on_state_lost == "fail":
            gone = ", ".join(sorted({w.host for w in survivors}))
            raise JobError(
                f"no worker of world {self._generation} is on the hosts available now (theirs: "
                f"{gone}, removed or blacklisted): nothing is left to continue from (Horovod: "
                "no hosts from the previous set remaining)"
            )
        for worker in self._live():
            if (worker.host, worker.slot) not in planned:
                self._leave(worker)
        occupant = self._start_missing(plan)
        for worker in self._live():
            if occupant.get((worker.host, worker.slot)) is not worker:
                self._leave(worker)  # a second worker for one slot (started before a change)
        if all(occupant[(s.host, s.slot)].name in self._waiting for s in plan):
            self._formed([occupant[(s.host, s.slot)] for s in plan], plan, now, bool(keeps))

    def _check_holders(self, survivors: Sequence[Worker], now: float) -> None:
        """JobError when no worker of the last world can be in the next one: every one of them
        exited, or every one's host (slot) is blacklisted (Horovod: "every active host is
        blacklisted" ends the job)."""
        members = self._member_workers()
        if not survivors:
            codes = sorted({w.exit_code for w in members if w.exit_code})
            raise JobError(
                f"every worker of world {self._generation} is gone (exit codes {codes}); "
                "nothing is left to continue from (the last commit lives in the workers' "
                "memory; --on-state-lost reset restarts from your own checkpoint instead)"
            )
        if all(self.blacklist.blocked(w.host, w.slot, now) for w in survivors):
            out = ", ".join(sorted({self.blacklist.what(w.host, w.slot) for w in survivors}))
            raise JobError(
                f"every worker of world {self._generation} failed or is on a blacklisted host "
                f"({out}): nothing is left to continue from (the last commit lives in the "
                "workers' memory)"
            )

    def _leave(self, worker: Worker) -> None:
        """``worker`` has no slot in the next world: it exits with 0 at its rendezvous."""
        worker.removed = True
        if worker.name in self._waiting:
            self._waiting.discard(worker.name)
            self._replies[worker.name] = {"exit": True}

    def _short(self, now: float, have: int, needed: int, first: bool) -> None:
        """Fewer slots than the next world needs: wait for more, --elastic-timeout at most."""
        self._short_since = self._short_since or now
        need = f"-np {needed} to start with" if first and not self._failures else None
        need = need or f"--min-np {needed}"
        if not self._short_said:
            self._short_said = True
            print(
                f"commlayerrun: {have} slot(s) available, fewer than {need}: waiting up to "
                f"--elastic-timeout {self.elastic_timeout_s:g} s for hosts (blacklisted: "
                f"{self._blacklisted(now) or 'none'})",
                file=sys.stderr,
                flush=True,
            )
        if now - self._short_since > self.elastic_timeout_s:
            raise JobError(
                f"only {have} worker(s) for more than --elastic-timeout "
                f"{self.elastic_timeout_s:g} s, fewer than {need}"
            )

    def _blacklisted(self, now: float) -> str:
        out = {
            self.blacklist.what(host, slot)
            for host, slots in self._hosts.items()
            for slot in range(slots)
            if self.blacklist.blocked(host, slot, now)
        }
        return ", ".join(sorted(out))

    def _formed(self, ordered: list[Worker], plan: list[Slot], now: float, kept: bool) -> None:
        before = set(self._members)
        joined = not before or any(w.name not in before for w in ordered)
        lost = bool(before) and not kept
        # a world that formed leaves nothing of the ones before it to wait for
        self._broken.update(range(1, self._generation + 1))
        self._generation += 1
        for worker, place in zip(ordered, plan, strict=True):
            worker.rank, worker.generation = place.rank, self._generation
            self._replies[worker.name] = {
                "rank": place.rank,
                "size": place.size,
                "generation": self._generation,
                "joined": joined,
                # the members kept the commit they agreed on: a removal alone needs no sync
                "skip_sync_ok": not joined and not self._death,
                "state_lost": lost,
                "timestamp": now,  # host notices up to now are part of this world
            }
        self._waiting.difference_update(w.name for w in ordered)
        self._members = [w.name for w in ordered]
        self._reformed = self._death = False
        log.info("commlayerrun: generation %d: %s", self._generation, self._members)
        print(
            f"commlayerrun: world {self._generation}: {len(ordered)} workers",
            file=sys.stderr,
            flush=True,
        )
        if lost:
            print(
                f"commlayerrun: world {self._generation} has no worker of the last world, which "
                "held the last commit: its workers start from their own state (--on-state-lost "
                "reset: the state's reset callbacks restore it)",
                file=sys.stderr,
                flush=True,
            )
        self._cv.notify_all()

    # -- discovery ------------------------------------------------------------------------------
    def _discovery(self) -> None:
        """Run discovery every _DISCOVERY_S; a failing or hanging run is retried with backoff
        while the last good host list stands (module docstring, 1.)."""
        delay = _DISCOVERY_S
        while not self._stopping:
            try:
                hosts = self.discover()
            except (ValueError, OSError) as exc:
                with self._cv:
                    if not self._discovery_error:
                        print(
                            f"commlayerrun: {exc}; keeping the last hosts and retrying (the job "
                            f"fails after --elastic-timeout {self.elastic_timeout_s:g} s "
                            "without one good run)",
                            file=sys.stderr,
                            flush=True,
                        )
                    self._discovery_error = str(exc)
                delay = min(delay * 2, _DISCOVERY_BACKOFF_MAX_S)
            else:
                with self._cv:
                    if self._discovery_error:
                        log.warning("commlayerrun: host discovery works again")
                    self._discovery_error = ""
                    self._discovered, self._discovery_ok = hosts, time.monotonic()
                    self._cv.notify_all()
                delay = _DISCOVERY_S
            with self._cv:
                self._cv.wait_for(lambda: self._stopping, delay)

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        threading.Thread(target=self._discovery, name="commlayerrun-discovery", daemon=True).start()

        def stop(signum: int, _: Any) -> None:
            raise JobError(f"commlayerrun got signal {signum}; stopping the workers")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, stop)
        try:
            with self._cv:
                while True:
                    now = time.monotonic()
                    self._watch(now)
                    self._reap(now)
                    self._take_discovery(now)
                    if self._finishing:
                        if all(w.exit_code is not None for w in self._workers.values()):
                            return 0
                    elif self._breaking():
                        self._form(now)
                    else:
                        self._running(now)
                    self._cv.wait(_POLL_S)
        except (JobError, ValueError) as exc:
            print(f"commlayerrun: elastic job failed: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            self._stop()

    def _stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._server is not None:
            self._server.close()
        # each worker is a session of its own (with whatever it started: DataLoader workers)
        groups = [w.proc for w in self._workers.values()]
        for proc in groups:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in groups:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _world_of(key: str) -> int:
    """The world (generation) a rendezvous store key belongs to; 0 for any other key."""
    rest = key.removeprefix(_STORE_PREFIX)
    number = rest.split("/", 1)[0] if rest != key else ""
    return int(number) if number.isdigit() else 0


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
