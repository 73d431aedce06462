"""System-test harness: run a worker script under ``mpiexec -n N`` and read what each rank did.

1. Every job has a hard wall-clock limit. On expiry every rank dumps its threads' stacks
   (SIGUSR2, registered by ``_worker.start``), then the whole process tree is SIGKILLed and the
   test fails showing the captured output: a hang is a failure that explains itself, never a
   stuck CI job. Hydra puts the proxy and every rank in a session of its own, so killing
   mpiexec's process group would leave the ranks running: the tree is walked through /proc.
2. Workers report results as JSON records (``_worker.report``) appended to one file per rank in
   a fresh directory, and also echo them to stdout. Tests read the files: mpiexec stops
   forwarding a rank's output once another rank was killed by a signal, a file does not.
3. The job's environment is this one without any ``COMMLAYER_*`` variable (a developer's
   ``COMMLAYER_TIMELINE`` must not leak in), with ``OMP_NUM_THREADS=1`` (3 ranks on 2 cores
   must not each start a thread per core) and tests/ on PYTHONPATH (the workers wait with
   tests/waiting.py, as the tests do) plus what the test passes.
4. The examples' documented commands run as typed (``docstring_commands``, ``run_as_typed``):
   through bash, with this environment's launchers and python first on PATH.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from waiting import poll

SCRIPTS = Path(__file__).parent / "scripts"
TESTS = Path(__file__).resolve().parent.parent
# Startup of one rank (import torch, MPI_Init) takes 2-4 s on the 2-core CI machine, 3 ranks
# longer; 45 s leaves room for a loaded machine while a hang still fails within a minute.
DEFAULT_TIMEOUT_S = 45.0
TORCHRUN_TIMEOUT_S = 90.0  # torchrun's agent and N ranks importing torch on a loaded 2-core machine
_STACK_DUMP_GRACE_S = 1.0


def _mpiexec() -> str:
    """The mpiexec next to this python (the mpich wheel's), else the first on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found next to the python or on PATH (pip install '.[mpich]')")
    return found


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _runs(pid: int, script: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return script.encode() in cmdline.read().split(b"\0")
    except OSError:
        return False


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (killed, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _wait_gone(pids: Sequence[int], limit_s: float = 5.0) -> None:
    """SIGKILL is delivered asynchronously: a rank reparented away from the killed proxy can
    outlive mpiexec by some milliseconds. Wait for every process to have ended."""
    poll(lambda: not any(map(_alive, pids)), limit_s, poll_s=0.01)


def worker_env(out_dir: Path, watchdog_s: float, extra: dict[str, str]) -> dict[str, str]:
    """A worker job's environment (module docstring, item 3): this one without COMMLAYER_*,
    one OpenMP thread, reports to ``out_dir``, and a backstop should the harness itself be
    killed: ranks end themselves after ``watchdog_s``; tests/ on PYTHONPATH; then
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMLAYER_")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        SYSTEST_OUT_DIR=str(out_dir),
        SYSTEST_WATCHDOG_S=str(watchdog_s),
    )
    env.update(extra)
    return env


def run_limited(
    command: Sequence[str],
    env: dict[str, str],
    timeout_s: float,
    cwd: Path | None = None,
    dump_stacks_of: str | None = None,
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``command``, run in a session of its own. Past
    ``timeout_s``, processes running ``dump_stacks_of`` get SIGUSR2 (``_worker`` ranks print
    every thread's stack), then the whole tree is SIGKILLed and the test fails with the output."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # The tree before any kill: a rank whose proxy died is reparented away from it.
        tree = _descendants(proc.pid)
        if dump_stacks_of is not None:
            # Only the ranks: SIGUSR2 would terminate mpiexec's proxy, and their output with it.
            _signal_all([p for p in tree if _runs(p, dump_stacks_of)], signal.SIGUSR2)
            time.sleep(_STACK_DUMP_GRACE_S)
        killed = [proc.pid, *_descendants(proc.pid), *tree]
        _signal_all(killed, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        _wait_gone(killed)
        pytest.fail(
            f"HANG: killed after {timeout_s:g} s\n$ {' '.join(command)}\nexit code -9"
            f"\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            pytrace=False,
        )
    return proc.returncode, stdout, stderr


@dataclasses.dataclass
class Job:
    """What one mpiexec run did."""

    command: list[str]
    size: int
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    ended_at: float  # time.time() when mpiexec had exited, to compare with record times
    records: list[dict[str, Any]]

    def output(self) -> str:
        """Everything captured, for assertion messages."""
        return (
            f"$ {' '.join(self.command)}\nexit code {self.returncode} after {self.elapsed_s:.1f} s"
            f"\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )

    def find(self, event: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [
            r for r in self.records if r["event"] == event and (rank is None or r["rank"] == rank)
        ]

    def one(self, event: str, rank: int) -> dict[str, Any]:
        found = self.find(event, rank)
        assert len(found) == 1, f"rank {rank}: expected one {event!r} record\n{self.output()}"
        return found[0]


# A command in an example's docstring: an indented line that starts with a launcher, maybe after
# VAR=value assignments; a line ending in a backslash goes on on the next.
_COMMAND = re.compile(
    r"^ +((?:[A-Z_]+=\S+ +)*(?:commlayerrun|torchrun|mpiexec|accelerate launch) .*)$"
)


def docstring_commands(path: Path) -> list[str]:
    """The shell commands in the docstring of ``path`` (an example), continuation lines
    joined, as a user copies them."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found: list[str] = []
    lines = iter(doc.splitlines())
    for line in lines:
        match = _COMMAND.match(line)
        if match is None:
            continue
        command = match.group(1).rstrip()
        while command.endswith("\\"):
            command = command[:-1].rstrip() + " " + next(lines).strip()
        found.append(command)
    return found


def docs_blocks() -> ModuleType:
    """scripts/docs_blocks.py: the code blocks of README.md and docs/, and what they say."""
    import importlib.util

    path = TESTS.parent / "scripts" / "docs_blocks.py"
    spec = importlib.util.spec_from_file_location("docs_blocks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_blocks"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def documented_output_mismatches(command: str, stdout: str) -> list[str]:
    """Where the documentation shows what ``command`` prints (``<!-- output of: ... -->``),
    how ``stdout`` differs from it; [] where it matches or nothing is shown."""
    blocks = docs_blocks()
    found = []
    for block in blocks.outputs_of(command):
        problem = blocks.output_mismatch(block.text, stdout)
        if problem is not None:
            found.append(f"{block.where()}: {problem}")
    return found


def run_as_typed(command: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``command`` as a user types it into a shell (bash -c), in ``cwd``: this interpreter's
    environment first on PATH (its python, commlayerrun, torchrun, mpiexec), no COMMLAYER_*
    variable but those the command sets, one OpenMP thread. Past ``timeout_s`` the whole tree
    is killed and the test fails with the output (``run_limited``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMLAYER_")}
    scripts = sysconfig.get_path("scripts")
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PATH=os.pathsep.join(filter(None, [scripts, os.environ.get("PATH")])),
    )
    code, stdout, stderr = run_limited(["bash", "-c", command], env, timeout_s, cwd=cwd)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def _read_records(out_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(out_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


RunMPI = Callable[..., Job]


@pytest.fixture(scope="module")
def harness(pytestconfig: pytest.Config) -> ModuleType:
    """This conftest.py as pytest loaded it, for tests that call its helpers (worker_env,
    run_limited, ...). Not ``import conftest``: that name is whichever conftest.py pytest
    loaded last (``pytest tests/system tests/parallel``)."""
    path = Path(__file__).resolve()
    for plugin in pytestconfig.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == path:
            return plugin
    pytest.fail(f"{path} is not loaded as a conftest")


@pytest.fixture(scope="session")
def run_mpi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunMPI]:
    """``run_mpi(script, n, *args, env={}, timeout_s=None, mpiexec_args=(), torchrun=False)``
    -> Job. ``torchrun``: started by ``torchrun --standalone --nproc_per_node n`` instead of
    mpiexec (commlayer then runs over torch.distributed; ``mpiexec_args`` are torchrun's).
    ``timeout_s`` defaults to DEFAULT_TIMEOUT_S, TORCHRUN_TIMEOUT_S under torchrun.

    Session-scoped so that a module-scoped fixture can run one job for several tests.
    """

    def run(
        script: str,
        n: int,
        *args: str,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        mpiexec_args: Sequence[str] = (),
        torchrun: bool = False,
    ) -> Job:
        if timeout_s is None:
            timeout_s = TORCHRUN_TIMEOUT_S if torchrun else DEFAULT_TIMEOUT_S
        out_dir = tmp_path_factory.mktemp(Path(script).stem)
        job_env = worker_env(out_dir, timeout_s + 10.0, env or {})
        if torchrun:  # torchrun runs the script under its own python
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [
                *launcher, *mpiexec_args, "--nproc_per_node", str(n), str(SCRIPTS / script), *args,
            ]  # fmt: skip
        else:
            launcher = [_mpiexec(), *mpiexec_args, "-n", str(n), sys.executable]
            command = [*launcher, str(SCRIPTS / script), *args]
        start = time.monotonic()
        returncode, stdout, stderr = run_limited(
            command, job_env, timeout_s, dump_stacks_of=command[-1 - len(args)]
        )
        elapsed = time.monotonic() - start
        records = _read_records(out_dir)
        return Job(command, n, args, returncode, stdout, stderr, elapsed, time.time(), records)

    yield run
