"""SimGrid's SMPI: find smpicc/smpirun, build the replay program, run it, read its time.

The replay program (ext/sim/replay.c) is built with smpicc on first use into
``config.cache_dir()/sim/`` (rebuilt when its source changes: the file name carries a hash of
it). ``run`` starts ``smpirun`` on a platform with these settings, each for a reason:

- ``smpi/simulate-computation:no``: the replay computes nothing; a step's reduction costs the
  seconds its trace gives (0 by default), not the host CPU time of this machine.
- ``smpi/lat-factor:0:1``, ``smpi/bw-factor:0:1`` (``factors=False``, the default): pure
  alpha-beta links plus contention, no MPI-protocol corrections; ``factors=True`` keeps SMPI's
  defaults (calibrated on a real cluster).
- ``network/crosstraffic:0``: no bandwidth taken by acknowledgements in the reverse direction.
- ``smpi/privatization:no``: the replay keeps no per-rank globals, and copying the binary's data
  per rank would cost seconds at thousands of ranks.
- ``contexts/stack-size:64`` (KiB): thousands of ranks in one process.
- ``smpi/shared-malloc-blocksize``: raised past the largest message, so one shared block holds
  it (SMPI maps shared blocks of this size; the default 1 MiB maps a 1 GiB buffer 1024 times).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from commlayer.common import config
from commlayer.sim.platforms import Platform

SOURCE = Path(__file__).resolve().parents[2] / "ext" / "sim" / "replay.c"
_TIME = re.compile(r"commlayer-sim simulated_s=([0-9.eE+-]+)")


class SimGridMissing(RuntimeError):
    """smpicc or smpirun is not installed (Debian: ``apt-get install libsimgrid-dev``)."""


def tools() -> tuple[str, str]:
    """(smpicc, smpirun) paths; SimGridMissing naming what is absent and how to install it."""
    found = [shutil.which(tool) for tool in ("smpicc", "smpirun")]
    missing = [t for t, path in zip(("smpicc", "smpirun"), found) if path is None]
    if missing:
        raise SimGridMissing(
            f"{' and '.join(missing)} not found on PATH: install SimGrid's SMPI "
            "(Debian/Ubuntu: apt-get install libsimgrid-dev; or bash scripts/install-simgrid.sh)"
        )
    return found[0] or "", found[1] or ""


def binary(source: Path = SOURCE) -> Path:
    """The replay program, built with smpicc into the cache if it is not there yet."""
    smpicc, _ = tools()
    if not source.exists():
        raise FileNotFoundError(f"replay source {source} is missing (commlayer's ext/sim/)")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = config.cache_dir() / "sim" / f"replay-{digest}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / "replay"
        result = subprocess.run(
            [smpicc, "-O2", "-o", str(built), str(source)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"smpicc failed on {source}:\n{result.stdout}{result.stderr}")
        built.replace(target)  # atomic: a concurrent build leaves one complete file
    return target


def settings(platform: Platform, largest_bytes: int, factors: bool = False) -> list[str]:
    """The --cfg settings of a run (module docstring)."""
    cfg = [
        "smpi/simulate-computation:no",
        "network/crosstraffic:0",
        "smpi/privatization:no",
        "contexts/stack-size:64",
        f"smpi/shared-malloc-blocksize:{max(1 << 20, 1 << max(largest_bytes - 1, 1).bit_length())}",
        "smpi/display-timing:0",
        "smpi/host-speed:1e9f",
        *platform.config,
    ]
    if not factors:
        cfg += ["smpi/lat-factor:0:1", "smpi/bw-factor:0:1"]
    return cfg


def run(
    platform: Platform,
    program_args: Sequence[str],
    largest_bytes: int,
    factors: bool = False,
    extra_cfg: Sequence[str] = (),
    timeout_s: float | None = None,
) -> float:
    """Simulated seconds of the replay program on ``platform`` (one rank per entry of its
    hosts); RuntimeError with smpirun's output when it fails."""
    _, smpirun = tools()
    program = binary()
    with tempfile.TemporaryDirectory(prefix="commlayer-sim-") as tmp:
        xml, hostfile = Path(tmp) / "platform.xml", Path(tmp) / "hostfile"
        xml.write_text(platform.xml)
        hostfile.write_text(platform.hostfile())
        cfg = [f"--cfg={c}" for c in (*settings(platform, largest_bytes, factors), *extra_cfg)]
        command = [
            smpirun, "-np", str(platform.ranks), "-platform", str(xml), "-hostfile",
            str(hostfile), *cfg, "--log=root.thres:warning", str(program), *program_args,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
    match = _TIME.search(result.stdout)
    if result.returncode != 0 or match is None:
        tail = (result.stdout + result.stderr)[-4000:]
        raise RuntimeError(f"smpirun failed (exit {result.returncode}) on {platform.name}:\n{tail}")
    return float(match.group(1))
