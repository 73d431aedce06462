"""The elastic driver's control channel server: listens, accepts, authenticates each
connection's greeting (elastic/protocol.py) and hands the authenticated channel with its
greeting to the driver's ``serve``, in a thread of that connection's own.

1. Connections not yet authenticated cost no thread: one selector loop, this server's thread,
   accepts them and runs every greeting (``protocol.Handshake``). Only a connection whose
   greeting verified gets a thread.
2. At most ``max_handshakes`` (64) connections are in their greeting at once; more are closed
   as soon as accepted (``over_cap`` counts them; logged once a burst), never queued.
3. The greeting has one deadline, ``protocol.HANDSHAKE_TIMEOUT_S`` after the accept, however
   the client trickles its bytes, and a first frame of at most GREETING_MAX_FRAME bytes: an
   unauthenticated client holds 4 KiB and a socket for 5 s at most.
4. The loop outlives every error. An accept that fails (EMFILE/ENFILE: out of descriptors;
   ENOBUFS, ENOMEM) stops accepting for a backoff, 10 ms doubling to 1 s, while the greetings
   in progress go on and free their descriptors as they end; the connections waiting meanwhile
   stay in the listen queue and are accepted after. A session thread that cannot start
   (RuntimeError, MemoryError) is tried again after the backoff, its channel kept; any other
   error backs off the same way. A run of failures is logged once, and its end once.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from commlayer.elastic import protocol

log = logging.getLogger("commlayer.launch.driver")  # the driver's log: its channel's words

MAX_HANDSHAKES = 64
_MIN_BACKOFF_S = 0.01
_MAX_BACKOFF_S = 1.0
# accepted in a row before the greetings in progress get their turn
_ACCEPTS_A_TURN = 64
# accept() errors that only say the connection it was to return is gone: take the next one
_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR})
_CLOSE_WAIT_S = 5.0

# serve(channel, greeting, peer): runs in the connection's thread, owns the channel
Serve = Callable[[protocol.Channel, Any, str], None]
# refuse(peer, why): a connection whose greeting failed; the server closes it after
Refuse = Callable[[str, object], None]


class Server:
    """The control channel (module docstring), listening on ``host`` (an address of this
    machine, ``0.0.0.0`` for all) at a free port; ``start`` runs its thread, ``close`` ends it
    and closes every connection not yet handed to ``serve``."""

    def __init__(
        self,
        key: bytes,
        serve: Serve,
        refuse: Refuse,
        host: str = "127.0.0.1",
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        self._key, self._serve, self._refuse = key, serve, refuse
        self.max_handshakes = max_handshakes
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self.over_cap = 0  # connections closed unread: max_handshakes were in their greeting
        self._burst = 0  # ... in the burst going on (logged when it ends)
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()  # close() wakes the loop
        self._wake.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._greeting: dict[socket.socket, tuple[protocol.Handshake, str]] = {}
        self._ready: collections.deque[tuple[protocol.Channel, Any, str]] = collections.deque()
        self._accept_at: float | None = None  # accepting paused until then (listener unwatched)
        self._ready_at = 0.0  # the next try to start a session thread
        self._backoff_s = _MIN_BACKOFF_S
        self._failures = 0  # in the run of failures going on
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="commlayerrun-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        if self._thread.ident is None:  # never started
            self._shut()
        elif self._thread is not threading.current_thread():
            try:
                self._waker.send(b"\0")
            except OSError:
                pass
            self._thread.join(_CLOSE_WAIT_S)
        self._waker.close()

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                try:
                    self._turn()
                except Exception as exc:  # noqa: BLE001 - the channel must outlive any error
                    time.sleep(self._failed(f"{type(exc).__name__}: {exc}"))
        finally:
            self._shut()

    def _turn(self) -> None:
        now = time.monotonic()
        if self._accept_at is not None and now >= self._accept_at:
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._accept_at = None
        if self._ready and now >= self._ready_at:
            self._start_sessions()
        for key, _ in self._selector.select(self._timeout(now)):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake:
                self._wake.recv(64)
            else:
                self._greet(key.fileobj)  # type: ignore[arg-type]
        self._expire(time.monotonic())

    def _timeout(self, now: float) -> float | None:
        """Until the next thing to do without a socket event: a greeting's deadline, the end
        of an accept backoff, the next try to start a session."""
        times = [handshake.deadline for handshake, _ in self._greeting.values()]
        times += [self._accept_at] if self._accept_at is not None else []
        times += [self._ready_at] if self._ready else []
        return max(0.0, min(times) - now) if times else None

    def _failed(self, what: str) -> float:
        """A failure of the loop: logged at the first of a run; the backoff to wait."""
        if not self._failures:
            log.warning(
                "commlayerrun: the driver's control channel: %s; backing off (up to %g s) and "
                "serving on",
                what,
                _MAX_BACKOFF_S,
            )
        self._failures += 1
        delay, self._backoff_s = self._backoff_s, min(2 * self._backoff_s, _MAX_BACKOFF_S)
        return delay

    def _recovered(self) -> None:
        if self._failures:
            log.warning(
                "commlayerrun: the driver's control channel works again, after %d failure(s)",
                self._failures,
            )
            self._failures, self._backoff_s = 0, _MIN_BACKOFF_S

    # -- accepting --------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(_ACCEPTS_A_TURN):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _GONE:
                    continue
                name = errno.errorcode.get(exc.errno or 0, "")
                delay = self._failed(f"accept failed: {name} {exc.strerror or exc}".strip())
                self._selector.unregister(self._listener)
                self._accept_at = time.monotonic() + delay
                return
            self._recovered()
            self._admit(sock, f"{address[0]}:{address[1]}")

    def _admit(self, sock: socket.socket, peer: str) -> None:
        if len(self._greeting) >= self.max_handshakes:
            self.over_cap += 1  # (counted before the client sees the close)
            self._burst += 1
            if self._burst == 1:
                log.warning(
                    "commlayerrun: %d connections are in their greeting, the most the driver "
                    "takes: closing new ones at once (the first from %s)",
                    self.max_handshakes,
                    peer,
                )
            sock.close()
            return
        if self._burst:
            log.warning(
                "commlayerrun: closed %d connection(s) over the limit of %d in their greeting",
                self._burst,
                self.max_handshakes,
            )
            self._burst = 0
        sock.setblocking(False)
        deadline = time.monotonic() + protocol.HANDSHAKE_TIMEOUT_S
        self._greeting[sock] = (protocol.Handshake(sock, self._key, deadline), peer)
        self._selector.register(sock, selectors.EVENT_WRITE)

    # -- greetings --------------------------------------------------------------------------
    def _greet(self, sock: socket.socket) -> None:
        handshake, peer = self._greeting[sock]
        try:
            if handshake.sending:
                handshake.send()
                if not handshake.sending:
                    self._selector.modify(sock, selectors.EVENT_READ)
                return
            message = handshake.receive()
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError) as exc:  # AuthError and ConnectionError are OSErrors
            self._drop(sock, peer, exc)
            return
        if message is None:
            return
        self._selector.unregister(sock)
        del self._greeting[sock]
        self._ready.append((handshake.channel(), message, peer))
        if time.monotonic() >= self._ready_at:  # (else backing off: _turn tries again)
            self._start_sessions()

    def _drop(self, sock: socket.socket, peer: str, why: object) -> None:
        self._selector.unregister(sock)
        del self._greeting[sock]
        self._refuse(peer, why)  # counted and logged before the client sees the close
        sock.close()

    def _expire(self, now: float) -> None:
        late = [sock for sock, (shake, _) in self._greeting.items() if shake.deadline <= now]
        for sock in late:
            why = f"no signed greeting within {protocol.HANDSHAKE_TIMEOUT_S:g} s of the connect"
            self._drop(sock, self._greeting[sock][1], why)

    # -- sessions ---------------------------------------------------------------------------
    def _start_sessions(self) -> None:
        while self._ready:
            channel, greeting, peer = self._ready[0]
            try:
                threading.Thread(
                    target=self._session,
                    args=(channel, greeting, peer),
                    name=f"commlayerrun-driver {peer}",
                    daemon=True,
                ).start()
            except (RuntimeError, MemoryError) as exc:  # "can't start new thread"
                delay = self._failed(f"cannot start a thread for a connection: {exc}")
                self._ready_at = time.monotonic() + delay
                return
            self._ready.popleft()
            self._recovered()

    def _session(self, channel: protocol.Channel, greeting: Any, peer: str) -> None:
        try:
            self._serve(channel, greeting, peer)
        except Exception:  # a bug in serve: this connection ends, the driver goes on
            log.exception("commlayerrun: the connection from %s failed", peer)
            channel.close()

    def _shut(self) -> None:
        for sock in list(self._greeting):
            sock.close()
        self._greeting.clear()
        while self._ready:
            self._ready.popleft()[0].close()
        self._listener.close()
        self._selector.close()
        self._wake.close()
