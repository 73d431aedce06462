"""The elastic driver's control channel: framed, HMAC-SHA256-signed JSON messages.

Every connection to the driver (a worker's requests, its event stream, its rendezvous store)
goes through this protocol; only the job's own workers know the job key (``secrets.token_bytes``,
made by the driver and handed to the workers it starts).

- Framing: a 4-byte big-endian length, then the frame. A frame longer than its limit is
  refused before it is read (garbage cannot make the driver allocate): the client's first
  frame, read before anything is verified, at most ``GREETING_MAX_FRAME`` (4 KiB), later ones
  ``MAX_FRAME``.
- On connect, the driver sends a 32-byte random nonce (unsigned). From then on every frame is
  ``HMAC-SHA256(key, direction | nonce | counter | body) | body``: ``direction`` is ``C``
  (client to driver) or ``S`` (driver to client), ``counter`` the frame's number in that
  direction on this connection (8 bytes, from 0, never sent: both ends count). A message
  replayed on another connection fails (another nonce), one replayed, dropped or reordered on
  the same connection fails (another counter), one from a client without the key fails; the
  driver then logs the refusal and closes the connection.
- The greeting has one deadline: the client's first message must arrive, signed, within
  ``HANDSHAKE_TIMEOUT_S`` of the connect, however it trickles in. The driver's side is
  ``Handshake``, driven by a non-blocking socket (commlayer/launch/server.py runs every
  connection's handshake in one thread); a client waits for the driver's nonce at most its
  connect timeout.

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
# The client's first frame, read before its MAC is checked: a hello is ~100 bytes (a worker's
# name holds a host name, at most 253); 4 KiB bounds what unauthenticated clients can make the
# driver hold (64 at once: 256 KiB, where 16 MiB each could be buffered before).
GREETING_MAX_FRAME = 4 << 10
HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32
_MAC_BYTES = 32
_LENGTH = struct.Struct(">I")


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


def read_frame(sock: socket.socket, limit: int = MAX_FRAME) -> bytes:
    (length,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if length > limit:
        raise AuthError(f"frame of {length} bytes announced (at most {limit})")
    return _read_exact(sock, length)


def write_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(frame)) + frame)


class Channel:
    """One authenticated connection, either end: ``send`` and ``recv`` count their frames
    (``received``: frames already read, the greeting's, when the driver's ``Handshake`` read
    it)."""

    def __init__(
        self, sock: socket.socket, key: bytes, nonce: bytes, client: bool, received: int = 0
    ) -> None:
        self.sock, self._key, self._nonce = sock, key, nonce
        self._out, self._in = (b"C", b"S") if client else (b"S", b"C")
        self._sent, self._received = 0, received

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
    """A client's channel to the driver at ``host:port``: connected, and the driver's nonce
    read, within ``timeout_s`` each (a driver that stopped accepting is an error, not a wait
    for ever)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        nonce = read_frame(sock, NONCE_BYTES)
    except (OSError, ConnectionError) as exc:
        sock.close()
        raise ConnectionError(f"{address}: no greeting from the driver ({exc})") from None
    sock.settimeout(None)
    if len(nonce) != NONCE_BYTES:
        sock.close()
        raise ConnectionError(f"{address}: not a commlayer elastic driver (bad greeting)")
    return Channel(sock, key, nonce, client=True)


class Handshake:
    """The driver's side of one new connection, on a non-blocking socket: send the nonce
    (``send``, while ``sending``), then read the client's first frame (``receive``: its
    message once whole, None before) at most GREETING_MAX_FRAME long, never past it (the next
    bytes are the channel's), and verify it. AuthError for a frame too long or not signed,
    ConnectionError when the client closes first; BlockingIOError passes through."""

    def __init__(self, sock: socket.socket, key: bytes, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline  # time.monotonic() of the greeting's end
        self._key, self._nonce = key, os.urandom(NONCE_BYTES)
        self._out = _LENGTH.pack(NONCE_BYTES) + self._nonce
        self._in = bytearray()

    @property
    def sending(self) -> bool:
        return bool(self._out)

    def send(self) -> None:
        self._out = self._out[self.sock.send(self._out) :]

    def receive(self) -> Any:
        if len(self._in) < _LENGTH.size:
            want = _LENGTH.size - len(self._in)
        else:
            want = _LENGTH.size + self._length() - len(self._in)
        chunk = self.sock.recv(want)
        if not chunk:
            raise ConnectionError("closed before its greeting")
        self._in += chunk
        if len(self._in) < _LENGTH.size or len(self._in) < _LENGTH.size + self._length():
            return None
        return open_frame(self._key, b"C", self._nonce, 0, bytes(self._in[_LENGTH.size :]))

    def _length(self) -> int:
        (length,) = _LENGTH.unpack_from(self._in)
        if length > GREETING_MAX_FRAME:
            raise AuthError(f"greeting of {length} bytes announced (at most {GREETING_MAX_FRAME})")
        return int(length)

    def channel(self) -> Channel:
        """The connection once the greeting verified, blocking again (its first frame
        counted)."""
        self.sock.setblocking(True)
        return Channel(self.sock, self._key, self._nonce, client=False, received=1)
