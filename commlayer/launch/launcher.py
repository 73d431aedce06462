"""commlayerrun: launch a training script on N processes through the available mpiexec.

    commlayerrun -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--launcher-exec PATH]
                 [--prefix-output | --no-prefix-output] python ...
    commlayerrun --check-build

Wraps MPICH's (the ``mpich`` wheel's, or a system one) or Open MPI's launcher, passes every
COMMLAYER_* variable to all ranks, and sets defaults that suit small or oversubscribed machines:
one OpenMP thread per rank when there are more ranks than cores (torch would start one thread
per core in every rank), no core binding, and Open MPI's yield-when-idle.

Hosts of the namespace cluster of ``scripts/cluster.sh`` (node1, node2, ...: their state is in
CLUSTER_DIR) are recognised: mpiexec then starts on the first host of the job, as on a cluster's
login node, and enters the others through the cluster's launcher in place of ssh, with the
environment the cluster's MPI needs (its ``mpi.env``: TCP between hosts, shared memory within).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from commlayer import backends
from commlayer.common import config
from commlayer.core.registries import REGISTRIES
from commlayer.launch import hosts as hostlist
from commlayer.launch import mpich_shm

# Written by scripts/cluster.sh up, removed by its down.
CLUSTER_DIR = Path("/run/commlayer-cluster")

_NO_MPI = (
    "commlayerrun: no MPI launcher (mpiexec or mpirun) was found. Install one, e.g.\n"
    "  pip install mpi4py mpich            # MPICH from PyPI, no system packages\n"
    "or a system MPI (apt install openmpi-bin libopenmpi-dev; then pip install mpi4py)."
)


def find_mpiexec() -> str | None:
    """The launcher next to this Python (the mpich wheel's) first, then PATH."""
    beside = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        candidate = beside / name
        if candidate.exists() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def flavor(mpiexec: str) -> str:
    """'openmpi', 'mpich' (Hydra) or 'unknown', from the launcher's --version."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def build_command(
    mpiexec: str,
    kind: str,
    np: int,
    hosts: str | None,
    hostfile: str | None,
    command: Sequence[str],
    environ: dict[str, str],
    launcher_exec: str | None = None,
    passed: Sequence[str] = (),
    prefix_output: bool = False,
) -> list[str]:
    """The full launcher command line for ``command`` on ``np`` ranks. ``launcher_exec``: the
    program that starts the launcher's daemon on another host in place of ssh, called as ssh
    is (``PATH [options] HOST COMMAND``). ``passed``: more variables of ``environ`` to pass to
    every rank beside COMMLAYER_* and OMP_NUM_THREADS. ``prefix_output``: each line the ranks
    print starts with the rank that printed it (Hydra's ``[1] ``, Open MPI's ``[1,1]<stdout>:``)."""
    ours = (k for k in environ if k.startswith("COMMLAYER_") or k == "OMP_NUM_THREADS")
    names = sorted({*ours, *(k for k in passed if k in environ)})
    if kind == "openmpi":
        cmd = [mpiexec, "-np", str(np), "--bind-to", "none", "--oversubscribe"]
        cmd += ["--tag-output"] if prefix_output else []
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
        cmd += ["--mca", "plm_rsh_agent", launcher_exec] if launcher_exec else []
        cmd += ["-H", hosts] if hosts else []
        cmd += ["--hostfile", hostfile] if hostfile else []
        for name in names:
            cmd += ["-x", name]
    else:
        cmd = [mpiexec, "-n", str(np)]
        if prefix_output and kind == "mpich":
            # Hydra prefixes each write, not each line: commlayer.init() makes the ranks'
            # output line-buffered (COMMLAYER_LINE_OUTPUT), so a print is one write
            cmd += ["-prepend-rank", "-genv", "COMMLAYER_LINE_OUTPUT", "on"]
        cmd += ["-launcher", "ssh", "-launcher-exec", launcher_exec] if launcher_exec else []
        cmd += ["-hosts", hosts] if hosts else []
        cmd += ["-f", hostfile] if hostfile else []
        if names:
            cmd += ["-genvlist", ",".join(names)]
    return cmd + list(command)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The namespace cluster a job's hosts belong to (scripts/cluster.sh)."""

    launch: str  # hydra's launcher-exec: enters a host, as ssh would log in
    environ: dict[str, str]  # what MPI needs there (mpi.env)
    first_host: str  # where mpiexec runs


def cluster_of(names: Sequence[str], state: Path | None = None) -> Cluster | None:
    """The cluster that is up when every host named is one of its hosts; None when no cluster
    is up or no name looks like one of its hosts (nodeK): real machines; ValueError else (a
    mix, or a host the cluster does not have)."""
    state = CLUSTER_DIR if state is None else state
    if not names or not (state / "launch").exists():
        return None
    alike = [name for name in names if re.fullmatch(r"node[0-9]+", name)]
    up = [name for name in alike if (state / name).is_dir()]
    if not alike:
        return None
    if len(up) != len(names):
        others = sorted(set(names) - set(up))
        raise ValueError(
            f"{', '.join(others)}: not hosts of the cluster that is up (bash scripts/cluster.sh "
            "status); a job runs on the cluster's hosts only, or on none of them"
        )
    environ = {}
    for line in (state / "mpi.env").read_text().splitlines():
        key, equals, value = line.partition("=")
        if equals and not line.startswith("#"):
            environ[key.strip()] = value.strip()
    return Cluster(str(state / "launch"), environ, names[0])


def hosts_of(hosts: str | None, hostfile: str | None) -> dict[str, int]:
    """``{host: slots}`` of ``-H host1:2,host2`` or of a hostfile (``host[:N]`` or
    ``host slots=N`` lines, '#' comments), in order (launch/hosts.py: ValueError naming the bad
    entry); {} with neither."""
    if hosts:
        return hostlist.parse(hosts, f"-H/--hosts {hosts!r}")
    if hostfile:
        return hostlist.parse(Path(hostfile).read_text(), f"--hostfile {hostfile}")
    return {}


def host_names(hosts: str | None, hostfile: str | None) -> list[str]:
    """The hosts of ``-H`` or of a hostfile, in order (``hosts_of``)."""
    return list(hosts_of(hosts, hostfile))


def on_cluster(cluster: Cluster, cmd: Sequence[str]) -> list[str]:
    """``cmd`` (mpiexec's) run on the cluster's first host through its launcher, which takes
    one shell command as ssh does."""
    return [cluster.launch, cluster.first_host, shlex.join(cmd)]


def launch_environ(np: int, hosts: str | None, environ: dict[str, str]) -> dict[str, str]:
    """Environment for the ranks: one OpenMP thread per rank when the local machine would
    otherwise be oversubscribed (unless OMP_NUM_THREADS is set)."""
    env = dict(environ)
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // _local_ranks(np, hosts))))
    return env


def _local_ranks(np: int, hosts: str | None) -> int:
    """Most ranks one host gets. The launchers fill each host's slots in turn and go round again
    when np exceeds them all, so: the largest slot count times the rounds, at most np
    (``-np 1 -H localhost:2`` runs one rank, which should get every core)."""
    if not hosts:
        return max(np, 1)
    slots = list(hosts_of(hosts, None).values())
    rounds = -(-np // sum(slots))
    return max(1, min(np, rounds * max(slots)))


def check_build() -> str:
    """What commlayer can use on this machine, one line each."""
    lines = [f"commlayer {importlib.import_module('commlayer').__version__}"]
    mpiexec = find_mpiexec()
    lines.append(f"launcher: {mpiexec} ({flavor(mpiexec)})" if mpiexec else "launcher: none")
    try:
        from mpi4py import MPI

        from commlayer.backends.mpi import library_version

        mpi4py = importlib.import_module("mpi4py")
        library = library_version()
        standard = ".".join(map(str, MPI.Get_version()))  # (4, 0) -> 4.0
        lines.append(f"MPI: {library} (mpi4py {mpi4py.__version__}, MPI {standard})")
    except ImportError as exc:
        lines.append(f"MPI: not available ({exc})")
    for module in ("torch", "numpy", "numba", "cupy"):
        try:
            lines.append(f"{module}: {importlib.import_module(module).__version__}")
        except ImportError:
            lines.append(f"{module}: not installed")
    try:
        import torch

        cuda = torch.version.cuda or "none"
        lines.append(f"CUDA: torch built with {cuda}, available: {torch.cuda.is_available()}")
    except ImportError:
        pass
    nvcc = shutil.which("nvcc")
    lines.append(f"nvcc: {nvcc or 'not found'}")
    return "\n".join(lines)


# horovodrun's --log-level spellings -> COMMLAYER_LOG_LEVEL's (and Python logging's) names
_LOG_LEVELS = {
    "TRACE": "trace",
    "DEBUG": "debug",
    "INFO": "info",
    "WARNING": "warning",
    "ERROR": "error",
    "FATAL": "error",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commlayerrun",
        description="Launch a commlayer training script on N processes (wraps mpiexec).",
    )
    parser.add_argument(
        "-np",
        "-n",
        "--num-proc",
        dest="np",
        type=int,
        help="number of ranks (inside a Slurm allocation: its tasks, SLURM_NTASKS, by default)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="host1:slots,host2:slots")
    where.add_argument("--hostfile", help="file with one 'host slots=N' (or host:N) per line")
    parser.add_argument(
        "--launcher-exec",
        metavar="PATH",
        help="start the MPI daemons on other hosts with PATH in place of ssh (called as ssh is: "
        "PATH HOST COMMAND); scripts/cluster.sh's hosts get the cluster's own",
    )
    prefix = parser.add_mutually_exclusive_group()
    prefix.add_argument(
        "--prefix-output",
        dest="prefix_output",
        action="store_const",
        const=True,
        help="start each line the ranks print with its rank ([1] ...); the default when "
        "commlayerrun's output is a terminal",
    )
    prefix.add_argument(
        "--no-prefix-output",
        dest="prefix_output",
        action="store_const",
        const=False,
        help="leave the ranks' lines as they print them; the default when the output goes to a "
        "file or a pipe (a program reading it)",
    )
    elastic = parser.add_argument_group(
        "elastic training (Horovod's flags; any of --min-np, --max-np, --host-discovery-script "
        "runs commlayer's elastic driver instead of mpiexec: commlayer/launch/driver.py)"
    )
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=int,
        help="fewest workers to train with (default -np)",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        help="most workers to start (default: every slot of -H, no limit with a discovery "
        "script, as horovodrun)",
    )
    elastic.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="prints the available hosts, one host:slots a line; run every second",
    )
    elastic.add_argument(
        "--slots",
        "--slots-per-host",
        dest="slots",
        type=int,
        default=1,
        help="slots of a host the script names without a count",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        metavar="SECS",
        help="how long fewer than --min-np workers may last before the job fails (default 600)",
    )
    elastic.add_argument(
        "--reset-limit", type=int, help="most times the world may re-form (default: no limit)"
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=float,
        nargs=2,
        metavar=("LO", "HI"),
        help="a blacklisted host comes back after LO * 2**failures + U(0, 1) * LO seconds, "
        "clamped to [LO, HI], as Horovod's (default: never)",
    )
    elastic.add_argument(
        "--blacklist-scope",
        choices=("host", "slot"),
        default="host",
        help="what a failed worker blacklists: its whole host, as Horovod (default), or only "
        "its slot (the other workers of that host stay: for one machine with several slots)",
    )
    elastic.add_argument(
        "--on-state-lost",
        choices=("fail", "reset"),
        default="fail",
        help="a new world with no worker of the last one (every holder of the last commit "
        "gone): fail the job (default), or form it and run the state's reset callbacks before "
        "the sync (restore from your own checkpoint there)",
    )
    elastic.add_argument(
        "--driver-address",
        metavar="ADDR",
        help="where the elastic driver listens for its workers (default: loopback when every "
        "host is this machine, else this machine's address that routes to the hosts; 0.0.0.0: "
        "all of its addresses)",
    )
    elastic.add_argument(
        "--log-level",
        type=str.upper,
        choices=tuple(_LOG_LEVELS),
        help="the driver's log level, and the workers' (COMMLAYER_LOG_LEVEL) unless set; "
        "horovodrun's spellings",
    )
    elastic.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        metavar="SECS",
        help="a worker silent this long (its host's link down, or frozen) is stopped and the "
        "others go on without it (default 10)",
    )
    parser.add_argument("--check-build", action="store_true", help="print what is available")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def prefix_output(asked: bool | None, stdout: IO[str]) -> bool:
    """Whether the ranks' lines get their rank in front: as asked (--prefix-output,
    --no-prefix-output), else when commlayerrun prints to a terminal, where a person reads
    several ranks' lines mixed, as torchrun and horovodrun prefix them. Output going to a file
    or a pipe stays as the ranks print it, for the programs that read it."""
    if asked is not None:
        return asked
    try:
        return stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _plan(
    args: argparse.Namespace, command: Sequence[str], mpiexec: str
) -> tuple[list[str], dict[str, str], list[str]]:
    """(the command to run, its environment, the command as --dry-run shows it: with the
    cluster's variables in front, so that it can be pasted into a shell)."""
    cluster = cluster_of(host_names(args.hosts, args.hostfile))
    hosts = args.hosts
    if cluster is not None:
        _local_ranks(args.np, hosts)  # only to refuse a bad -H, as on real machines
        hosts = None  # the cluster's hosts share this machine's cores: every rank is local
    environ = config.launcher_environ(REGISTRIES)
    slurm = config.slurm_allocation(environ)
    if slurm is not None and slurm.cpus_per_task and "OMP_NUM_THREADS" not in environ:
        # the cores Slurm gave each task, not this node's cores shared by every rank of the job
        environ["OMP_NUM_THREADS"] = str(slurm.cpus_per_task)
    env = launch_environ(args.np, hosts, environ)
    kind = flavor(mpiexec)
    where = (args.np, args.hosts, args.hostfile, command)
    prefix = prefix_output(args.prefix_output, sys.stdout)
    if cluster is None:
        cmd = build_command(mpiexec, kind, *where, env, args.launcher_exec, prefix_output=prefix)
        return cmd, env, cmd
    if kind == "openmpi":
        raise ValueError(
            f"the cluster's launcher serves MPICH's hydra, and {mpiexec} is Open MPI's: "
            "pip install mpich (commlayerrun uses the mpiexec beside python first)"
        )
    env = {**cluster.environ, **env}  # the user's own settings win
    mpi = build_command(
        mpiexec, kind, *where, env, args.launcher_exec, list(cluster.environ), prefix
    )
    cmd = on_cluster(cluster, mpi)
    return cmd, env, [f"{name}={env[name]}" for name in cluster.environ] + cmd


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.check_build:
        print(check_build())
        return 0
    # argparse keeps the '--' of 'commlayerrun -np 2 -- python train.py'; Hydra's mpiexec
    # rejects it ("unrecognized argument").
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    slurm = config.slurm_allocation()
    if args.np is None and slurm is not None and not (args.hosts or args.hostfile):
        # Inside an allocation: its tasks; MPICH's launcher reads the nodes from Slurm and
        # starts the ranks through it (Open MPI's does the same).
        args.np = slurm.tasks
    if not args.np or args.np < 1 or not command:
        _parser().error("give -np N (N >= 1) and a command: commlayerrun -np 2 python train.py")
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        return _elastic(args, command, sys.argv[1:] if argv is None else list(argv))
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print(_NO_MPI, file=sys.stderr)
        return 127
    try:
        cmd, env, shown = _plan(args, command, mpiexec)
        hosts = hosts_of(args.hosts, args.hostfile)
        warning = oversubscribed(args.np, hosts, args.hosts, args.hostfile)
        # hosts entered by --launcher-exec or the cluster's launcher are its names, not DNS's
        if not (args.dry_run or args.launcher_exec) and cluster_of(list(hosts)) is None:
            resolve(hosts, args.hosts, args.hostfile)
    except (ValueError, OSError) as exc:
        print(f"commlayerrun: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(f"commlayerrun: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(shown))  # quoted: it can be pasted into a shell as it is
        return 0
    return run_job(cmd, env)


def run_job(cmd: Sequence[str], env: dict[str, str]) -> int:
    """The launcher's exit code. When it is not 0, a rank was killed or aborted: the MPICH
    shared-memory files its ranks left are removed (commlayer/launch/mpich_shm.py)."""
    began = time.time()
    code = subprocess.call(cmd, env=env)
    if code != 0:
        files, size = mpich_shm.remove_leftovers(began)
        if files:
            print(
                f"commlayerrun: the job ended with {code}; removed {files} shared-memory file(s) "
                f"({size / 1e6:.1f} MB) its ranks left in {mpich_shm.SHM_DIR}",
                file=sys.stderr,
            )
    return code


def _where(hosts: str | None, hostfile: str | None) -> str:
    return f"-H/--hosts {hosts!r}" if hosts else f"--hostfile {hostfile}"


def oversubscribed(
    np: int, slots: dict[str, int], hosts: str | None, hostfile: str | None
) -> str | None:
    """A warning when ``np`` ranks are more than the slots of the hosts given (the launchers
    then place them round the hosts again, more than one rank a slot, without a word)."""
    total = sum(slots.values())
    if not slots or np <= total:
        return None
    return (
        f"-np {np} is more than the {total} slot(s) of {_where(hosts, hostfile)}: the hosts get "
        "more ranks than slots (oversubscribed: slower, and more memory a host)"
    )


def resolve(slots: dict[str, int], hosts: str | None, hostfile: str | None) -> None:
    """ValueError, one line naming the host, for a host name that does not resolve: mpiexec
    would print pages of its own errors about it."""
    for name in slots:
        try:
            socket.getaddrinfo(name, None)
        except (socket.gaierror, UnicodeError) as exc:
            reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
            raise ValueError(
                f"host {name!r} of {_where(hosts, hostfile)} cannot be resolved ({reason}): no "
                "rank can start there; check the name, or the hosts file/DNS of this machine"
            ) from None


def _elastic(args: argparse.Namespace, command: Sequence[str], argv: Sequence[str]) -> int:
    """Run ``command`` under the elastic driver (commlayer/launch/driver.py). On the namespace
    cluster the driver runs on its first host, entered through the cluster's launcher (as
    mpiexec does: the root namespace has no route into the cluster), with the same ``argv``."""
    from commlayer.launch import driver

    try:
        environ = config.launcher_environ(REGISTRIES)
        chosen = config.load(environ=environ).backend
        if chosen != backends.AUTO and not backends.registration(chosen).elastic:
            elastic = [r.name for r in backends.registrations() if r.elastic]
            raise ValueError(
                f"COMMLAYER_BACKEND={chosen}: elastic training runs on the "
                f"{' or '.join(elastic)} backend; {backends.registration(chosen).title} "
                "cannot re-form its world when ranks come and go"
            )
        if args.hostfile:
            raise ValueError("elastic mode takes -H or --host-discovery-script, not --hostfile")
        if args.host_discovery_script:
            discover = driver.discovery_script(args.host_discovery_script, args.slots)
        else:
            fixed = driver.parse_hosts(args.hosts or f"localhost:{args.max_np or args.np}")
            discover = lambda: dict(fixed)  # noqa: E731
        first = discover()
        if not first:
            where = "the host discovery script printed" if args.host_discovery_script else "-H has"
            raise ValueError(f"{where} no hosts: nothing to start workers on")
        min_np = args.min_np if args.min_np is not None else args.np
        # as horovodrun: every slot of -H (Horovod's test_fault_tolerance_without_scaling
        # starts 4 workers with -np 2 on two hosts of 2 slots); any number with a script
        unbounded = 1 << 30 if args.host_discovery_script else max(args.np, sum(first.values()))
        max_np = args.max_np if args.max_np is not None else unbounded
        remote = [h for h in first if not driver.is_local(h)]
        cluster = cluster_of(remote) if remote else None
        inside = (
            cluster is not None and (Path(cluster.launch).parent / socket.gethostname()).is_dir()
        )
        if cluster is not None and not inside and not args.dry_run:
            return _driver_on_cluster(cluster, argv)
        environ = {**(cluster.environ if cluster else {}), **environ}
        environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max_np)))
        if args.log_level:
            level = _LOG_LEVELS[args.log_level]
            environ.setdefault("COMMLAYER_LOG_LEVEL", level)
            logging.basicConfig(format="%(message)s")
            logging.getLogger("commlayer.launch.driver").setLevel(
                5 if level == "trace" else level.upper()
            )
        timeout_s = config.check_timeout_s("--elastic-timeout", args.elastic_timeout)
        heartbeat_s = config.check_timeout_s("--heartbeat-timeout", args.heartbeat_timeout)
        cooldown = tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None
        for seconds in cooldown or ():
            config.check_timeout_s("--blacklist-cooldown-range", seconds, zero_disables=True)
        if cooldown is not None and not cooldown[0] <= cooldown[1]:
            raise ValueError(f"--blacklist-cooldown-range {cooldown}: need 0 <= LO <= HI")
        job = driver.Driver(
            command,
            args.np,
            min_np,
            max_np,
            discover,
            environ,
            elastic_timeout_s=timeout_s,
            reset_limit=args.reset_limit,
            cooldown_s=cooldown,  # type: ignore[arg-type]
            cluster=cluster,
            heartbeat_timeout_s=heartbeat_s,
            blacklist_scope=args.blacklist_scope,
            bind=args.driver_address,
            on_state_lost=args.on_state_lost,
            hosts=first,
        )
    except (ValueError, OSError) as exc:
        print(f"commlayerrun: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(
            f"elastic driver: {shlex.join(command)} on {first}, np {args.np} [{min_np}, {max_np}]"
        )
        return 0
    return job.run()


def _driver_on_cluster(cluster: Cluster, argv: Sequence[str]) -> int:
    """This commlayerrun, run again on the cluster's first host (it becomes the driver: its
    workers there are its children, the other hosts' are entered through the launcher).
    exec: a signal to this process reaches the driver itself."""
    sys.stdout.flush()
    sys.stderr.flush()
    again = f"cd {shlex.quote(os.getcwd())} && exec " + shlex.join(
        [sys.executable, "-m", "commlayer.launch.launcher", *argv]
    )
    os.execv(cluster.launch, [cluster.launch, cluster.first_host, again])
    return 127  # (not reached)


if __name__ == "__main__":
    sys.exit(main())
