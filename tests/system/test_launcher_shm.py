"""commlayerrun removes the MPICH shared-memory files of a job whose rank was SIGKILLed
(commlayer/launch/mpich_shm.py): MPICH unlinks them in MPI_Finalize, which a killed job never
reaches, and they filled /dev/shm run after run (27 files, 55 MB after a run of fault tests)."""

from __future__ import annotations

import json
import re
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from conftest import SCRIPTS


def _commlayerrun() -> list[str]:
    path = Path(sysconfig.get_path("scripts")) / "commlayerrun"
    return [str(path)] if path.exists() else [sys.executable, "-m", "commlayer.launch.launcher"]


def test_a_killed_jobs_shared_memory_files_are_removed(harness: ModuleType, tmp_path: Path) -> None:
    env = harness.worker_env(tmp_path, 60.0, {})
    command = [
        *_commlayerrun(), "-np", "2", sys.executable, str(SCRIPTS / "rank_failure.py"),
        "sigkill", "early",
    ]  # fmt: skip
    code, stdout, stderr = harness.run_limited(command, env, 60.0)
    output = f"exit code {code}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    ready = [
        json.loads(line)
        for path in tmp_path.glob("rank*.jsonl")
        for line in path.read_text().splitlines()
        if '"ready"' in line
    ]
    assert code != 0 and len(ready) == 2, output
    files = {name for record in ready for name in record["shm"]}
    assert files, f"the ranks mapped no MPICH shared-memory file\n{output}"
    assert not [name for name in files if Path(name).exists()], output
    said = re.search(r"removed (\d+) shared-memory file\(s\)", stderr)
    assert said is not None and int(said.group(1)) >= len(files), output
