"""commlayerrun's elastic driver end to end, on this host with slots (issue 38): the scenarios of
Horovod's test/integration/test_elastic_torch.py, including those Horovod skips.

One job covers the changes and the attacks: 3 workers (hosts ``localhost:2`` and
``127.0.0.1:1``, both this machine); the discovery script's input loses ``127.0.0.1`` (3 -> 2),
gets it back (2 -> 3), then rank 1 is SIGKILLed mid-step (3 -> 2: its slot stays out). While it
runs, the test connects to the driver with garbage, with a wrong key and with nothing at all:
each is refused and logged, and the job finishes. The workers train a model whose final
parameters, whatever the sizes were, are those of one process doing the same steps, only if
every step was applied once from its committed state (scripts/elastic_worker.py).

Two short jobs: every worker failing, and fewer than --min-np for longer than
--elastic-timeout: a clear error and exit code 1 each.
"""

from __future__ import annotations

import json
import socket
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, run_limited, worker_env
from torch import nn

from commlayer.elastic import protocol

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []

_TIMEOUT_S = 150.0


def _commlayerrun() -> list[str]:
    path = Path(sysconfig.get_path("scripts")) / "commlayerrun"
    return [str(path)] if path.exists() else [sys.executable, "-m", "commlayer.launch.launcher"]


def _job(
    tmp_path: Path, hosts: str, flags: list[str], steps: int, events: list[str]
) -> tuple[int, str, list[dict[str, Any]]]:
    (tmp_path / "hosts").write_text(hosts.replace(";", "\n") + "\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    command = [
        *_commlayerrun(),
        *flags,
        "--host-discovery-script",
        str(discover),
        sys.executable,
        str(SCRIPTS / "elastic_worker.py"),
        str(tmp_path),
        str(steps),
        *events,
    ]
    env = worker_env(tmp_path, _TIMEOUT_S + 10, {})
    code, stdout, stderr = run_limited(command, env, _TIMEOUT_S)
    records = [
        {**json.loads(line), "pid": path.stem}
        for path in sorted(tmp_path.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    return code, stdout + stderr, records


def _reference(steps: int) -> list[list[float]]:
    """The parameters of one process doing ``steps`` steps (elastic_worker.py's training)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.arange(16, dtype=torch.float32).reshape(4, 4) / (step + 1)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _attack(out: Path, stop: threading.Event, found: list[str]) -> None:
    """Connect to the driver as someone without the job key, in three ways."""
    while not (out / "driver").exists() and not stop.is_set():
        time.sleep(0.1)
    if stop.is_set():
        return
    host, _, port = (out / "driver").read_text().rpartition(":")
    address = (host, int(port))
    silent = socket.create_connection(address)  # says nothing: refused at the handshake
    garbage = socket.create_connection(address)
    garbage.sendall(b"GET / HTTP/1.0\r\n\r\n")
    wrong = protocol.connect(f"{host}:{port}", b"not the job key")
    wrong.send({"op": "hello", "worker": "localhost:0:1", "role": "rpc"})
    unsigned = socket.create_connection(address)
    protocol.read_frame(unsigned)
    protocol.write_frame(unsigned, json.dumps({"op": "hello", "worker": "localhost:0:1"}).encode())
    for sock in (garbage, wrong.sock, unsigned):
        got = b""
        try:
            sock.settimeout(10)
            while chunk := sock.recv(4096):
                got += chunk
        except OSError:
            pass
        # the driver's greeting (a length and a nonce) and nothing else, then closed
        found.append("closed" if len(got) <= 4 + protocol.NONCE_BYTES else f"answered {got!r}")
    stop.wait(30)
    silent.close()


def test_hosts_removed_added_and_a_rank_killed(tmp_path: Path) -> None:
    stop, found = threading.Event(), []  # type: ignore[var-annotated]
    attacker = threading.Thread(target=_attack, args=(tmp_path, stop, found), daemon=True)
    attacker.start()
    hosts = str(tmp_path / "hosts")
    code, output, records = _job(
        tmp_path,
        "localhost:2;127.0.0.1:1",
        # one slot blamed per failure (the default blacklists the whole host, and a kill on
        # localhost would leave 127.0.0.1's one slot, fewer than --min-np)
        ["-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-scope", "slot"],
        12,
        [
            f"hosts:2:3:{hosts}:localhost:2",
            f"hosts:4:2:{hosts}:localhost:2;127.0.0.1:1",
            "kill:6:3:1",
        ],
    )
    stop.set()
    attacker.join(10)
    assert code == 0, output
    starts = [r for r in records if r["kind"] == "start"]
    done = [r for r in records if r["kind"] == "done"]
    # 3 -> 2 (host removed) -> 3 (host back) -> 2 (rank killed): the sizes rank 0 ran at
    sizes = [r["size"] for r in starts if r["rank"] == 0]
    assert sizes == [3, 2, 3, 2], (sizes, output)
    assert "removed from the job; exiting" in output
    assert {r["cache"] for r in starts} == {512}  # init()'s setting, in every world
    # the survivors of the kill resumed from the step being done when it came (committed
    # before it), and the new worker joined at the step the others were at
    killed_at = int((tmp_path / "done-2").read_text().split()[0])
    assert {r["step"] for r in starts if r["size"] == 2 and r["step"] >= killed_at} == {killed_at}
    assert len(done) == 2 and {r["size"] for r in done} == {2}, done
    assert done[0]["params"] == done[1]["params"]
    final = done[0]["step"]
    assert done[0]["params"] == _reference(final)  # to the bit: no step lost or applied twice
    assert done[0]["params"] != _reference(final - 1) != _reference(final + 1)
    # the three connections without the key: refused, logged, never part of the job
    assert found == ["closed"] * 3, found
    assert output.count("refused a connection") >= 3, output
    assert "names no worker" not in output  # none got past the key


def _driver_only(tmp_path: Path, flags: list[str], shell: str) -> tuple[int, str]:
    """commlayerrun's elastic driver over workers that are shell commands (what the driver
    decides does not need torch workers: a second each, not half a minute)."""
    (tmp_path / "discover.sh").write_text("#!/bin/sh\necho localhost:2\n")
    (tmp_path / "discover.sh").chmod(0o755)
    command = [
        *_commlayerrun(),
        *flags,
        "--host-discovery-script",
        str(tmp_path / "discover.sh"),
        "sh",
        "-c",
        shell,
    ]
    code, stdout, stderr = run_limited(command, worker_env(tmp_path, 60, {}), 60)
    return code, stdout + stderr


def test_every_worker_failing_ends_the_job(tmp_path: Path) -> None:
    code, output = _driver_only(tmp_path, ["-np", "2", "--min-np", "1"], "sleep 0.5; exit 3")
    assert code == 1, output
    assert "every worker failed (exit codes [3])" in output, output


def test_fewer_than_min_np_past_the_timeout_ends_the_job(tmp_path: Path) -> None:
    flags = ["-np", "2", "--min-np", "2", "--elastic-timeout", "2", "--blacklist-scope", "slot"]
    # the worker on slot 1 dies; the one on slot 0 lives on (and is stopped by the driver)
    shell = 'case "$COMMLAYER_ELASTIC_WORKER" in localhost:1:*) exit 1;; *) sleep 60;; esac'
    began = time.monotonic()
    code, output = _driver_only(tmp_path, flags, shell)
    assert code == 1, output
    # (no world formed: these workers never ask for one; after a failure --min-np's count)
    assert "1 slot(s) available, fewer than --min-np 2: waiting up to" in output, output
    assert "only 1 worker(s) for more than --elastic-timeout 2 s" in output, output
    assert time.monotonic() - began < 50, output  # the sleeping worker was stopped
