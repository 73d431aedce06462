"""MPICH's shared-memory files that a job's killed ranks leave in /dev/shm.

MPICH's ranks on one host share a ``/dev/shm/mpich_shm_*`` file, unlinked in MPI_Finalize, which
a rank killed or aborted never reaches: a run of fault tests left 27 of them (55 MB), and they
fill /dev/shm job after job. ``remove_leftovers(since)`` removes those made since a job began
that no live process maps any more: commlayerrun calls it when mpiexec ends abnormally, the
elastic driver when a worker dies. A file another job is using is mapped by its ranks and
stays; one in the instant between its creation and its mapping is seen mapped at a second look
(``_RECHECK_S`` later) and stays too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_PATTERN = "mpich_shm_*"
# File times come from the kernel's coarse clock, a few milliseconds behind time.time(): a file
# made right after the job began can carry an earlier time.
_CLOCK_SLACK_S = 1.0
# MPICH creates the file, sizes it, then maps it, microseconds apart: a second look this much
# later sees a file another job just made mapped.
_RECHECK_S = 0.2


def _mapped(directory: Path) -> set[str]:
    """Paths under ``directory`` that some live process maps (its /proc/PID/maps)."""
    prefix = f"{directory}/"
    found = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # ended meanwhile, or another user's
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                found.add(fields[5].removesuffix(" (deleted)"))
    return found


def _unmapped_since(since: float, directory: Path) -> list[Path]:
    mapped = _mapped(directory)
    found = []
    for path in directory.glob(_PATTERN):
        try:
            info = path.stat()
        except OSError:
            continue
        mine = info.st_uid == os.getuid()
        if mine and info.st_ctime >= since - _CLOCK_SLACK_S and str(path) not in mapped:
            found.append(path)
    return found


def remove_leftovers(since: float, directory: Path | None = None) -> tuple[int, int]:
    """Remove the MPICH shared-memory files made since ``since`` (``time.time()`` when the job
    began) that no live process maps (module docstring): (files removed, their bytes).
    ``directory``: SHM_DIR by default."""
    directory = SHM_DIR if directory is None else directory
    if not _unmapped_since(since, directory):
        return 0, 0
    time.sleep(_RECHECK_S)
    files = removed_bytes = 0
    for path in _unmapped_since(since, directory):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:  # removed by someone else meanwhile
            continue
        files, removed_bytes = files + 1, removed_bytes + size
    return files, removed_bytes
