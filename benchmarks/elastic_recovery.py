"""Elastic recovery: the time from a worker's death (SIGKILL) to training again, commlayerrun's
elastic driver against torchrun --max-restarts reloading a checkpoint, in the same run; and the
samples/s between events against the non-elastic torch backend (issue 38).

    python benchmarks/elastic_recovery.py [--np 3] [--trials 10] [--out FILE.md]

Both jobs train the same MLP (batch 64 a rank, DistributedOptimizer) at --np ranks on this
machine; every worker appends ``time step world size`` to a file of its own per completed step.

- elastic: ``commlayerrun -np N --min-np N-1 -H localhost:N --blacklist-scope slot
  --blacklist-cooldown-range 0 0``, commit every 10 steps. A trial kills a random worker and
  measures until the first step that a survivor completes in a later world (re-formed at N-1
  from the last commit in memory); the slot comes back at once, so the next trial starts once
  the world has N workers again.
- torchrun: ``torchrun --nproc-per-node N --max-restarts T+1``, rank 0 saving a checkpoint
  every 10 steps and every rank loading it at start. A trial kills a random worker and measures
  until the first step completed after torchrun restarted all of them (restart count higher).
- samples/s: over a quiet window (no event) at N workers, the elastic job (commits included)
  against the torchrun job without its checkpoints (the non-elastic torch backend, no state
  saved at all). Each launcher's own CPU during the windows is printed (the elastic driver's
  polling, torchrun's agent). ``ELASTIC_BENCH_PROFILE=1``: each worker writes a cProfile of its
  steps 100-600 and the share of them spent in commit() (``_Profile``) to the job's folder.
- ``--burst``: instead, the driver's training rate during a burst of ``--connections`` (200)
  unauthenticated connections to its control channel (issue 48): one elastic job; samples/s
  over a window before, then while the connections are held open (silent; topped up to
  ``--connections`` once a second as the driver drops them), then while they trickle one
  byte a second into their greeting, then after. The connections come from this process, on
  the same cores as the job. Each window also gives the longest pause between two steps of
  any worker, and the job's worlds: a worker whose heartbeats the burst held up past
  --heartbeat-timeout would be stopped and the world re-formed. ``--burst --np 2 --window 3``:
  a smoke run of a minute.
- ``--changes``: recovery time per kind of membership change, ``--trials`` each (issue 48):
  a worker killed at 3 and at 2 workers (2 -> 1), a host removed and added back through the
  discovery script, a worker dying in init() before the first world trains (a fresh job a
  trial); with the crashes and hangs over all trials (results/elastic_changes.md).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import procstat  # benchmarks/procstat.py, beside this script

HERE = Path(__file__).resolve()
COMMIT_EVERY = 10
BATCH = 64
PROFILE_FROM, PROFILE_TO = 100, 600


# -- worker ------------------------------------------------------------------------------------
def worker(mode: str, out: Path) -> None:
    import torch
    from torch import nn

    import commlayer as hvd
    from commlayer import elastic

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a hang's stacks, on demand
    _die_in_init(out)
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))  # fmt: skip
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,))
    log = (out / f"{os.getpid()}.log").open("a", buffering=1)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    profile = _Profile(out, mode)
    if mode == "elastic":
        from commlayer.elastic import rendezvous

        state = elastic.TorchState(model, optimizer, step=0)
        if hvd.rank() == 0:  # where --burst connects
            (out / "driver").write_text(os.environ["COMMLAYER_ELASTIC_DRIVER"])

        @elastic.run
        def train(state: elastic.TorchState) -> None:
            while True:
                profile.tick()
                step()
                state.step += 1
                log.write(f"{time.time()} {state.step} {rendezvous.generation()} {hvd.size()}\n")
                if state.step % COMMIT_EVERY == 0:
                    began = time.perf_counter()
                    state.commit()
                    profile.commits += time.perf_counter() - began

        train(state)
    else:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        checkpoints = not os.environ.get("ELASTIC_BENCH_PLAIN")  # the samples/s baseline: none
        checkpoint, done = out / "checkpoint.pt", 0
        if checkpoint.exists():
            saved = torch.load(checkpoint)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            done = saved["step"]
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        while True:
            profile.tick()
            step()
            done += 1
            log.write(f"{time.time()} {done} {restart} {hvd.size()}\n")
            if done % COMMIT_EVERY == 0 and hvd.rank() == 0 and checkpoints:
                tmp = out / "checkpoint.tmp"
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": done}, tmp)  # fmt: skip
                os.replace(tmp, checkpoint)


def _die_in_init(out: Path) -> None:
    """``--changes``' kill before the first world: the worker started as rank
    ELASTIC_BENCH_DIE (HOROVOD_RANK) notes the time in OUT/died and SIGKILLs itself 0.5 s into
    init() (at the rendezvous, or while torch.distributed starts), once per job."""
    victim = os.environ.get("ELASTIC_BENCH_DIE")
    if victim is None or victim != os.environ.get("HOROVOD_RANK"):
        return
    try:
        fd = os.open(out / "died", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return

    def die() -> None:
        os.write(fd, f"{time.time()}".encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Timer(0.5, die).start()


class _Profile:
    """``--profile``: cProfile of each worker's steps PROFILE_FROM..PROFILE_TO (after warm-up),
    written to OUT/<mode>-<pid>.prof, and the seconds those steps took with the seconds spent
    in commit() (OUT/<mode>-<pid>.time: ``steps seconds commit_seconds``)."""

    def __init__(self, out: Path, mode: str) -> None:
        self.on = bool(os.environ.get("ELASTIC_BENCH_PROFILE"))
        self.path = out / f"{mode}-{os.getpid()}"
        self.steps, self.commits, self.began = 0, 0.0, 0.0
        self.profiler: Any = None

    def tick(self) -> None:
        if not self.on:
            return
        self.steps += 1
        if self.steps == PROFILE_FROM:
            import cProfile

            self.commits, self.began = 0.0, time.perf_counter()
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif self.steps == PROFILE_TO:
            self.profiler.disable()
            took = time.perf_counter() - self.began
            self.profiler.dump_stats(f"{self.path}.prof")
            Path(f"{self.path}.time").write_text(
                f"{PROFILE_TO - PROFILE_FROM} {took} {self.commits}\n"
            )


# -- driver ------------------------------------------------------------------------------------
def _lines(out: Path) -> dict[int, list[tuple[float, int, int, int]]]:
    """pid -> its (time, step, world, size) lines."""
    found = {}
    for path in out.glob("*.log"):
        rows = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
        found[int(path.stem)] = rows
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


def _wait(what: str, until: object, limit_s: float = 180.0) -> None:
    deadline = time.monotonic() + limit_s
    while not until():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {limit_s:g} s for {what}")
        time.sleep(0.05)


def _steady(out: Path, np: int, world_of: int) -> list[int]:
    """Live workers once ``np`` of them have each done 5 steps in a world after ``world_of``."""
    live: list[int] = []

    def ready() -> bool:
        nonlocal live
        rows = {p: r for p, r in _lines(out).items() if _alive(p)}
        fresh = [p for p, r in rows.items() if r and r[-1][2] > world_of and r[-1][3] == np]
        counts = [sum(1 for row in rows[p] if row[2] == rows[p][-1][2]) for p in fresh]
        live = fresh
        return len(fresh) == np and min(counts) >= 5

    _wait(f"{np} workers training", ready)
    return live


def _throughput(out: Path, window_s: float) -> float:
    """samples/s of the whole job over the next ``window_s`` (from rank files' step counts)."""
    before = {p: len(r) for p, r in _lines(out).items()}
    began = time.time()
    time.sleep(window_s)
    after = _lines(out)
    ended = time.time()
    steps = sum(sum(1 for t, *_ in rows[before.get(p, 0) :] if began <= t <= ended)
                for p, rows in after.items())  # fmt: skip
    return steps * BATCH / (ended - began)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    got = procstat.read(Path(f"/proc/{pid}/stat"))
    if got is None:
        raise ProcessLookupError(f"process {pid} has ended")
    return got[1]


def _tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and its live descendants (the launcher, its workers
    and their threads): on a loaded machine CPU per step moves far less than wall time."""
    parent, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        got = procstat.read(stat)
        if got is not None:
            pid = int(stat.parent.name)
            parent[pid], cpu[pid] = got
    total = 0.0
    for pid in cpu:
        up = pid
        while up not in (root, 0, 1) and up in parent:
            up = parent[up]
        total += cpu[pid] if up == root else 0.0
    return total


def _steps(out: Path) -> int:
    return sum(len(r) for r in _lines(out).values())


def trials(job: list[str], env: dict[str, str], out: Path, np: int, n: int, window_s: float,
           windows: int = 1) -> tuple[list[float], list[float], float]:  # fmt: skip
    output = (out / "job.out").open("w")
    proc = subprocess.Popen(job, env=env, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        live = _steady(out, np, -1)
        cpu, began = _cpu_s(proc.pid), time.monotonic()
        job_cpu, steps = _tree_cpu_s(proc.pid), _steps(out)
        rate = [_throughput(out, window_s) for _ in range(windows)]
        job_cpu, steps = _tree_cpu_s(proc.pid) - job_cpu, _steps(out) - steps
        cpu_per_step = job_cpu / max(steps, 1)
        if n == 0:  # the launcher's own CPU (the elastic driver's polling, torchrun's agent)
            share = (_cpu_s(proc.pid) - cpu) / (time.monotonic() - began)
            print(f"  launcher process: {share:.4f} of a core during the windows", flush=True)
        times = []
        for _ in range(n):
            world = max(r[-1][2] for p, r in _lines(out).items() if p in live and r)
            victim = random.choice(live)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)

            def resumed(victim: int = victim, killed_at: float = killed_at,
                        world: int = world) -> bool:  # fmt: skip
                rows = [row for p, r in _lines(out).items() if p != victim for row in r]
                return any(t > killed_at and w > world for t, _, w, _ in rows)

            _wait("training after the kill", resumed)
            first = min(t for p, r in _lines(out).items() if p != victim
                        for t, _, w, _ in r if t > killed_at and w > world)  # fmt: skip
            times.append(first - killed_at)
            print(f"  trial: {first - killed_at:.2f} s", flush=True)
            live = _steady(out, np, world)
        return times, rate, cpu_per_step
    except Exception:
        print((out / "job.out").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        _stop(proc)  # the driver, torchrun's agent: they stop theirs


# -- --burst --------------------------------------------------------------------------------
class Burst:
    """``n`` connections to the driver kept open from a thread of their own: ``hold`` (say
    nothing) or ``trickle`` (one byte a second of a greeting's length and body, never
    finished); each one the driver closes is opened again."""

    def __init__(self, address: str, n: int, mode: str) -> None:
        host, _, port = address.rpartition(":")
        self.address, self.n, self.mode = (host, int(port)), n, mode
        self.opened = self.closed = 0  # connections made; closed by the driver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        watch = selectors.DefaultSelector()
        open_: dict[socket.socket, int] = {}  # connection -> bytes of the greeting it sent
        greeting = (100).to_bytes(4, "big") + b"x" * 100  # trickled, never all sent
        try:
            while not self._stop.is_set():
                ends = time.monotonic() + 1.0  # a round: top up, a byte each, watch
                while len(open_) < self.n:
                    try:
                        sock = socket.create_connection(self.address, timeout=5)
                    except OSError:
                        break  # the driver's listen queue is full: next round
                    sock.setblocking(False)
                    watch.register(sock, selectors.EVENT_READ)
                    open_[sock] = 0
                    self.opened += 1
                for sock, sent in list(open_.items()) if self.mode == "trickle" else ():
                    try:
                        sock.send(greeting[sent : sent + 1])
                        open_[sock] = sent + 1
                    except OSError:
                        self._drop(watch, open_, sock)
                while (left := ends - time.monotonic()) > 0 and not self._stop.is_set():
                    for key, _ in watch.select(left):
                        sock = key.fileobj  # type: ignore[assignment]
                        try:
                            gone = not sock.recv(4096)  # the nonce, or the driver's close
                        except OSError:
                            gone = True
                        if gone:
                            self._drop(watch, open_, sock)
        finally:
            for sock in open_:
                sock.close()
            watch.close()

    def _drop(self, watch: selectors.BaseSelector, open_: dict[socket.socket, int],
              sock: socket.socket) -> None:  # fmt: skip
        watch.unregister(sock)
        del open_[sock]
        sock.close()
        self.closed += 1


def _window(out: Path, seconds: float) -> tuple[float, float, set[int]]:
    """(samples/s, the longest pause in s between two steps of one worker, the worlds seen)
    over the next ``seconds``."""
    began = time.time()
    rate = _throughput(out, seconds)
    pause, worlds = 0.0, set()
    for rows in _lines(out).values():
        times = [t for t, *_ in rows if t >= began]
        worlds.update(w for t, _, w, _ in rows if t >= began)
        pause = max([pause] + [b - a for a, b in zip(times, times[1:], strict=False)])
    return rate, pause, worlds


def burst(job: Callable[[Path], list[str]], env: dict[str, str], np: int, n: int,
          window_s: float, out_path: Path) -> None:  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="elastic-burst-"))
    output = (out / "job.out").open("w")
    proc = subprocess.Popen(job(out), env=env, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    rows = []
    try:
        _steady(out, np, -1)
        _wait("the driver's address", lambda: (out / "driver").exists())
        address = (out / "driver").read_text()
        rows.append(("before", *_window(out, window_s), 0, 0))
        for mode in ("hold", "trickle"):
            attack = Burst(address, n, mode)
            try:
                got = _window(out, window_s)
            finally:
                attack.stop()
            rows.append((f"{n} connections, {mode}", *got, attack.opened, attack.closed))
        rows.append(("after", *_window(out, window_s), 0, 0))
        alive = proc.poll() is None
    except Exception:
        print((out / "job.out").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        _stop(proc)
    log = (out / "job.out").read_text()
    refused = log.count("refused a connection")
    worlds = set().union(*(r[3] for r in rows))
    lines = [
        "# The elastic driver under a connection burst (benchmarks/elastic_recovery.py --burst)",
        "",
        f"{np} workers on this machine ({os.cpu_count()} cores), MLP 256-512-512-10, batch "
        f"{BATCH} a rank, commit every {COMMIT_EVERY} steps; windows of {window_s:g} s. During a "
        f"window {n} unauthenticated connections to the driver are kept open (topped up once "
        "a second as it drops them), from the benchmark's process: held silent, then "
        "trickling one byte a second.",
        "",
        "| window | samples/s | longest pause between steps (s) | worlds | opened | closed "
        "by the driver |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, rate, pause, seen, opened, closed in rows:
        lines.append(f"| {name} | {rate:.0f} | {pause:.2f} | {sorted(seen)} | {opened} | "
                     f"{closed} |")  # fmt: skip
    stalled = len(worlds) > 1 or not alive
    lines += [
        "",
        f"Refusals the driver logged: {refused}. A worker stalled (the world re-formed, or the "
        f"job ended): {'yes' if stalled else 'no'} (worlds {sorted(worlds)}, job "
        f"{'running' if alive else 'ended'} at the last window).",
    ]
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(out, ignore_errors=True)


# -- --changes --------------------------------------------------------------------------------
_NAMES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # this machine under three host names
_WAIT_S = 120.0  # a change not recovered from in this long is a hang
# A failed host's cooldown: longer than a death takes to be seen and the world re-formed, so that
# a recovery is measured without the host's new worker (with 1 s, a death in init() was often
# seen after the host was back, and the new world waited for its new worker's start: 4-17 s).
_COOLDOWN_S = 5


def _write_hosts(path: Path, names: list[str]) -> float:
    """The discovery script's input, replaced at once; the time it changed."""
    path.with_suffix(".new").write_text("".join(f"{name}:1\n" for name in names))
    os.replace(path.with_suffix(".new"), path)
    return time.time()


def _resumed(out: Path, since: float, size: int | tuple[int, ...], after_world: int,
             but: int = -1) -> float:  # fmt: skip
    """The first step after ``since`` done at ``size`` (or one of those sizes) in a world after
    ``after_world`` (by a worker other than ``but``); the seconds it took from ``since``."""
    sizes = size if isinstance(size, tuple) else (size,)

    def first() -> float | None:
        times = [t for p, r in _lines(out).items() if p != but for t, _, w, n in r
                 if t > since and w > after_world and n in sizes]  # fmt: skip
        return min(times) if times else None

    _wait(f"training at {size} workers", lambda: first() is not None, _WAIT_S)
    return float(first() or 0.0) - since


def _world(out: Path) -> int:
    return max((r[-1][2] for r in _lines(out).values() if r), default=-1)


def _changes_job(me: list[str], np: int, out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    (out / "discover.sh").write_text(f"#!/bin/sh\ncat {out / 'hosts'}\n")
    (out / "discover.sh").chmod(0o755)
    command = [str(Path(sys.executable).parent / "commlayerrun"), "-np", str(np), "--min-np",
               "1", "--max-np", str(np), "--host-discovery-script", str(out / "discover.sh"),
               "--blacklist-cooldown-range", str(_COOLDOWN_S), str(_COOLDOWN_S), *me, "--dir",
               str(out)]  # fmt: skip
    output = (out / "job.out").open("a")
    return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _signal_children(parent: int, sig: int) -> None:
    """Send ``sig`` to the processes whose parent is ``parent`` (the driver's workers)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        got = procstat.read(stat)
        if got is not None and got[0] == parent:
            try:
                os.kill(int(stat.parent.name), sig)
            except ProcessLookupError:
                pass


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    """Stop the job; its exit code if it had ended by itself (a crash), else None."""
    code = proc.poll()
    if code is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code


CHANGES = ("kill", "hosts", "init")


def changes(env: dict[str, str], n: int, out_path: Path, kinds: tuple[str, ...] = CHANGES) -> None:
    """``--changes``: recovery time per kind of membership change, ``n`` trials each, and the
    crashes (a job ending by itself) and hangs (no recovery in _WAIT_S) over all of them."""
    me = [sys.executable, str(HERE), "--worker", "elastic"]
    times: dict[str, list[float]] = {}
    failures: dict[str, list[str]] = {}

    def kind(name: str, np: int, trial: Callable[[Path, subprocess.Popen[bytes]], None],
             fresh: bool = False, extra: dict[str, str] | None = None) -> None:  # fmt: skip
        """Trials of one kind: in one job (``fresh``: a job each)."""
        times[name], failures[name] = [], []
        done = 0
        while done < n:
            out = Path(tempfile.mkdtemp(prefix="elastic-changes-"))
            _write_hosts(out / "hosts", _NAMES[:np])
            proc = _changes_job(me, np, out, {**env, **(extra or {})})
            try:
                _steady(out, np, -1) if not fresh else None
                for _ in range(1 if fresh else n - done):
                    done += 1
                    trial(out, proc)
                    print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
            except RuntimeError as exc:  # no recovery in time: the workers' stacks, kept
                _signal_children(proc.pid, signal.SIGUSR2)  # faulthandler (worker())
                time.sleep(3)
                kept = Path(tempfile.gettempdir()) / f"{out.name}.job.out"
                shutil.copy(out / "job.out", kept)
                failures[name].append(f"hang: {exc} (the workers' stacks: {kept})")
            finally:
                code = _stop(proc)
                if code is not None:
                    failures[name].append(f"crash: the job exited {code}")
                    print((out / "job.out").read_text()[-2000:], file=sys.stderr)
                shutil.rmtree(out, ignore_errors=True)

    def kill(np: int) -> Callable[[Path, subprocess.Popen[bytes]], None]:
        def trial(out: Path, proc: subprocess.Popen[bytes]) -> None:
            live = _steady(out, np, _world(out) - 1)
            world, victim = _world(out), random.choice(live)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            times[f"kill a worker ({np} -> {np - 1})"].append(
                _resumed(out, killed_at, np - 1, world, victim)
            )
            _steady(out, np, world + 1)  # its host back after the 1 s cooldown

        return trial

    def removed_then_added(out: Path, proc: subprocess.Popen[bytes]) -> None:
        world = _world(out)
        removed = _write_hosts(out / "hosts", _NAMES[:2])
        times["host removed (3 -> 2)"].append(_resumed(out, removed, 2, world))
        _steady(out, 2, world)
        world = _world(out)
        added = _write_hosts(out / "hosts", _NAMES[:3])
        times.setdefault("host added (2 -> 3, a new worker starts)", []).append(
            _resumed(out, added, 3, world)
        )
        _steady(out, 3, world)

    def before_first_world(out: Path, proc: subprocess.Popen[bytes]) -> None:
        _wait("the worker's death in init()", lambda: (out / "died").exists() and
              (out / "died").read_text().strip() != "", _WAIT_S)  # fmt: skip
        died = float((out / "died").read_text())
        # at 2 workers; or at 3, when it died in the first world's sync (the world had
        # formed) and its host, back after the cooldown, had a new worker in time
        times["a worker dies in init(), before the first world (3 -> 2)"].append(
            _resumed(out, died, (2, 3), -1)
        )

    if "kill" in kinds:
        kind("kill a worker (3 -> 2)", 3, kill(3))
        kind("kill a worker (2 -> 1)", 2, kill(2))
    if "hosts" in kinds:
        kind("host removed (3 -> 2)", 3, removed_then_added)
        times.setdefault("host added (2 -> 3, a new worker starts)", [])
    if "init" in kinds:
        kind("a worker dies in init(), before the first world (3 -> 2)", 3, before_first_world,
             fresh=True, extra={"ELASTIC_BENCH_DIE": "2"})  # fmt: skip
    crashes = sum(f.startswith("crash") for fs in failures.values() for f in fs)
    hangs = sum(f.startswith("hang") for fs in failures.values() for f in fs)
    lines = [
        "# Elastic recovery per kind of change (benchmarks/elastic_recovery.py --changes)",
        "",
        f"This machine ({os.cpu_count()} cores) under three host names ({', '.join(_NAMES)}, "
        f"one slot each: a failure blacklists its host, back after --blacklist-cooldown-range "
        f"{_COOLDOWN_S} {_COOLDOWN_S}), MLP 256-512-512-10, batch {BATCH} a rank, commit every "
        f"{COMMIT_EVERY} steps, "
        "hosts from a discovery script reading a file. Each time: from the change (the SIGKILL, "
        "the file's rewrite, the worker's death in init()) to the first step of the new world.",
        "",
        "| change | trials | median (s) | max (s) | min (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, got in times.items():
        if got:
            lines.append(f"| {name} | {len(got)} | {statistics.median(got):.2f} | "
                         f"{max(got):.2f} | {min(got):.2f} |")  # fmt: skip
    lines += ["", f"Crashes: {crashes}. Hangs: {hangs}."]
    lines += [f"- {name}: {f}" for name, fs in failures.items() for f in fs]
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=["elastic", "torchrun"])
    parser.add_argument("--dir")
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of throughput")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds of throughput jobs")
    parser.add_argument("--skip-trials", action="store_true", help="throughput only")
    parser.add_argument("--burst", action="store_true", help="training during a connection burst")
    parser.add_argument("--connections", type=int, default=200, help="--burst's connections")
    parser.add_argument("--changes", action="store_true", help="recovery per kind of change")
    parser.add_argument("--kinds", default=",".join(CHANGES), help="--changes': which kinds")
    parser.add_argument("--out", help="default: results/elastic_recovery.md, elastic_burst.md")
    args = parser.parse_args()
    name = "elastic_burst.md" if args.burst else "elastic_recovery.md"
    name = "elastic_changes.md" if args.changes else name
    args.out = args.out or str(HERE.parent / "results" / name)
    if args.worker:
        worker(args.worker, Path(args.dir))
        return
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMLAYER_")}
    env.update(OMP_NUM_THREADS="1", COMMLAYER_BACKEND="torch")

    def job(mode: str, out: Path) -> list[str]:
        me = [sys.executable, str(HERE), "--worker", mode, "--dir", str(out)]
        if mode == "elastic":
            return [str(bindir / "commlayerrun"), "-np", str(args.np), "--min-np",
                    str(args.np - 1), "-H", f"localhost:{args.np}", "--blacklist-scope",
                    "slot", "--blacklist-cooldown-range", "0", "0", *me]  # fmt: skip
        return [str(bindir / "torchrun"), "--standalone", "--nproc-per-node", str(args.np),
                "--max-restarts", str(args.trials + 1), *me[1:]]  # fmt: skip

    if args.changes:
        changes(env, args.trials, Path(args.out), tuple(args.kinds.split(",")))
        return
    if args.burst:
        burst(lambda out: job("elastic", out), env, args.np, args.connections, args.window,
              Path(args.out))  # fmt: skip
        return
    results = {}
    for mode in () if args.skip_trials else ("elastic", "torchrun"):
        out = Path(tempfile.mkdtemp(prefix=f"elastic-{mode}-"))
        print(f"{mode}:", flush=True)
        results[mode] = trials(job(mode, out), env, out, args.np, args.trials, args.window)
        shutil.rmtree(out, ignore_errors=True)
    # samples/s: jobs started in turn (A B A B), several windows each, no event
    rates: dict[str, list[float]] = {"elastic": [], "torchrun": []}
    cpu: dict[str, list[float]] = {"elastic": [], "torchrun": []}
    for _ in range(args.rounds):
        for mode in rates:
            out = Path(tempfile.mkdtemp(prefix=f"elastic-{mode}-"))
            plain = {**env, "ELASTIC_BENCH_PLAIN": "1"}  # torchrun without its checkpoints
            got = trials(job(mode, out), plain, out, args.np, 0, args.window / 2, windows=3)
            rates[mode] += got[1]
            cpu[mode].append(got[2] * 1e3)
            print(f"{mode} samples/s: {got[1]}, CPU ms a step: {got[2] * 1e3:.3f}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    lines = [
        "# Elastic recovery (benchmarks/elastic_recovery.py)",
        "",
        f"{args.np} ranks on this machine ({os.cpu_count()} cores, shared with other jobs), MLP "
        f"256-512-512-10, batch {BATCH} a rank, DistributedOptimizer, commit (elastic) or "
        f"checkpoint (torchrun, rank 0) every {COMMIT_EVERY} steps.",
        "",
    ]
    if results:
        lines += [
            f"## Recovery: {args.trials} SIGKILLs of a random worker in each job",
            "",
            "From the SIGKILL to the first step a survivor completes in the next world (elastic: "
            "re-formed without the dead worker, from the last commit in memory; torchrun: every "
            "worker restarted, checkpoint loaded). The two jobs one after the other.",
            "",
            "| job | median (s) | max (s) | min (s) | trials (s) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for mode, (times, *_) in results.items():
            name = ("commlayerrun elastic driver" if mode == "elastic"
                    else "torchrun --max-restarts")  # fmt: skip
            each = ", ".join(f"{t:.2f}" for t in times)
            lines.append(f"| {name} | {statistics.median(times):.2f} | {max(times):.2f} | "
                         f"{min(times):.2f} | {each} |")  # fmt: skip
        lines.append("")
    lines += [
        f"## samples/s at {args.np} workers, no event",
        "",
        f"Each job started {args.rounds} times in turn (elastic, torchrun, elastic, ...), three "
        f"{args.window / 2:g} s windows each once every worker trains; torchrun runs the torch "
        "backend with no elastic state and no checkpoint.",
        "",
        "| job | median samples/s | windows |",
        "| --- | --- | --- |",
    ]
    for mode, got in rates.items():
        lines.append(f"| {mode} | {statistics.median(got):.0f} | "
                     f"{', '.join(f'{r:.0f}' for r in got)} |")  # fmt: skip
    ratios = [e / t for e, t in zip(rates["elastic"], rates["torchrun"], strict=True)]
    per_cpu = [t / e for e, t in zip(cpu["elastic"], cpu["torchrun"], strict=True)]
    lines += [
        "",
        f"elastic / torchrun, window by window in order: median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}).",
        "",
        "CPU milliseconds a step, the whole job (launcher, workers, their threads; one step of "
        "one worker), per launch: "
        + "; ".join(f"{m} {', '.join(f'{c:.3f}' for c in cpu[m])}" for m in cpu)
        + ". On these oversubscribed cores samples/s goes as 1 / CPU per step: torchrun's CPU "
        f"per step / elastic's, launch by launch: median {statistics.median(per_cpu):.3f} "
        f"(range {min(per_cpu):.3f}-{max(per_cpu):.3f}).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
