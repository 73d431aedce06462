"""commlayerrun without an MPI job: the mpiexec command line for MPICH (Hydra) and Open MPI,
the ranks' environment, launcher discovery and flavor, --check-build, and main()'s errors.

Launchers are fakes: a shell script in tmp_path that prints a version string. subprocess.call
is replaced, so nothing here starts a rank.
"""

from __future__ import annotations

import mmap
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

import commlayer
from commlayer.common import config
from commlayer.launch import hosts as hostlist
from commlayer.launch import launcher, mpich_shm

OPEN_MPI_VERSION = (
    "mpirun (Open MPI) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/"
)
OPENRTE_VERSION = (
    "mpiexec (OpenRTE) 3.1.3\n\nReport bugs to http://www.open-mpi.org/community/help/"
)
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.1.2"
INTEL_VERSION = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619"

COMMAND = ["python", "train.py", "--epochs", "3", "-n", "7"]  # '-n' is the script's, not mpiexec's
ENVIRON = {
    "PATH": "/usr/bin",
    "HOME": "/home/user",
    "OMP_NUM_THREADS": "1",
    "COMMLAYER_TIMELINE": "/tmp/t.json",
    "COMMLAYER_CYCLE_TIME": "2",
    "XCOMMLAYER_NOT_OURS": "1",
    "COMMLAYER": "not a COMMLAYER_ variable",
}
PASSED = ["COMMLAYER_CYCLE_TIME", "COMMLAYER_TIMELINE", "OMP_NUM_THREADS"]  # sorted


def fake_launcher(
    directory: Path, version_text: str, name: str = "mpiexec", stderr: bool = False
) -> str:
    """An executable printing ``version_text`` (on stderr if asked), as ``mpiexec --version``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    redirect = " >&2" if stderr else ""
    # printf is built into sh: the fake runs with any PATH.
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' {shlex.quote(version_text)}{redirect}\n")
    path.chmod(0o755)
    return str(path)


# build_command ------------------------------------------------------------------------------


def test_build_command_mpich() -> None:
    cmd = launcher.build_command("/m/mpiexec", "mpich", 4, None, None, COMMAND, ENVIRON)
    assert cmd == ["/m/mpiexec", "-n", "4", "-genvlist", ",".join(PASSED), *COMMAND]


def test_build_command_mpich_hosts_and_hostfile() -> None:
    hosts = launcher.build_command("/m/mpiexec", "mpich", 4, "a:2,b:2", None, COMMAND, {})
    assert hosts == ["/m/mpiexec", "-n", "4", "-hosts", "a:2,b:2", *COMMAND]
    hostfile = launcher.build_command("/m/mpiexec", "mpich", 4, None, "/h/file", COMMAND, {})
    assert hostfile == ["/m/mpiexec", "-n", "4", "-f", "/h/file", *COMMAND]


def test_build_command_mpich_without_variables_to_pass() -> None:
    cmd = launcher.build_command("/m/mpiexec", "mpich", 2, None, None, COMMAND, {"PATH": "/bin"})
    assert cmd == ["/m/mpiexec", "-n", "2", *COMMAND]


def test_build_command_openmpi() -> None:
    cmd = launcher.build_command("/o/mpirun", "openmpi", 4, None, None, COMMAND, ENVIRON)
    assert cmd == [
        "/o/mpirun", "-np", "4", "--bind-to", "none", "--oversubscribe",
        "--mca", "mpi_yield_when_idle", "1",
        "-x", "COMMLAYER_CYCLE_TIME", "-x", "COMMLAYER_TIMELINE", "-x", "OMP_NUM_THREADS",
        *COMMAND,
    ]  # fmt: skip


def test_build_command_openmpi_hosts_and_hostfile() -> None:
    hosts = launcher.build_command("/o/mpirun", "openmpi", 4, "a:2,b:2", None, COMMAND, {})
    assert hosts[-len(COMMAND) - 2 : -len(COMMAND)] == ["-H", "a:2,b:2"]
    assert "--hostfile" not in hosts
    hostfile = launcher.build_command("/o/mpirun", "openmpi", 4, None, "/h/file", COMMAND, {})
    assert hostfile[-len(COMMAND) - 2 : -len(COMMAND)] == ["--hostfile", "/h/file"]
    assert "-H" not in hostfile


def test_build_command_unknown_flavor_uses_hydra_options() -> None:
    """Hydra's options (-n, -genvlist) are the fallback: Intel MPI and MPICH derivatives."""
    unknown = launcher.build_command("/u/mpiexec", "unknown", 3, None, None, COMMAND, ENVIRON)
    mpich = launcher.build_command("/u/mpiexec", "mpich", 3, None, None, COMMAND, ENVIRON)
    assert unknown == mpich


# launch_environ -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cores", "np", "hosts", "threads"),
    [
        (8, 4, None, "2"),
        (8, 3, None, "2"),  # 8 // 3
        (8, 1, None, "8"),
        (2, 4, None, "1"),  # more ranks than cores: at least one thread
        (2, 2, None, "1"),
        (8, 4, "a:2,b:2", "4"),  # two ranks per host
        (8, 4, "a:3,b:1", "2"),  # the fullest host counts
        (8, 2, "a,b", "8"),  # a bare host is one slot
        (8, 1, "localhost:4", "8"),  # one rank, however many slots
        (8, 3, "a:2,b:2", "4"),  # a gets 2, b 1
        (8, 8, "a:2,b:2", "2"),  # more ranks than slots: round again, 4 per host
    ],
)
def test_launch_environ_threads(
    monkeypatch: pytest.MonkeyPatch, cores: int, np: int, hosts: str | None, threads: str
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    env = launcher.launch_environ(np, hosts, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": threads}


def test_launch_environ_unknown_core_count_means_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert launcher.launch_environ(2, None, {})["OMP_NUM_THREADS"] == "1"


def test_launch_environ_keeps_the_users_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    environ = {"OMP_NUM_THREADS": "3", "COMMLAYER_CYCLE_TIME": "2"}
    env = launcher.launch_environ(4, None, environ)
    assert env == {"OMP_NUM_THREADS": "3", "COMMLAYER_CYCLE_TIME": "2"}
    assert env is not environ


def test_launch_environ_does_not_change_its_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    environ = {"PATH": "/bin"}
    launcher.launch_environ(4, None, environ)
    assert environ == {"PATH": "/bin"}


@pytest.mark.parametrize("hosts", ["a:x", "a:2,b:", "a:0", "a:-1", "a:2:3"])
def test_launch_environ_bad_hosts_name_the_option(hosts: str) -> None:
    with pytest.raises(ValueError) as caught:
        launcher.launch_environ(2, hosts, {})
    message = str(caught.value)
    assert "-H/--hosts" in message and repr(hosts) in message, message
    assert "host1:N,host2:M" in message, message


# flavor, find_mpiexec -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version_text", "expected"),
    [
        (OPEN_MPI_VERSION, "openmpi"),
        (OPENRTE_VERSION, "openmpi"),
        (HYDRA_VERSION, "mpich"),
        (INTEL_VERSION, "mpich"),
        ("mpiexec from some other MPI 1.0", "unknown"),
        ("", "unknown"),
    ],
)
def test_flavor_from_version_text(tmp_path: Path, version_text: str, expected: str) -> None:
    assert launcher.flavor(fake_launcher(tmp_path, version_text)) == expected


def test_flavor_reads_stderr_too(tmp_path: Path) -> None:
    assert launcher.flavor(fake_launcher(tmp_path, OPEN_MPI_VERSION, stderr=True)) == "openmpi"


def test_flavor_of_a_launcher_that_cannot_run(tmp_path: Path) -> None:
    assert launcher.flavor(str(tmp_path / "missing")) == "unknown"
    not_executable = tmp_path / "mpiexec"
    not_executable.write_text("#!/bin/sh\necho HYDRA\n")
    assert launcher.flavor(str(not_executable)) == "unknown"


def test_flavor_of_a_launcher_that_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(cmd: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(cmd, 20)

    monkeypatch.setattr(subprocess, "run", hang)
    assert launcher.flavor("/m/mpiexec") == "unknown"


@pytest.fixture
def python_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake interpreter's directory, and a PATH of one empty directory."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    (tmp_path / "path").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    return bin_dir


def test_find_mpiexec_prefers_the_one_beside_python(python_dir: Path, tmp_path: Path) -> None:
    fake_launcher(tmp_path / "path", HYDRA_VERSION)
    fake_launcher(python_dir, HYDRA_VERSION, name="mpirun")
    assert launcher.find_mpiexec() == str(python_dir / "mpirun")
    fake_launcher(python_dir, HYDRA_VERSION, name="mpiexec")
    assert launcher.find_mpiexec() == str(python_dir / "mpiexec")


def test_find_mpiexec_on_path(python_dir: Path, tmp_path: Path) -> None:
    (python_dir / "mpiexec").write_text("not executable")
    fake_launcher(tmp_path / "path", OPEN_MPI_VERSION, name="mpirun")
    assert launcher.find_mpiexec() == str(tmp_path / "path" / "mpirun")
    fake_launcher(tmp_path / "path", OPEN_MPI_VERSION, name="mpiexec")
    assert launcher.find_mpiexec() == str(tmp_path / "path" / "mpiexec")


def test_find_mpiexec_none(python_dir: Path) -> None:
    assert launcher.find_mpiexec() is None


# check_build --------------------------------------------------------------------------------


def _lines(report: str) -> dict[str, str]:
    first, *rest = report.splitlines()
    assert first == f"commlayer {commlayer.__version__}"
    return dict(line.split(": ", 1) for line in rest)


def test_check_build_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    mpiexec = fake_launcher(tmp_path / "bin", OPEN_MPI_VERSION)
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: mpiexec)
    # MPI is left out: importing mpi4py.MPI would initialize MPI in this process. The real MPI
    # line is checked by tests/system/test_launcher_demo.py through `commlayerrun --check-build`.
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvcc there
    lines = _lines(launcher.check_build())
    assert list(lines) == [
        "launcher", "MPI", "torch", "numpy", "numba", "cupy", "CUDA", "nvcc"
    ]  # fmt: skip
    assert lines["launcher"] == f"{mpiexec} (openmpi)"
    assert lines["MPI"].startswith("not available ("), lines["MPI"]
    assert lines["torch"] == torch.__version__
    assert lines["numpy"] == pytest.importorskip("numpy").__version__
    assert lines["cupy"] == "not installed"
    cuda = torch.version.cuda or "none"
    assert lines["CUDA"] == f"torch built with {cuda}, available: {torch.cuda.is_available()}"
    assert lines["nvcc"] == "not found"


def test_check_build_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: None)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert _lines(launcher.check_build())["launcher"] == "none"


# main ---------------------------------------------------------------------------------------


class Calls:
    """Stands in for subprocess.call: records (command, env) and returns ``returncode``."""

    def __init__(self, returncode: int = 0) -> None:
        self.returncode = returncode
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, cmd: Sequence[str], env: dict[str, str]) -> int:
        self.calls.append((list(cmd), dict(env)))
        return self.returncode


@pytest.fixture
def hydra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fake MPICH launcher as the one found, a clean COMMLAYER_* environment, 8 cores."""
    mpiexec = fake_launcher(tmp_path / "bin", HYDRA_VERSION)
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: mpiexec)
    for name in list(os.environ):
        if name.startswith("COMMLAYER_"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    return mpiexec


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    recorder = Calls(returncode=3)
    monkeypatch.setattr(subprocess, "call", recorder)
    return recorder


def test_main_runs_the_command(hydra: str, calls: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMLAYER_CYCLE_TIME", "2")
    assert launcher.main(["-np", "2", *COMMAND]) == 3  # mpiexec's exit code
    [(cmd, env)] = calls.calls
    assert cmd == [hydra, "-n", "2", "-genvlist", "COMMLAYER_CYCLE_TIME,OMP_NUM_THREADS", *COMMAND]
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["COMMLAYER_CYCLE_TIME"] == "2"
    assert env["PATH"] == os.environ["PATH"]


def test_main_strips_a_double_dash(hydra: str, calls: Calls) -> None:
    """'commlayerrun -np 2 -- python train.py': Hydra refuses a '--' before the program."""
    assert launcher.main(["-np", "2", "--", *COMMAND]) == 3
    [(cmd, _)] = calls.calls
    assert cmd == [hydra, "-n", "2", "-genvlist", "OMP_NUM_THREADS", *COMMAND]


def test_main_dry_run_prints_the_command(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["python", "-c", "print('two words')"]
    assert launcher.main(["-np", "3", "-H", "a:2,b:1", "--dry-run", *command]) == 0
    printed = capsys.readouterr().out.strip()
    assert shlex.split(printed) == [
        hydra, "-n", "3", "-hosts", "a:2,b:1", "-genvlist", "OMP_NUM_THREADS", *command
    ]  # fmt: skip
    assert calls.calls == []


def test_main_without_mpi_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: None)
    assert launcher.main(["-np", "2", *COMMAND]) == 127
    err = capsys.readouterr().err
    assert "no MPI launcher (mpiexec or mpirun) was found" in err, err
    assert "pip install mpi4py mpich" in err, err
    assert calls.calls == []


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("COMMLAYER_CYCLE_TIME", "-1", "COMMLAYER_CYCLE_TIME='-1' is not valid: expected a finite"),
        ("COMMLAYER_FUSION_THRESHOLD", "lots", "COMMLAYER_FUSION_THRESHOLD='lots' is not valid"),
        ("COMMLAYER_BOGUS", "1", "unknown environment variable(s) 'COMMLAYER_BOGUS'"),
    ],
)
def test_main_refuses_a_bad_variable_before_launching(
    hydra: str,
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    expected: str,
) -> None:
    monkeypatch.setenv(variable, value)
    assert launcher.main(["-np", "2", *COMMAND]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commlayerrun: ") and expected in err, err
    assert calls.calls == []


def test_main_refuses_bad_hosts_before_launching(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launcher.main(["-np", "2", "-H", "a:two", *COMMAND]) == 2
    assert "commlayerrun: -H/--hosts 'a:two'" in capsys.readouterr().err
    assert calls.calls == []


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(COMMAND, id="no -np"),
        pytest.param(["-np", "0", *COMMAND], id="-np 0"),
        pytest.param(["-np", "-2", *COMMAND], id="-np -2"),
        pytest.param(["-np", "2"], id="no command"),
        pytest.param(["-np", "2", "--"], id="only --"),
        pytest.param(["-np", "2", "--dry-run"], id="dry run without command"),
    ],
)
def test_main_usage_errors(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        launcher.main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: commlayerrun"), err
    assert "give -np N (N >= 1) and a command" in err, err
    assert calls.calls == []


def test_main_hosts_and_hostfile_exclude_each_other(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        launcher.main(["-np", "2", "-H", "a:2", "--hostfile", "h", *COMMAND])
    assert caught.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert calls.calls == []


def test_main_check_build(
    monkeypatch: pytest.MonkeyPatch, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "check_build", lambda: "the build report")
    assert launcher.main(["--check-build"]) == 0
    assert capsys.readouterr().out == "the build report\n"
    assert calls.calls == []


def test_build_command_prefix_output() -> None:
    """Each launcher's own option puts the rank before each line; an unknown launcher gets
    none (its options are not known)."""
    mpich = launcher.build_command(
        "/m/mpiexec", "mpich", 2, None, None, COMMAND, {}, None, (), True
    )
    # hydra prefixes each write: the ranks' commlayer.init() makes output line-buffered
    prefix = ["-prepend-rank", "-genv", "COMMLAYER_LINE_OUTPUT", "on"]
    assert mpich == ["/m/mpiexec", "-n", "2", *prefix, *COMMAND]
    ompi = launcher.build_command(
        "/o/mpirun", "openmpi", 2, None, None, COMMAND, {}, None, (), True
    )
    assert "--tag-output" in ompi and ompi[-len(COMMAND) :] == COMMAND
    unknown = launcher.build_command(
        "/u/mpiexec", "unknown", 2, None, None, COMMAND, {}, None, (), True
    )
    assert "-prepend-rank" not in unknown and "--tag-output" not in unknown
    plain = launcher.build_command("/m/mpiexec", "mpich", 2, None, None, COMMAND, {})
    assert "-prepend-rank" not in plain


class _Out:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("asked", "tty", "expected"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_prefix_output_on_a_terminal_unless_asked(
    asked: bool | None, tty: bool, expected: bool
) -> None:
    assert launcher.prefix_output(asked, _Out(tty)) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "tty", "prefixed"),
    [
        ([], True, True),
        ([], False, False),
        (["--no-prefix-output"], True, False),
        (["--prefix-output"], False, True),
    ],
)
def test_main_prefixes_output_on_a_terminal(
    hydra: str,
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    tty: bool,
    prefixed: bool,
) -> None:
    monkeypatch.setattr(sys, "stdout", _Out(tty))
    assert launcher.main([*options, "-np", "2", *COMMAND]) == 3
    [(cmd, _)] = calls.calls
    assert ("-prepend-rank" in cmd) is prefixed, cmd


def test_prefix_options_exclude_each_other(hydra: str, calls: Calls) -> None:
    with pytest.raises(SystemExit):
        launcher.main(["--prefix-output", "--no-prefix-output", "-np", "2", *COMMAND])
    assert calls.calls == []


SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_NTASKS": "8",
    "SLURM_CPUS_PER_TASK": "3",
    "SLURM_JOB_NODELIST": "node[1-2]",
}


def test_slurm_allocation_from_the_environment() -> None:
    found = config.slurm_allocation(SLURM)
    assert found == config.SlurmAllocation(8, 3, "node[1-2]")
    assert config.slurm_allocation({**SLURM, "SLURM_CPUS_PER_TASK": ""}).cpus_per_task == 0  # type: ignore[union-attr]
    assert config.slurm_allocation({"SLURM_NTASKS": "8"}) is None  # no job: not inside one
    assert config.slurm_allocation({"SLURM_JOB_ID": "42"}) is None  # tasks unknown
    assert config.slurm_allocation({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "x"}) is None


def test_main_in_a_slurm_allocation_takes_its_tasks_and_cores(
    hydra: str, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert launcher.main(COMMAND) == 3  # no -np
    [(cmd, env)] = calls.calls
    assert cmd[:3] == [hydra, "-n", "8"], cmd
    assert env["OMP_NUM_THREADS"] == "3"  # the task's cores, not this node's cores / 8


def test_main_in_a_slurm_allocation_keeps_what_is_given(
    hydra: str, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launcher.main(["-np", "2", *COMMAND]) == 3
    [(cmd, env)] = calls.calls
    assert cmd[:3] == [hydra, "-n", "2"] and env["OMP_NUM_THREADS"] == "1"


def test_main_without_np_outside_slurm_is_refused(
    hydra: str, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit):
        launcher.main(COMMAND)
    assert calls.calls == []


# host lists (commlayer/launch/hosts.py) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("a:2,b", 1, {"a": 2, "b": 1}),
        ("a:2\nb\n# c:9\n\na:1", 4, {"a": 3, "b": 4}),  # a host named twice: its slots summed
        (
            "# hosts\nnode2 slots=2\n\n  node1:2  # first\nnode3 slots=1 max_slots=8",
            1,
            {"node2": 2, "node1": 2, "node3": 1},
        ),
        ("localhost:4096", 1, {"localhost": 4096}),
        ("", 1, {}),  # a discovery script that found nothing
        ("  \n# none up\n", 1, {}),
    ],
)
def test_host_list(text: str, default: int, expected: dict[str, int]) -> None:
    found = hostlist.parse(text, "-H", default)
    assert found == expected and list(found) == list(expected)  # in order


@pytest.mark.parametrize(
    ("text", "entry", "why"),
    [
        ("localhost:\u00b2", "localhost:\u00b2", "not an integer"),  # str.isdigit() says yes
        ("localhost:99999999999999999999", "localhost:99999999999999999999", "1..4096"),
        ("a:4097", "a:4097", "1..4096"),
        ("a:0", "a:0", "1..4096"),
        ("a:-1", "a:-1", "not an integer"),
        ("a: 2", "a: 2", "slots '' is not an integer"),
        (":2", ":2", "no host name"),
        ("a:1,,b:1", "a:1,,b:1", "an empty entry"),
        ("a:1,", "a:1,", "an empty entry"),
        ("a:2:3", "a:2:3", "not an integer"),
        ("a b", "a b", "unexpected 'b'"),
        ("a:2 slots=3", "a:2 slots=3", "unexpected 'slots=3'"),
        ("h\u00f4te:1", "h\u00f4te:1", "ASCII letters"),
    ],
)
def test_host_list_bad_entry_is_named(text: str, entry: str, why: str) -> None:
    with pytest.raises(ValueError) as caught:
        hostlist.parse(text, "-H/--hosts 'x'")
    message = str(caught.value)
    assert message.startswith(f"-H/--hosts 'x': bad entry {entry!r}"), message
    assert why in message and "slots 1..4096" in message, message


def test_driver_parses_hosts_with_the_same_parser() -> None:
    from commlayer.launch import driver

    assert driver.parse_hosts("a:2\nb", 3) == {"a": 2, "b": 3}
    assert driver.parse_hosts("") == {}
    with pytest.raises(ValueError, match="bad entry 'localhost:99999999999999999999'"):
        driver.parse_hosts("localhost:99999999999999999999", what="discovery")


@pytest.mark.parametrize("hosts", ["localhost:\u00b2", ":2", "a:1,,b:1", "localhost:" + "9" * 20])
def test_main_refuses_bad_hosts_in_one_line(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str], hosts: str
) -> None:
    assert launcher.main(["-np", "2", "-H", hosts, *COMMAND]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"commlayerrun: -H/--hosts {hosts!r}: bad entry"), err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert calls.calls == []


def test_main_refuses_a_bad_hostfile(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n:4\n")
    assert launcher.main(["-np", "2", "--hostfile", str(hostfile), *COMMAND]) == 2
    assert f"--hostfile {hostfile}: bad entry ':4'" in capsys.readouterr().err
    assert calls.calls == []


def test_main_warns_once_on_more_ranks_than_slots(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launcher.main(["-np", "4", "-H", "localhost:2", *COMMAND]) == 3
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "commlayerrun: warning: -np 4 is more than the 2 slot(s) of -H/--hosts 'localhost:2': "
        "the hosts get more ranks than slots (oversubscribed: slower, and more memory a host)"
    ]
    assert len(calls.calls) == 1  # a warning, the job runs
    assert launcher.main(["-np", "2", "-H", "localhost:2", *COMMAND]) == 3
    assert "warning" not in capsys.readouterr().err


def test_main_names_a_host_that_does_not_resolve_before_launching(
    hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up = []

    def getaddrinfo(name: str, *_: object) -> list[object]:
        looked_up.append(name)
        if name == "nosuchhost":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return []

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert launcher.main(["-np", "3", "-H", "localhost:1,nosuchhost:2", *COMMAND]) == 2
    err = capsys.readouterr().err
    assert err == (
        "commlayerrun: host 'nosuchhost' of -H/--hosts 'localhost:1,nosuchhost:2' cannot be "
        "resolved (Name or service not known): no rank can start there; check the name, or the "
        "hosts file/DNS of this machine\n"
    )
    assert looked_up == ["localhost", "nosuchhost"] and calls.calls == []


def test_an_abnormal_end_removes_the_jobs_mpich_files_only(
    hydra: str,
    calls: Calls,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(mpich_shm, "SHM_DIR", shm)
    in_use, other = shm / "mpich_shm_live", shm / "other_file"
    for path in (in_use, other):
        path.write_bytes(b"x" * 4096)

    def job(cmd: Sequence[str], env: dict[str, str]) -> int:
        (shm / "mpich_shm_left").write_bytes(b"x" * 8192)  # a killed rank's
        return 9

    monkeypatch.setattr(subprocess, "call", job)
    with in_use.open("r+b") as held, mmap.mmap(held.fileno(), 4096):  # another job's, mapped
        assert launcher.main(["-np", "2", *COMMAND]) == 9
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_live", "other_file"]
    assert capsys.readouterr().err == (
        f"commlayerrun: the job ended with 9; removed 1 shared-memory file(s) (0.0 MB) its ranks "
        f"left in {shm}\n"
    )
    # a job ending well leaves the files alone (MPI_Finalize removed its own)
    (shm / "mpich_shm_old").write_bytes(b"")
    calls.returncode = 0
    monkeypatch.setattr(subprocess, "call", calls)
    assert launcher.main(["-np", "2", *COMMAND]) == 0
    assert (shm / "mpich_shm_old").exists()


def test_leftovers_older_than_the_job_stay(tmp_path: Path) -> None:
    (tmp_path / "mpich_shm_before").write_bytes(b"")
    assert mpich_shm.remove_leftovers(time.time() + 60, tmp_path) == (0, 0)
    assert (tmp_path / "mpich_shm_before").exists()
