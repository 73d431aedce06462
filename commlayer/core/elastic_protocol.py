"""The elastic driver's control channel: framed, HMAC-SHA256-signed JSON messages.

Every connection to the driver (a worker's requests, its event stream, its rendezvous store)
goes through this protocol; only the job's own workers know the job key (``secrets.token_bytes``,
made by the driver and handed to the workers it starts).

- Framing: a 4-byte big-endian length, then the frame. A frame longer than ``MAX_FRAME`` is
  refused before it is read (garbage cannot make the driver allocate).
- On connect, the driver sends a 32-byte random nonce (unsigned). From then on every frame is
  ``HMAC-SHA256(key, direction | nonce | counter | body) | body``: ``direction`` is ``C``
  (client to driver) or ``S`` (driver to client), ``counter`` the frame's number in that
  direction on this connection (8 bytes, from 0, never sent: both ends count). A message
  replayed on another connection fails (another nonce), one replayed, dropped or reordered on
  the same connection fails (another counter), one from a client without the key fails; the
  driver then logs the refusal and closes the connection.
- The client's first message must arrive, signed, within ``HANDSHAKE_TIMEOUT_S`` of the
  connect: a client that connects and says nothing holds one driver thread for that long and
  nothing else (each connection has a thread of its own).

What it does not cover: the bodies are not encrypted (state and keys of the rendezvous store,
gloo's addresses, are readable on the wire, not writable); gloo's own data connections between
workers, set up from the addresses exchanged through the store, are plain TCP as under torchrun.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any

MAX_FRAME = 16 << 20
HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32
_MAC_BYTES = 32


class AuthError(ConnectionError):
    """A frame that does not verify: a wrong key, a replay, a reordering, garbage."""


def sign(key: bytes, direction: bytes, nonce: bytes, counter: int, body: bytes) -> bytes:
    """The MAC of one frame's body (module docstring)."""
    header = direction + nonce + struct.pack(">Q", counter)
    return hmac.new(key, header + body, hashlib.sha256).digest()


def seal(key: bytes, direction: bytes, nonce: bytes, counter: int, message: Any) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return sign(key, direction, nonce, counter, body) + body


def open_frame(key: bytes, direction: bytes, nonce: bytes, counter: int, frame: bytes) -> Any:
    """The message of a frame, or AuthError when its MAC does not verify."""
    mac, body = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
    if len(mac) != _MAC_BYTES or not hmac.compare_digest(
        mac, sign(key, direction, nonce, counter, body)
    ):
        raise AuthError("message not signed with the job key (wrong key, replay or garbage)")
    try:
        return json.loads(body)
    except ValueError as exc:  # signed but not JSON: a bug, not an attack
        raise AuthError(f"signed message is not JSON: {exc}") from None


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> bytes:
    (length,) = struct.unpack(">I", _read_exact(sock, 4))
    if length > MAX_FRAME:
        raise AuthError(f"frame of {length} bytes announced (at most {MAX_FRAME})")
    return _read_exact(sock, length)


def write_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(struct.pack(">I", len(frame)) + frame)


class Channel:
    """One authenticated connection, either end: ``send`` and ``recv`` count their frames."""

    def __init__(self, sock: socket.socket, key: bytes, nonce: bytes, client: bool) -> None:
        self.sock, self._key, self._nonce = sock, key, nonce
        self._out, self._in = (b"C", b"S") if client else (b"S", b"C")
        self._sent = self._received = 0

    def send(self, message: Any) -> None:
        write_frame(self.sock, seal(self._key, self._out, self._nonce, self._sent, message))
        self._sent += 1

    def recv(self) -> Any:
        message = open_frame(
            self._key, self._in, self._nonce, self._received, read_frame(self.sock)
        )
        self._received += 1
        return message

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(address: str, key: bytes, timeout_s: float = 30.0) -> Channel:
    """A client's channel to the driver at ``host:port``."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = read_frame(sock)
    if len(nonce) != NONCE_BYTES:
        sock.close()
        raise ConnectionError(f"{address}: not a commlayer elastic driver (bad greeting)")
    return Channel(sock, key, nonce, client=True)


def accept(sock: socket.socket, key: bytes) -> tuple[Channel, Any]:
    """The driver's side of a new connection: greet, then read and verify the first message
    within HANDSHAKE_TIMEOUT_S (AuthError, OSError or ConnectionError otherwise)."""
    nonce = os.urandom(NONCE_BYTES)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    write_frame(sock, nonce)
    channel = Channel(sock, key, nonce, client=False)
    first = channel.recv()
    sock.settimeout(None)
    return channel, first
