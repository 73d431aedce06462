"""Whether a peer process on this host is still alive (the backends' ``dead_peers``)."""

from __future__ import annotations

import os


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
