"""CPU time from /proc (proc(5)), for benchmarks that count what processes and threads spend."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def read(stat: Path) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system) of the process or thread whose ``stat`` file
    this is; None once it has ended."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK
