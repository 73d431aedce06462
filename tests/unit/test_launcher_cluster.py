"""commlayerrun on the namespace cluster of scripts/cluster.sh, without a cluster: its state
directory is faked in tmp_path (launch, mpi.env, a directory per host) and the MPI launcher is
a fake script, so nothing starts and nothing needs root. The real cluster is exercised by
tests/system/test_cluster.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from commlayer.launch import launcher

HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.1.2"
OPEN_MPI_VERSION = "mpirun (Open MPI) 4.1.2"
MPI_ENV = {"HYDRA_LAUNCHER": "ssh", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}


def fake_mpiexec(directory: Path, version_text: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "mpiexec"
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' {shlex.quote(version_text)}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cluster of node1 and node2 as scripts/cluster.sh up 2 leaves it."""
    state = tmp_path / "commlayer-cluster"
    for host in ("node1", "node2"):
        (state / host).mkdir(parents=True)
    (state / "launch").write_text("#!/bin/sh\n")
    lines = [f"{k}={v}" for k, v in MPI_ENV.items()]
    (state / "mpi.env").write_text("# a comment\n" + "\n".join(lines) + "\n")
    monkeypatch.setattr(launcher, "CLUSTER_DIR", state)
    return state


@pytest.fixture
def hydra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The fake MPICH launcher as the one found, a clean environment, 2 cores."""
    mpiexec = fake_mpiexec(tmp_path / "bin", HYDRA_VERSION)
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: mpiexec)
    for name in list(os.environ):
        if name.startswith(("COMMLAYER_", "UCX_", "HYDRA_")) or name == "OMP_NUM_THREADS":
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    return mpiexec


class Calls:
    """Stands in for subprocess.call: records (command, env)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, cmd: Sequence[str], env: dict[str, str]) -> int:
        self.calls.append((list(cmd), dict(env)))
        return 0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    recorder = Calls()
    monkeypatch.setattr(subprocess, "call", recorder)
    return recorder


# cluster_of, host_names ---------------------------------------------------------------------


def test_cluster_of_its_hosts(state: Path) -> None:
    found = launcher.cluster_of(["node2", "node1"])
    assert found == launcher.Cluster(str(state / "launch"), MPI_ENV, "node2")


@pytest.mark.parametrize("names", [[], ["hostA", "hostB"], ["localhost"]])
def test_other_hosts_are_real_machines(state: Path, names: list[str]) -> None:
    assert launcher.cluster_of(names) is None


def test_no_cluster_up_means_real_machines(tmp_path: Path) -> None:
    """node1 and node2 may be real machines' names: without a cluster up, they are."""
    assert launcher.cluster_of(["node1", "node2"], tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("names", "named"), [(["node1", "hostB"], "hostB"), (["node1", "node3"], "node3")]
)
def test_a_mix_or_a_host_not_up_is_refused(state: Path, names: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}: not hosts of the cluster that is up"):
        launcher.cluster_of(names)


def test_host_names(tmp_path: Path) -> None:
    assert launcher.host_names("node1:2,node2", None) == ["node1", "node2"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# hosts\nnode2 slots=2\n\n  node1:2  # first\n")
    assert launcher.host_names(None, str(hostfile)) == ["node2", "node1"]
    assert launcher.host_names(None, None) == []


# main ---------------------------------------------------------------------------------------


def test_main_runs_mpiexec_on_the_first_host(
    state: Path, hydra: str, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # the user's own setting wins
    assert launcher.main(["-np", "4", "-H", "node1:2,node2:2", "python", "t.py"]) == 0
    [(cmd, env)] = calls.calls
    assert cmd[:2] == [str(state / "launch"), "node1"] and len(cmd) == 3
    passed = "HYDRA_LAUNCHER,OMP_NUM_THREADS,UCX_NET_DEVICES,UCX_TLS"
    mpiexec = [hydra, "-n", "4", "-hosts", "node1:2,node2:2", "-genvlist", passed]
    assert shlex.split(cmd[2]) == [*mpiexec, "python", "t.py"]
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "eth0"
    assert env["OMP_NUM_THREADS"] == "1"  # 4 ranks share the machine's 2 cores


def test_main_dry_run_prints_the_variables_first(
    state: Path, hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node2 slots=1\nnode1 slots=1\n")
    assert launcher.main(["-np", "2", "--hostfile", str(hostfile), "--dry-run", "t"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[:3] == [f"{k}={v}" for k, v in MPI_ENV.items()]
    assert words[3:5] == [str(state / "launch"), "node2"]
    assert shlex.split(words[5])[:5] == [hydra, "-n", "2", "-f", str(hostfile)]
    assert calls.calls == []


def test_main_refuses_a_mix(
    state: Path, hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launcher.main(["-np", "2", "-H", "node1,elsewhere", "t"]) == 2
    assert "commlayerrun: elsewhere: not hosts of the cluster" in capsys.readouterr().err
    assert calls.calls == []


def test_main_refuses_open_mpi_on_the_cluster(
    state: Path,
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    mpirun = fake_mpiexec(tmp_path / "ompi", OPEN_MPI_VERSION)
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: mpirun)
    assert launcher.main(["-np", "2", "-H", "node1,node2", "t"]) == 2
    assert "serves MPICH's hydra" in capsys.readouterr().err
    assert calls.calls == []


def test_launcher_exec_option() -> None:
    hydra = launcher.build_command("/m/mpiexec", "mpich", 2, "a,b", None, ["t"], {}, "/x/in")
    assert hydra == ["/m/mpiexec", "-n", "2", "-launcher", "ssh", "-launcher-exec", "/x/in",
                     "-hosts", "a,b", "t"]  # fmt: skip
    ompi = launcher.build_command("/o/mpirun", "openmpi", 2, "a,b", None, ["t"], {}, "/x/in")
    assert ompi[ompi.index("plm_rsh_agent") - 1 : ompi.index("plm_rsh_agent") + 2] == [
        "--mca", "plm_rsh_agent", "/x/in"
    ]  # fmt: skip


def test_main_passes_launcher_exec(
    tmp_path: Path, hydra: str, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "CLUSTER_DIR", tmp_path / "no-cluster")
    assert launcher.main(["-np", "2", "-H", "a,b", "--launcher-exec", "/x/in", "t"]) == 0
    [(cmd, _)] = calls.calls
    assert cmd[:7] == [hydra, "-n", "2", "-launcher", "ssh", "-launcher-exec", "/x/in"]


def test_main_refuses_bad_slots_on_the_cluster(
    state: Path, hydra: str, calls: Calls, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launcher.main(["-np", "2", "-H", "node1:x,node2", "t"]) == 2
    assert "commlayerrun: -H/--hosts 'node1:x,node2'" in capsys.readouterr().err
    assert calls.calls == []
