"""Who a peer process is: alive on this host or not (the backends' ``dead_peers``), and which
machine's cores it runs on (``machines``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Hashable, Iterable
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    """The running kernel's boot id: processes that share it share this machine's cores, whatever
    host name their namespaces give them (the hosts of scripts/cluster.sh are network and UTS
    namespaces of one machine; so are containers); the host name where it cannot be read."""
    try:
        return _BOOT_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def addresses() -> list[str]:
    """This host's addresses as its name resolves (what a peer's transport error names it by:
    gloo's "Connection closed by peer [10.213.0.2]:59012"); none where it does not resolve."""
    try:
        return sorted(set(socket.gethostbyname_ex(socket.gethostname())[2]))
    except OSError:
        return []


def indices(keys: Iterable[Hashable]) -> list[int]:
    """Each key's index among the distinct keys, in order of first appearance (the backends'
    ``nodes`` and ``machines``)."""
    first: dict[Hashable, int] = {}
    return [first.setdefault(key, len(first)) for key in keys]


def process_alive(pid: int) -> bool:
    """False when the process is gone or a zombie (exited, not yet reaped by mpiexec)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in (b"Z", b"X")
