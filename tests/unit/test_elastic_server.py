"""The elastic driver's control channel server (commlayer/launch/server.py) under what knocked
the driver over or held it (issue 48): a burst of connections at a low descriptor limit, a
client trickling its greeting, a first frame announced too large, more unauthenticated
connections than the cap, a session thread that cannot start; and where the driver listens.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from commlayer.elastic import protocol
from commlayer.launch import driver as driver_module
from commlayer.launch import server as server_module

KEY = b"k" * 32
_LOG = "commlayer.launch.driver"


class Echo:
    """A Server with a ``serve`` answering the greeting, then echoing, and the refusals it
    reported."""

    def __init__(self, max_handshakes: int = server_module.MAX_HANDSHAKES) -> None:
        self.refused: queue.Queue[str] = queue.Queue()
        self.server = server_module.Server(
            KEY, self._serve, lambda peer, why: self.refused.put(str(why)), "127.0.0.1",
            max_handshakes,
        )  # fmt: skip
        self.server.start()

    @staticmethod
    def _serve(channel: protocol.Channel, greeting: Any, peer: str) -> None:
        channel.send({"ok": True, "greeting": greeting})
        try:
            while True:
                channel.send({"echo": channel.recv()})
        except OSError:
            channel.close()

    def client(self) -> protocol.Channel:
        channel = protocol.connect(f"127.0.0.1:{self.server.port}", KEY, timeout_s=30)
        channel.send({"op": "hello", "worker": "w"})
        assert channel.recv() == {"ok": True, "greeting": {"op": "hello", "worker": "w"}}
        channel.send(7)
        assert channel.recv() == {"echo": 7}  # the channel counts on from the greeting
        return channel

    def raw(self) -> socket.socket:
        """A connection that has read the server's nonce: admitted to its greeting."""
        sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=30)
        assert len(protocol.read_frame(sock)) == protocol.NONCE_BYTES
        return sock


@pytest.fixture
def echo() -> Iterator[Echo]:
    made = Echo()
    yield made
    made.server.close()


def _eof(sock: socket.socket) -> bytes:
    """What ``sock`` still receives until the server closes it (b"": nothing)."""
    sock.settimeout(30)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionError:
        pass
    return got


def test_a_trickling_client_is_dropped_at_the_one_deadline(
    echo: Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte every 0.2 s keeps each read short of any per-read timeout; the greeting's one
    deadline (1 s here) ends it long before its ~100 bytes are all sent."""
    monkeypatch.setattr(protocol, "HANDSHAKE_TIMEOUT_S", 1.0)
    sock = socket.create_connection(("127.0.0.1", echo.server.port), timeout=30)
    nonce = protocol.read_frame(sock)
    frame = protocol.seal(KEY, b"C", nonce, 0, {"op": "hello", "worker": "w" * 40})
    sent = 0
    try:
        for byte in struct.pack(">I", len(frame)) + frame:
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.2)
    except OSError:
        pass
    assert sent < 4 + len(frame)  # cut off mid-greeting
    assert echo.refused.get(timeout=30) == "no signed greeting within 1 s of the connect"
    sock.close()


def test_a_first_frame_over_the_greeting_limit_is_refused_unread(echo: Echo) -> None:
    """Only the length is read: the client sends no body, and is refused for the length (not
    at the deadline, 5 s away)."""
    sock = echo.raw()
    sock.sendall(struct.pack(">I", protocol.GREETING_MAX_FRAME + 1))
    assert _eof(sock) == b""
    assert echo.refused.get(timeout=30) == "greeting of 4097 bytes announced (at most 4096)"
    echo.client()  # and the server goes on


def test_connections_over_the_cap_are_closed_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made = Echo(max_handshakes=4)
    try:
        with caplog.at_level(logging.WARNING, logger=_LOG):
            silent = [made.raw() for _ in range(4)]
            over = socket.create_connection(("127.0.0.1", made.server.port), timeout=30)
            assert _eof(over) == b""  # closed without even the nonce
            assert made.server.over_cap == 1
            silent.pop().close()  # a place in the greeting frees
            assert made.refused.get(timeout=30) == "closed before its greeting"
            made.client()
        said = [r.getMessage() for r in caplog.records]
        assert said[0].startswith(
            "commlayerrun: 4 connections are in their greeting, the most the driver takes: "
            "closing new ones at once"
        ), said
        assert said[1:] == [
            "commlayerrun: closed 1 connection(s) over the limit of 4 in their greeting"
        ], said
    finally:
        made.server.close()
        for sock in silent:
            sock.close()


def test_a_session_thread_that_cannot_start_is_tried_again(
    echo: Echo, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    starts = []

    class Refusing(threading.Thread):
        def start(self) -> None:
            starts.append(self.name)
            if len(starts) == 1:
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(server_module.threading, "Thread", Refusing)
    with caplog.at_level(logging.WARNING, logger=_LOG):
        echo.client()
        # the accept loop says "works again" after it started the thread that served the
        # client, so the client can be answered first
        deadline = time.monotonic() + 30
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(starts) == 2
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "commlayerrun: the driver's control channel: cannot start a thread for a connection: "
        "can't start new thread; backing off (up to 1 s) and serving on",
        "commlayerrun: the driver's control channel works again, after 1 failure(s)",
    ], said


def test_close_ends_the_greetings_in_progress(echo: Echo) -> None:
    sock = echo.raw()
    echo.server.close()
    assert _eof(sock) == b""
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", echo.server.port), timeout=30)


# Runs the server in a process of its own at a descriptor limit of 256, with no cap on the
# greetings in progress (the cap alone would keep them under the limit): stdin closed ends it.
_SERVER = textwrap.dedent(
    """
    import logging, resource, sys
    from commlayer.elastic import protocol
    from commlayer.launch import server

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    protocol.HANDSHAKE_TIMEOUT_S = 2.0

    def serve(channel, greeting, peer):
        channel.send({"ok": True, "greeting": greeting})
        channel.send({"echo": channel.recv()})

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    running = server.Server(b"k" * 32, serve, lambda peer, why: None, max_handshakes=10000)
    running.start()
    print(running.port, flush=True)
    sys.stdin.read()
    running.close()
    """
)


def test_a_burst_past_the_descriptor_limit_leaves_the_server_serving() -> None:
    """300 connections to a server limited to 256 descriptors: accept fails with EMFILE (the
    old accept loop ended there for good, and a worker connecting next hung). The server backs
    off, its silent clients reach their deadline and free descriptors, and an authenticated
    client, queued behind them, is served; the failure is logged once, and its end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    burst: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        for _ in range(300):
            burst.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        channel = protocol.connect(f"127.0.0.1:{port}", KEY, timeout_s=60)
        channel.send({"op": "hello", "worker": "w"})
        assert channel.recv() == {"ok": True, "greeting": {"op": "hello", "worker": "w"}}
        channel.send(1)
        assert channel.recv() == {"echo": 1}
        channel.close()
    finally:
        for sock in burst:
            sock.close()
        _, stderr = proc.communicate(timeout=60)
    lines = stderr.splitlines()
    failed = [line for line in lines if "accept failed" in line]
    assert len(failed) == 1 and "EMFILE" in failed[0], stderr
    assert len([line for line in lines if "works again" in line]) == 1, stderr
    assert proc.returncode == 0, stderr


# -- where the driver listens ----------------------------------------------------------------


def _listening(bind: str | None, hosts: dict[str, int]) -> driver_module.Driver:
    job = driver_module.Driver(["true"], 1, 1, 1, lambda: dict(hosts), {}, bind=bind)
    job._hosts = dict(hosts)
    return job


@pytest.mark.parametrize(
    ("bind", "hosts", "listens", "told"),
    [
        (None, {"localhost": 2}, "127.0.0.1", "127.0.0.1"),  # every host this machine
        (None, {"127.0.0.2": 1}, "127.0.0.1", "127.0.0.1"),  # the address that reaches it
        ("0.0.0.0", {"localhost": 1}, "0.0.0.0", "127.0.0.1"),
        ("0.0.0.0", {"localhost": 1, "127.0.0.2": 1}, "0.0.0.0", "127.0.0.1"),
    ],
)
def test_the_driver_listens_where_its_hosts_need(
    bind: str | None, hosts: dict[str, int], listens: str, told: str
) -> None:
    job = _listening(bind, hosts)
    try:
        address = job._address()
        assert job._server is not None and job._server.host == listens
        assert address == f"{told}:{job._server.port}"
    finally:
        job._stop()


def test_a_remote_host_with_the_driver_on_loopback_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = _listening(None, {"localhost": 1})
    try:
        job._address()  # every host local: loopback
        job._hosts["node7"] = 1
        monkeypatch.setattr(driver_module, "route_to", lambda host: "192.0.2.2")
        with pytest.raises(driver_module.JobError) as caught:
            job._address()
        message = str(caught.value)
        assert message.startswith("host 'node7' is not this machine, and the driver listens on "
                                  "127.0.0.1 only"), message  # fmt: skip
        assert "--driver-address" in message, message
    finally:
        job._stop()
