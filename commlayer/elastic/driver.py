"""commlayerrun's elastic driver (Horovod's ``horovodrun --min-np/--max-np/
--host-discovery-script``): starts the workers, runs their rendezvous, watches them and the
hosts, and on a death or a change of hosts tells the survivors.

    commlayerrun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        [--elastic-timeout 600] [--reset-limit K] [--blacklist-cooldown-range 10 60] \\
        python train.py

- Hosts: the discovery script prints ``host:slots`` lines (a bare ``host`` has ``--slots``
  slots); it runs every second. Without one, ``-H host:slots,...`` is a fixed set of hosts
  (workers that die are still replaced after their cooldown). A host that is this machine
  (``localhost``, ``127.0.0.1``, its name) gets its workers as child processes; a host of the
  namespace cluster (scripts/cluster.sh, ``nodeK``) through the cluster's launcher. On the
  cluster commlayerrun runs the driver itself on the first host (launcher.py, as it runs
  mpiexec there: the root namespace has no route into the cluster). ssh to other machines is
  not done.
- Lost workers: each worker sends a heartbeat every second on its event connection; one not
  heard from for ``--heartbeat-timeout`` seconds (default 10: its host's link is down, or it
  is frozen) is SIGKILLed, which makes it dead as below: the survivors, whose collectives with
  it would wait on a silent peer until the collective timeout, get the notice at once.
- Workers: at most ``--max-np``, one per free slot. A worker that exits non-zero (killed, or
  an uncaught error) is dead: the survivors of its world get a notice (their engine fails with
  RankDiedError; on this host it sees the pid gone by itself) and ``hvd.elastic.run`` brings
  them back to the rendezvous. Its slot is out for a cooldown drawn from
  ``--blacklist-cooldown-range LO HI`` seconds, then comes back as a new slot (a new worker is
  started there); without the range it stays out (Horovod's default). A slot is blamed, not
  the whole host: the survivors on that host keep their slots.
- Host changes: workers on slots that disappeared are marked removed; workers are started on
  new slots; the workers of the current world get a ``hosts_updated`` notice, and every rank
  raises HostsUpdatedInterrupt at the same commit (State.check_host_updates). A removed worker
  is told at its rendezvous to exit (code 0); new workers wait at the rendezvous until the
  others come.
- Rendezvous: a new world (generation) forms when every live worker asks for one; survivors
  keep their order (the lowest old rank is rank 0, whose state every rank syncs from) and new
  workers come after them. Fewer live workers than ``--min-np`` for longer than
  ``--elastic-timeout`` is an error; so is every worker dead (an in-memory commit does not
  outlive its last holder), and more than ``--reset-limit`` re-formations.
- Ending: when a worker exits 0 the job is finishing: no world forms any more, workers waiting
  for one are told to exit, and the job's exit code is 0 once every worker has exited. On an
  error the driver prints it, stops every worker (SIGTERM, then SIGKILL) and exits 1.
- Security (protocol.py): a job key of 32 random bytes, handed to the workers in their
  environment (to a cluster host on the launcher's stdin, never on a command line); every
  message signed (HMAC-SHA256, per-connection nonce and counters); a connection that fails the
  handshake within 5 s, or names no worker this driver started, is refused and logged. The
  rendezvous store is the driver's dictionary reached over that channel (rendezvous.py), not an
  open TCPStore.
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import logging
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
from collections.abc import Callable, Sequence
from typing import Any

from commlayer import hosts as hostlist
from commlayer.core import elastic_protocol as protocol
from commlayer.elastic.server import Server

log = logging.getLogger("commlayer.elastic.driver")

_POLL_S = 0.2
_DISCOVERY_S = 1.0
_DISCOVERY_TIMEOUT_S = 30.0
# A worker whose heartbeats (one a second) stopped this long ago is lost: its host's link is
# down, or it is frozen. commlayerrun --heartbeat-timeout changes it.
HEARTBEAT_TIMEOUT_S = 10.0


def local_names() -> set[str]:
    """Host names that mean this machine."""
    names = {"localhost", "127.0.0.1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


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
    """``{host: slots}`` from ``host:slots`` entries (lines or commas; commlayer/hosts.py); {}
    for none; ValueError naming the bad entry."""
    return hostlist.parse(text, what, default_slots)


def discovery_script(path: str, default_slots: int) -> Callable[[], dict[str, int]]:
    """A function running the discovery script (ValueError when it fails or prints garbage)."""

    def discover() -> dict[str, int]:
        try:
            out = subprocess.run(
                [path] if os.access(path, os.X_OK) else ["sh", path],
                capture_output=True,
                text=True,
                timeout=_DISCOVERY_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ValueError(f"host discovery script {path}: {exc}") from None
        if out.returncode != 0:
            raise ValueError(
                f"host discovery script {path} exited with {out.returncode}: {out.stderr.strip()}"
            )
        return parse_hosts(out.stdout, default_slots, f"host discovery script {path}")

    return discover


@dataclasses.dataclass
class Worker:
    name: str
    host: str
    slot: int
    proc: subprocess.Popen[bytes]
    order: int  # start order: new workers rank after the survivors, in this order
    rank: int = -1  # in the current world; -1 until it joins one
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
        bind: str | None = None,
    ) -> None:
        if not 1 <= min_np <= np <= max_np:
            raise ValueError(f"need 1 <= --min-np ({min_np}) <= -np ({np}) <= --max-np ({max_np})")
        self.command, self.np, self.min_np, self.max_np = list(command), np, min_np, max_np
        self.discover, self.environ, self.cluster = discover, environ, cluster
        self.elastic_timeout_s, self.reset_limit, self.cooldown_s = (
            elastic_timeout_s,
            reset_limit,
            cooldown_s,
        )
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.key = secrets.token_bytes(32)
        self.refused = 0  # connections refused (tests read it)
        self._cv = threading.Condition()
        self._store: dict[str, bytes] = {}
        self._workers: dict[str, Worker] = {}
        self._waiting: set[str] = set()
        self._replies: dict[str, dict[str, Any]] = {}
        self._events: dict[str, tuple[threading.Lock, protocol.Channel]] = {}
        self._seen: dict[str, float] = {}  # worker -> its last heartbeat (time.monotonic())
        self._generation = 0
        self._resets = 0
        self._started = 0
        self._hosts: dict[str, int] = {}
        self._cooling: dict[tuple[str, int], float] = {}  # slot -> when it comes back
        self._short_since: float | None = None  # when live workers fell below min_np
        self._announced: set[str] = set()  # new workers the world was told of
        self._finishing = False
        self._stopping = False
        self._error: str | None = None
        # the control channel's address (``_address``): None for loopback when every host is
        # this machine, else the address that reaches the others
        self.bind = bind or None
        self._server: Server | None = None  # listening from the first worker's start

    # -- control channel (the server: commlayer/elastic/server.py) --------------------------
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
                if not self._cv.wait_for(
                    lambda: self._stopping or all(k in self._store for k in keys), timeout
                ):
                    return {"error": f"rendezvous store: waited {timeout:g} s for {keys}"}
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
        remote = [host for host in self._hosts if host not in local_names()]
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

    def _spawn(self, host: str, slot: int) -> None:
        self._started += 1
        name = f"{host}:{slot}:{self._started}"
        env = dict(self.environ)
        env.update(COMMLAYER_ELASTIC_DRIVER=self._address(), COMMLAYER_ELASTIC_WORKER=name)
        if host in local_names():
            env["COMMLAYER_ELASTIC_KEY"] = self.key.hex()
            proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        elif self.cluster is not None:
            names = [k for k in env if k.startswith(("COMMLAYER_", "OMP_", "PYTHON"))]
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
        self._workers[name] = Worker(name, host, slot, proc, self._started)
        log.info("commlayerrun: started worker %s (pid %d)", name, proc.pid)

    def _live(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.exit_code is None and not w.removed]

    def _fill(self, now: float) -> bool:
        """Start workers on free slots (up to max_np); whether any started."""
        if self._finishing:
            return False
        taken = {(w.host, w.slot) for w in self._live()}
        started = False
        for host, slots in self._hosts.items():
            for slot in range(slots):
                if len(self._live()) >= self.max_np:
                    return started
                if (host, slot) in taken or self._cooling.get((host, slot), 0) > now:
                    continue
                self._cooling.pop((host, slot), None)
                self._spawn(host, slot)
                started = True
        return started

    def _in_world(self) -> list[str]:
        return [w.name for w in self._live() if w.rank >= 0]

    def _update_hosts(self, hosts: dict[str, int], now: float) -> None:
        removed = False
        if hosts != self._hosts:
            log.info("commlayerrun: hosts %s -> %s", self._hosts, hosts)
            for worker in self._live():
                if worker.slot >= hosts.get(worker.host, 0):
                    worker.removed = removed = True
                    if worker.name in self._waiting:
                        self._waiting.discard(worker.name)
                        self._replies[worker.name] = {"exit": True}
            self._hosts = hosts
        self._fill(now)
        if removed:  # (workers started are announced once they wait at the rendezvous)
            notice = {"event": "hosts_updated", "timestamp": now, "removed_only": True}
            self._notify(self._in_world(), notice)
            self._cv.notify_all()

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
            # removed workers leave; once finishing, no world forms any more: all leave
            if self._finishing or self._workers[name].removed:
                self._replies[name] = {"exit": True}
                self._waiting.discard(name)
        self._cv.notify_all()

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

    def _died(self, worker: Worker, now: float) -> None:
        lo, hi = self.cooldown_s or (float("inf"), float("inf"))
        back = now + random.uniform(lo, hi) if self.cooldown_s else float("inf")
        self._cooling[(worker.host, worker.slot)] = back
        when = f"back in {back - now:.1f} s" if self.cooldown_s else "out for the rest of the job"
        print(
            f"commlayerrun: worker {worker.name} (rank {worker.rank}) exited with "
            f"{worker.proc.returncode}; slot {worker.host}:{worker.slot} {when}",
            file=sys.stderr,
            flush=True,
        )
        if worker.rank >= 0:
            notice = {"event": "dead", "generation": self._generation, "ranks": [worker.rank]}
            self._notify(self._in_world(), notice)
        if not self._live() and not self._finishing:
            codes = sorted({w.exit_code for w in self._workers.values() if w.exit_code})
            raise JobError(
                f"every worker failed (exit codes {codes}); nothing is left to continue from "
                "(the last commit lives in the workers' memory)"
            )

    def _rendezvous(self, now: float) -> None:
        live = self._live()
        needed = self.np if self._generation == 0 else self.min_np  # the first world: -np
        if len(live) < needed:
            self._short_since = self._short_since or now
            if now - self._short_since > self.elastic_timeout_s:
                first = f"-np {needed} to start with" if self._generation == 0 else ""
                raise JobError(
                    f"only {len(live)} worker(s) for more than --elastic-timeout "
                    f"{self.elastic_timeout_s:g} s, fewer than {first or f'--min-np {needed}'}"
                )
            return
        self._short_since = None
        if self._finishing or not live:
            return
        if self._generation == 0:
            if not all(w.name in self._waiting for w in live):
                return
        else:
            # The last world's members, all back: new workers still starting are not waited
            # for (a worker's start, torch's import, takes seconds): they join the next world
            members = [w for w in live if w.rank >= 0]
            ready = [w for w in live if w.name in self._waiting]
            if any(w.name not in self._waiting for w in members):
                # new workers waiting: the members come at their next commit
                arrived = [w.name for w in ready if w.rank < 0 and w.name not in self._announced]
                if arrived:
                    self._announced.update(arrived)
                    notice = {"event": "hosts_updated", "timestamp": now, "removed_only": False}
                    self._notify(self._in_world(), notice)
                return
            if len(ready) < self.min_np:
                return
            live = ready
        if self._generation > 0:
            self._resets += 1
            if self.reset_limit is not None and self._resets > self.reset_limit:
                raise JobError(
                    f"the world re-formed more than --reset-limit {self.reset_limit} times"
                )
        self._generation += 1
        ordered = sorted(live, key=lambda w: (w.rank < 0, w.rank, w.order))
        joined = any(w.rank < 0 for w in ordered)  # new workers: every rank must sync
        for worker in self._workers.values():
            worker.rank = -1
        for rank, worker in enumerate(ordered):
            worker.rank = rank
            self._replies[worker.name] = {
                "rank": rank,
                "size": len(ordered),
                "generation": self._generation,
                "joined": joined,
                "timestamp": now,  # host notices up to now are part of this world
            }
        self._waiting.difference_update(w.name for w in ordered)
        log.info("commlayerrun: generation %d: %s", self._generation, [w.name for w in ordered])
        print(
            f"commlayerrun: world {self._generation}: {len(ordered)} workers",
            file=sys.stderr,
            flush=True,
        )
        self._cv.notify_all()

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        def stop(signum: int, _: Any) -> None:
            raise JobError(f"commlayerrun got signal {signum}; stopping the workers")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, stop)
        next_discovery = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_discovery:
                    hosts = self.discover()
                    next_discovery = now + _DISCOVERY_S
                else:
                    hosts = self._hosts
                with self._cv:
                    self._watch(now)
                    self._reap(now)
                    self._update_hosts(hosts, now)
                    self._rendezvous(now)
                    if self._finishing and all(
                        w.exit_code is not None for w in self._workers.values()
                    ):
                        failed = [
                            w.name for w in self._workers.values() if w.exit_code and not w.removed
                        ]
                        return 0 if not failed or self._finishing else 1
                time.sleep(_POLL_S)
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


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
