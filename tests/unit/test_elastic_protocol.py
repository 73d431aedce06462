"""The elastic driver's control channel (commlayer/elastic/protocol.py): message signing, and a
driver in this process that refuses what does not carry the job key, replays included, without
a silent client holding up the job's workers (issue 38)."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from commlayer.elastic import protocol
from commlayer.launch import driver as driver_module

KEY = b"k" * 32
NONCE = b"n" * protocol.NONCE_BYTES


def test_signed_message_opens_with_the_same_key_nonce_and_counter_only() -> None:
    frame = protocol.seal(KEY, b"C", NONCE, 3, {"op": "set", "key": "a"})
    assert protocol.open_frame(KEY, b"C", NONCE, 3, frame) == {"op": "set", "key": "a"}
    other_nonce = b"m" * protocol.NONCE_BYTES
    for key, direction, nonce, counter in [
        (b"x" * 32, b"C", NONCE, 3),  # another key
        (KEY, b"S", NONCE, 3),  # reflected back the other way
        (KEY, b"C", other_nonce, 3),  # replayed on another connection
        (KEY, b"C", NONCE, 4),  # replayed later on the same connection
    ]:
        with pytest.raises(protocol.AuthError):
            protocol.open_frame(key, direction, nonce, counter, frame)
    tampered = frame[:-2] + b"0}"
    with pytest.raises(protocol.AuthError):
        protocol.open_frame(KEY, b"C", NONCE, 3, tampered)
    with pytest.raises(protocol.AuthError):
        protocol.open_frame(KEY, b"C", NONCE, 3, b"short")


def _driver() -> driver_module.Driver:
    """A driver serving its channel, with one worker it knows (no process started)."""
    job = driver_module.Driver(["true"], 1, 1, 1, lambda: {"localhost": 1}, {})
    job._workers["localhost:0:1"] = None  # type: ignore[assignment]
    job._hosts = {"localhost": 1}
    assert job._address() == f"127.0.0.1:{_port(job)}"  # starts the server: loopback
    return job


def _port(job: driver_module.Driver) -> int:
    assert job._server is not None
    return int(job._server.port)


def _close(job: driver_module.Driver) -> None:
    job._stopping = True
    assert job._server is not None
    job._server.close()


def _hello(job: driver_module.Driver, key: bytes) -> protocol.Channel:
    channel = protocol.connect(f"127.0.0.1:{_port(job)}", key, timeout_s=5)
    channel.send({"op": "hello", "worker": "localhost:0:1", "role": "rpc"})
    return channel


def _closed(sock: socket.socket) -> bool:
    """Whether the driver closed ``sock`` having sent nothing but its greeting (its length and
    nonce; already read by the clients made with protocol.connect)."""
    sock.settimeout(10)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionError:
        pass
    return len(got) <= 4 + protocol.NONCE_BYTES


def test_driver_refuses_without_the_key_and_a_silent_client_blocks_nobody(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol, "HANDSHAKE_TIMEOUT_S", 1.0)
    job = _driver()
    try:
        with caplog.at_level(logging.WARNING, logger="commlayer.launch.driver"):
            silent = socket.create_connection(("127.0.0.1", _port(job)))  # never says a word
            # the job's worker is served at once meanwhile
            began = time.monotonic()
            good = _hello(job, job.key)
            assert good.recv() == {"ok": True}
            good.send({"op": "set", "key": "k", "value": "MQ=="})
            assert good.recv() == {}
            assert time.monotonic() - began < protocol.HANDSHAKE_TIMEOUT_S
            # a wrong key: refused, nothing written
            wrong = _hello(job, b"w" * 32)
            assert _closed(wrong.sock)
            # garbage: a length far over the limit
            garbage = socket.create_connection(("127.0.0.1", _port(job)))
            protocol.read_frame(garbage)
            garbage.sendall(b"\xff\xff\xff\xffjunk")
            assert _closed(garbage)
            # the good client's frame replayed on a connection of its own: another nonce
            raw = protocol.seal(job.key, b"C", good._nonce, 0, {"op": "hello", "worker": "x"})
            replay = socket.create_connection(("127.0.0.1", _port(job)))
            protocol.read_frame(replay)
            protocol.write_frame(replay, raw)
            assert _closed(replay)
            # ... and on the same connection: counter 1 expected, 0 given
            protocol.write_frame(good.sock, raw)
            assert _closed(good.sock)
            assert _closed(silent)  # refused at the handshake's time limit
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 5 and job.refused == 5, refusals
        assert job._store == {"k": b"1"}
    finally:
        _close(job)


def test_signed_hello_naming_no_worker_of_the_job_is_refused() -> None:
    job = _driver()
    try:
        channel = protocol.connect(f"127.0.0.1:{_port(job)}", job.key, timeout_s=5)
        channel.send({"op": "hello", "worker": "someone:0:9", "role": "events"})
        assert _closed(channel.sock)
        assert job.refused == 1 and not job._events
    finally:
        _close(job)


def test_parse_hosts() -> None:
    assert driver_module.parse_hosts("a:2\nb\n# c:9\n\na:1", 4) == {"a": 3, "b": 4}
    for bad in ("a:0", "a:x", ":2"):
        with pytest.raises(ValueError, match="bad entry"):
            driver_module.parse_hosts(bad)


def test_commlayerrun_refuses_elastic_mode_over_mpi(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from commlayer.launch import launcher

    monkeypatch.setenv("COMMLAYER_BACKEND", "mpi")
    assert launcher.main(["-np", "2", "--min-np", "1", "-H", "localhost:2", "true"]) == 2
    assert "MPI cannot re-form its world" in capsys.readouterr().err
