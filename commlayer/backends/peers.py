"""Who a peer process is: alive on this host or not (the backends' ``dead_peers``), which
machine's cores it runs on (``machines``), which host an address names (``lost_peers``): the
backends' one table of their peers (:class:`PeerTable`)."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Collection, Hashable, Iterable, Sequence
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


def me() -> tuple[str, int, str]:
    """(host name, pid, machine id) of this process: what a backend gathers from every rank of
    a group to make its :class:`PeerTable`."""
    return socket.gethostname(), os.getpid(), machine_id()


class PeerTable:
    """Every rank of a group as the start-up gather told it (one table for every backend that
    runs processes): ``hosts``, ``pids``, ``machines`` (indices: ranks sharing a kernel share
    one), and the ``addresses`` each host resolves to, where they were gathered. Answers the
    backends' ``hosts``, ``machines``, ``dead_peers`` and ``lost_peers``."""

    __slots__ = ("rank", "hosts", "pids", "machines", "addresses")

    def __init__(
        self,
        rank: int,
        gathered: Sequence[tuple[str, int, str]],
        addresses: Sequence[Iterable[str]] = (),
    ) -> None:
        """``gathered``: every rank's ``me()``, in rank order."""
        self.rank = rank
        self.hosts = [host for host, _, _ in gathered]
        self.pids = [pid for _, pid, _ in gathered]
        self.machines = indices([machine for _, _, machine in gathered])
        self.addresses = [set(found) for found in addresses]

    def dead(self, reported: Collection[int] = ()) -> list[int]:
        """The other ranks known to have exited: those on this host whose process is gone, and
        those in ``reported`` (the elastic driver saw them exit, wherever they ran)."""
        host = socket.gethostname()
        return [
            rank
            for rank, (peer_host, pid) in enumerate(zip(self.hosts, self.pids))
            if rank != self.rank
            and ((peer_host == host and not process_alive(pid)) or rank in reported)
        ]

    def lost(self, error: BaseException) -> tuple[str, list[int]] | None:
        """(host, its ranks) when ``error`` is a transport error naming a peer's address (gloo:
        "Connection closed by peer [10.213.0.2]:59012", as soon as a process there exits, on
        whatever host); None when it names none of the gathered addresses."""
        for address in re.findall(r"\[([0-9A-Fa-f.:]+)\]:\d+", str(error)):
            ranks = [
                r for r, found in enumerate(self.addresses) if address in found and r != self.rank
            ]
            if ranks:
                return self.hosts[ranks[0]], ranks
        return None
