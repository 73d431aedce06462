"""commlayer across hosts: the namespace cluster of scripts/cluster.sh (issue 21).

1. ``cluster.sh`` itself: up (twice), status, set, link down/up, exec, shrinking, and down
   removing everything, processes left inside included; bad options refused before anything is
   made.
2. One job of 2 hosts x 2 ranks over 1 Gbit/s links, started as a user starts it
   (``commlayerrun -np 4 -H node1:2,node2:2``), whose worker (scripts/cluster_worker.py)
   reports: the topology commlayer detects (no COMMLAYER_TOPOLOGY), every collective and every
   allreduce algorithm exact across the hosts, DistributedOptimizer equal to training in one
   process, the bytes each host's cable carried (a 16 MiB allreduce must move at least 16 MiB
   each way over it: every element of one host's sum needs the other host's part), and where
   the shared-memory windows are (inside a host, never across).

Needs root and network namespaces: skipped, with the reason, where they are not permitted, or
where a cluster is already up (these tests bring their own up and always take it down).
Job startup is 8-10 s of the file's ~40 s on the loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from waiting import Deadline, wait_until

from commlayer import algorithms
from commlayer.launch import launcher

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "scripts" / "cluster.sh"
STATE = launcher.CLUSTER_DIR
WORKER = Path(__file__).parent / "scripts" / "cluster_worker.py"
HOSTS, PER_HOST = 2, 2
RATE = "1gbit"
# Measured: 25 s on the 2-core machine while other jobs loaded it (load average 4.5); 11
# init()/shutdown() rounds, one per algorithm, with a 16 MiB allreduce each (the same worker
# under torchrun, over gloo: ~20 s, same bound).
JOB_TIMEOUT_S = 100.0
BIG_BYTES = 16 << 20  # cluster_worker.BIG_NUMEL float32
NOISE_BYTES = 64 << 10  # negotiation and hydra's own messages during a measured allreduce


def _why_not_permitted() -> str | None:
    if os.geteuid() != 0:
        return f"needs root for network namespaces, veth links and tc (euid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (iproute2, util-linux)"
    probe = f"cl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if STATE.exists():
        return (
            f"a cluster is already up ({STATE}); these tests bring their own up and down: "
            "run 'bash scripts/cluster.sh down' first"
        )
    return _namespaces_in_use()


def _namespaces_in_use() -> str | None:
    """A cluster another job is bringing up or down has namespaces before (or after) its state
    folder: never start one then (cluster.sh down would remove the other job's hosts)."""
    names = _namespaces()
    taken = sorted(n for n in names if n == "cl-switch" or re.fullmatch(r"node\d+", n))
    return f"network namespaces {taken} exist: another cluster is up" if taken else None


@pytest.fixture(scope="module")
def permitted() -> None:
    reason = _why_not_permitted()
    if reason is not None:
        pytest.skip(reason)


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=60
    )
    if check:
        assert done.returncode == 0, f"cluster.sh {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _runs_inside(namespace: str, argv: list[str]) -> bool:
    """Whether a process of network namespace ``namespace`` runs exactly ``argv``."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in listed.stdout.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if cmdline.read().split(b"\0")[:-1] == [a.encode() for a in argv]:
                    return True
        except OSError:
            continue
    return False


def _root_links() -> set[str]:
    listed = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in listed.stdout.splitlines()}


def _leftovers(namespaces: set[str], links: set[str], etc_netns: bool) -> list[str]:
    """What is there now that was not before ``up``."""
    found = [f"namespace {ns}" for ns in sorted(_namespaces() - namespaces)]
    found += [f"link {link}" for link in sorted(_root_links() - links)]
    found += [str(STATE)] if STATE.exists() else []
    found += ["/etc/netns"] if Path("/etc/netns").exists() and not etc_netns else []
    found += [str(p) for p in Path("/etc/netns").glob("node*")]
    return found


def test_cluster_lifecycle_leaves_nothing_behind(permitted: None) -> None:
    before = (_namespaces(), _root_links(), Path("/etc/netns").exists())
    refused = cluster("up", "2", "--rate", "fast", check=False)
    assert refused.returncode != 0 and "bad rate 'fast'" in refused.stderr, refused
    assert _leftovers(*before) == []
    sleeper: subprocess.Popen[bytes] | None = None
    try:
        cluster("up", "3", "--rate", "100mbit")
        cluster("up", "3", "--rate", "100mbit")  # twice is fine
        assert {"node1", "node2", "node3", "cl-switch"} <= _namespaces()
        assert _root_links() == before[1], "a link appeared in the root namespace"
        for k in (1, 2, 3):
            assert cluster("exec", f"node{k}", "hostname").stdout.strip() == f"node{k}"
        hosts = cluster("exec", "node1", "cat", "/etc/hosts").stdout
        assert "10.213.0.3 node3" in hosts, hosts
        routes = cluster("exec", "node2", "ip", "route").stdout
        assert "default" not in routes and "10.213.0.0/24" in routes, routes
        cluster("set", "node2", "--rate", "200mbit", "--loss", "1%")
        qdiscs = cluster("exec", "node2", "tc", "qdisc", "show", "dev", "eth0").stdout
        assert "rate 200Mbit" in qdiscs, qdiscs
        filters = cluster("exec", "node2", "tc", "filter", "show", "dev", "eth0", "egress").stdout
        assert "bpf" in filters and "direct-action" in filters, filters
        cluster("set", "node2", "--loss", "0%")
        filters = cluster("exec", "node2", "tc", "filter", "show", "dev", "eth0", "egress").stdout
        assert "bpf" not in filters, filters
        cluster("link", "node3", "down")
        # status prints the kernel's operstate, which linkwatch updates after 'ip link set'
        # has returned (a work item): wait for it rather than expect it at once
        wait_until(
            lambda: "node3:eth0 -> switch: DOWN" in cluster("status").stdout,
            10.0,
            "cluster.sh status never showed node3's eth0 DOWN",
            poll_s=0.05,
        )
        cluster("link", "node3", "up")
        status = cluster("status").stdout
        assert "node3  10.213.0.3  hostname node3  link 100mbit" in status, status
        assert "node2  10.213.0.2  hostname node2  link 200mbit delay 0us loss 0%" in status
        cluster("up", "2", "--rate", "100mbit")  # fewer hosts: node3 goes
        assert "node3" not in _namespaces()
        # a process left behind on a host: down ends it
        sleeper = subprocess.Popen(
            ["bash", str(CLUSTER_SH), "exec", "node1", "sleep", "600"], start_new_session=True
        )
        # inside node1 before 'down' (which must end it) runs, not merely started
        wait_until(
            lambda: _runs_inside("node1", ["sleep", "600"]) or sleeper.poll() is not None,
            20.0,
            "'cluster.sh exec node1 sleep 600' never ran inside node1",
            poll_s=0.05,
        )
        assert sleeper.poll() is None, f"'cluster.sh exec' exited {sleeper.returncode}"
    finally:
        down = cluster("down", check=False)
        if sleeper is not None:
            try:
                sleeper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(sleeper.pid, signal.SIGKILL)
                raise
    assert down.returncode == 0, down
    assert sleeper.returncode is not None
    assert _leftovers(*before) == []
    again = cluster("down")
    assert "nothing was up" in again.stdout, again


# -- one job across 2 hosts ----------------------------------------------------------------------


class Job:
    """What the worker's ranks reported, and everything the job printed."""

    def __init__(self, returncode: int, output: str, records: list[dict[str, Any]]) -> None:
        self.returncode, self.output, self.records = returncode, output, records

    def each_rank(self, event: str) -> list[dict[str, Any]]:
        """The ``event`` record of every rank, in rank order."""
        found = sorted((r for r in self.records if r["event"] == event), key=lambda r: r["rank"])
        assert [r["rank"] for r in found] == list(range(HOSTS * PER_HOST)), self.output
        return found


@pytest.fixture(scope="module")
def job(
    permitted: None, harness: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Job]:
    """The cluster up (2 hosts, 1 Gbit/s links), one worker job on it, the cluster down at the
    end whatever happened."""
    out_dir = tmp_path_factory.mktemp("cluster")
    try:
        cluster("up", str(HOSTS), "--rate", RATE)
        yield Job(*run_worker(harness, out_dir, WORKER, [], JOB_TIMEOUT_S))
    finally:
        cluster("down")


def run_worker(
    harness: ModuleType, out_dir: Path, worker: Path, args: list[str], timeout_s: float
) -> tuple[int, str, list[dict[str, Any]]]:
    """``worker`` on the cluster that is up, 2 ranks on each of its hosts, as a user starts it
    (commlayerrun -H); its exit code, everything it printed, and the records its ranks wrote
    under ``out_dir`` (scripts/_worker.py)."""
    env = harness.worker_env(out_dir, timeout_s + 10, {})
    hosts = ",".join(f"node{k}:{PER_HOST}" for k in range(1, HOSTS + 1))
    command = [
        _commlayerrun(), "-np", str(HOSTS * PER_HOST), "-H", hosts,
        sys.executable, str(worker), *args,
    ]  # fmt: skip
    code, stdout, stderr = harness.run_limited(
        command, env, timeout_s, cwd=REPO, dump_stacks_of=str(worker)
    )
    output = f"$ {' '.join(command)}\nexit code {code}\n{stdout}\n--- stderr ---\n{stderr}"
    records = harness._read_records(out_dir)
    return code, output, records


def _commlayerrun() -> str:
    path = Path(sysconfig.get_path("scripts")) / "commlayerrun"
    if not path.exists():
        pytest.fail(f"{path} not found: install commlayer (pip install -e '.[mpich]')")
    return str(path)


@pytest.fixture(params=["commlayerrun", "torchrun"])
def launched(request: pytest.FixtureRequest) -> Job:
    """The worker's job as each launcher started it: commlayerrun (MPI), and torchrun, one
    agent per host (torch.distributed's gloo; below)."""
    return request.getfixturevalue("job" if request.param == "commlayerrun" else "torchrun_job")


def test_job_completes(job: Job) -> None:
    assert job.returncode == 0, job.output
    assert len(job.each_rank("done")) == HOSTS * PER_HOST


def test_topology_is_detected_not_configured(job: Job) -> None:
    for r, record in enumerate(job.each_rank("topology")):
        host, local = divmod(r, PER_HOST)
        assert record["hostname"] == f"node{host + 1}", job.output
        assert record["override"] is None  # no COMMLAYER_TOPOLOGY
        assert record["size"] == HOSTS * PER_HOST
        assert (record["local_rank"], record["local_size"]) == (local, PER_HOST), record
        assert (record["cross_rank"], record["cross_size"]) == (host, HOSTS), record
        assert record["nodes"] == [q // PER_HOST for q in range(HOSTS * PER_HOST)], record
        # ...but one machine: the hosts share its kernel and cores, and the wait policy counts
        # every rank on them (4 on 2 cores: passive)
        assert record["machines"] == [0] * (HOSTS * PER_HOST), record
        assert record["passive"] == (HOSTS * PER_HOST > record["cores"]), record
        assert record["ucx_tls"] == "tcp,self", record  # set by commlayerrun from mpi.env


def test_collectives_exact_across_hosts(launched: Job) -> None:
    for record in launched.each_rank("collectives"):
        wrong = [name for name, ok in record["results"].items() if not ok]
        assert not wrong, f"rank {record['rank']}: {wrong} differ from the reference"
        assert len(record["results"]) == 13, record


def _algorithms(job: Job) -> dict[str, list[dict[str, Any]]]:
    """Every algorithm's records, in rank order."""
    found: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(job.records, key=lambda r: r["rank"]):
        if record["event"] == "algorithm":
            found.setdefault(record["name"], []).append(record)
    assert list(found) == algorithms.available(), job.output
    assert all(len(ranks) == HOSTS * PER_HOST for ranks in found.values()), job.output
    return found


def test_every_allreduce_algorithm_exact_across_hosts(launched: Job) -> None:
    for name, ranks in _algorithms(launched).items():
        assert all(r["exact"] for r in ranks), f"{name}: inexact on some rank: {ranks}"
        expected = "native" if name in ("auto", "shm") else name  # auto: whatever it picked
        ran = {r["ran"] for r in ranks}
        assert len(ran) == 1, f"{name}: ranks ran different algorithms {ran}"
        assert name == "auto" or ran == {expected}, f"{name} ran as {ran}"


def test_allreduce_bytes_cross_the_link(job: Job) -> None:
    """Each host's eth0 sent and received at least the buffer: every element of node2's sum
    needs node1's part (or node1's the sum), whatever the algorithm. Nothing went through lo."""
    for name, ranks in _algorithms(job).items():
        for record in ranks[::PER_HOST]:  # one rank per host: the host's counters
            moved = record["bytes"]
            assert moved["eth0_tx"] >= BIG_BYTES and moved["eth0_rx"] >= BIG_BYTES, (name, moved)
            assert moved["lo_tx"] < NOISE_BYTES, (name, moved)


def test_shared_memory_window_inside_hosts_never_across(job: Job) -> None:
    found = _algorithms(job)
    # shm over all ranks would span the hosts: it runs as the backend's own allreduce
    # (native), with no window.
    for record in found["shm"]:
        assert record["ran"] == "native" and not record["global_window"], record
    # hierarchical: a window per host over that host's ranks; the level across hosts has none.
    for r, record in enumerate(found["hierarchical"]):
        assert not record["global_window"], record
        [level] = record["levels"]
        assert level["node_hosts"] == [f"node{r // PER_HOST + 1}"], record
        assert level["node_window"] and level["node_size"] == PER_HOST, record
        assert level["cross_hosts"] == [f"node{k}" for k in range(1, HOSTS + 1)], record
        assert not level["cross_window"], record
    # only the leg across hosts crossed: half the buffer per local rank each way, where ring
    # (through the hosts in rank order) carries 1.5 buffers
    for record in found["hierarchical"][::PER_HOST]:
        assert record["bytes"]["eth0_tx"] < BIG_BYTES + NOISE_BYTES, record
    for record in found["ring"][::PER_HOST]:
        assert record["bytes"]["eth0_tx"] > 1.4 * BIG_BYTES, record


def test_ranks_of_a_host_talk_through_shared_memory(job: Job) -> None:
    """A 16 MiB allreduce within each host moved nothing over eth0 or lo: MPI's shared memory
    (with UCX_TLS=tcp,self, MPICH's own), not TCP."""
    for record in job.each_rank("intra_host"):
        assert record["exact"], record
        host = record["rank"] // PER_HOST
        assert record["ranks"] == list(range(host * PER_HOST, (host + 1) * PER_HOST)), record
        moved = record["bytes"]
        assert max(moved.values()) < NOISE_BYTES, record


def test_distributed_optimizer_matches_one_process(launched: Job) -> None:
    for record in launched.each_rank("optimizer"):
        assert record["close"] and record["same_on_all_ranks"], record
        assert record["moved"] > 1e-3, record  # the steps did change the parameters


def test_window_buckets_a_window_per_host_and_only_slices_cross(launched: Job) -> None:
    """COMMLAYER_WINDOW_BUCKETS across hosts: the same training as buckets in process memory
    on every rank. Under MPI each host's ranks share a window (2 ranks), every planned bucket
    lives there, and each rank's slices cross to the other host: a step's eth0 sends the
    gradients' bytes once per host (2 ranks x a ring of 2 over half of them), not the flat
    ring's 1.5 times."""
    records = launched.each_rank("window_buckets")
    assert len(records) == HOSTS * PER_HOST, launched.output
    for record in records:
        assert record["close"] and record["same_on_all_ranks"], record
    if launched.each_rank("topology")[0]["backend"] == "TorchBackend":
        for record in records:  # no two-level window over gloo
            assert not record["window"]["across"], record
        return
    for record in records:
        window = record["window"]
        assert (window["window_size"], window["across"]) == (PER_HOST, True), record
        assert window["in_window"] and all(window["in_window"]), record
        assert record["plain"]["window_size"] is None, record
    for record in records[::PER_HOST]:  # one rank a host: the host's counters
        sent = record["window"]["sent_per_step"]  # measured 1.002-1.003 x the gradients
        assert record["grad_bytes"] <= sent < 1.1 * record["grad_bytes"] + NOISE_BYTES, record


def test_commlayerrun_dry_run_on_the_cluster(job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    """commlayerrun prints a command that can be pasted: the cluster's variables, then its
    launcher entering node1, where mpiexec runs."""
    assert launcher.main(["-np", "4", "-H", "node1:2,node2:2", "--dry-run", "python", "t.py"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC={STATE / 'launch'} ")
    assert "UCX_TLS=tcp,self" in printed, printed
    assert f" {STATE / 'launch'} node1 '" in printed, printed
    assert "-hosts node1:2,node2:2" in printed, printed


# Measured: 4 ranks on the 2 cores, 5 epochs, 1 Gbit/s: ~25 s with job startup, 97-99% accuracy
DEMO_EPOCHS = 5
DEMO_TIMEOUT_S = 150.0


def test_demo_trains_across_two_hosts(job: Job, harness: ModuleType) -> None:
    """The demo across the cluster (docs/guides/cluster.md), as a user runs it: 2 ranks on each
    host, the demo's own exit status (non-zero below 95% test accuracy) and its summary."""
    command = [
        _commlayerrun(), "-np", str(HOSTS * PER_HOST),
        "-H", ",".join(f"node{k}:{PER_HOST}" for k in range(1, HOSTS + 1)),
        sys.executable, str(REPO / "examples" / "train_digits.py"), "--epochs", str(DEMO_EPOCHS),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS="60")
    code, stdout, stderr = harness.run_limited(command, env, DEMO_TIMEOUT_S, cwd=REPO)
    output = f"$ {' '.join(command)}\nexit code {code}\n{stdout}\n--- stderr ---\n{stderr}"
    assert code == 0, output
    assert f"commlayer demo: {HOSTS * PER_HOST} ranks" in stdout, output
    accuracies = [float(line.rsplit(" ", 1)[1].rstrip("%")) for line in stdout.splitlines()
                  if line.startswith("epoch ") and "test accuracy" in line]  # fmt: skip
    assert len(accuracies) == DEMO_EPOCHS and accuracies[-1] >= 95.0, output
    assert "communication summary (rank 0)" in stdout, output


# -- the baselines on the same links: torchrun multi-node (DDP's launcher) and Horovod -----------
_BASELINE_WORKER = """
import json, os, socket, sys
import torch

def link_bytes():
    for line in open("/proc/net/dev").read().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            fields = counters.split()
            return int(fields[0]) + int(fields[8])
    return 0

if sys.argv[1] == "torchrun":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    local = (int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    def allreduce(t):
        dist.all_reduce(t)
        return t
else:
    import horovod.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    local = (hvd.local_rank(), hvd.local_size(), hvd.cross_size())
    def allreduce(t):
        return hvd.allreduce(t, op=hvd.Sum, name="baseline")
before = link_bytes()
big = allreduce(torch.full((1 << 20,), float(rank + 1)))
moved = link_bytes() - before
record = {"rank": rank, "size": size, "host": socket.gethostname(), "local": local,
          "exact": bool((big == size * (size + 1) / 2).all()), "link_bytes": moved}
# one write of the whole line: the ranks of a host share the agent's pipe
os.write(1, ("RECORD " + json.dumps(record) + "\\n").encode())
# gloo's threads must stop before the interpreter exits: without it a worker can abort at
# exit ("terminate called without an active exception", SIGABRT), failing its agent
if sys.argv[1] == "torchrun":
    dist.destroy_process_group()
else:
    hvd.shutdown()
"""


def _baseline_records(output: str) -> list[dict[str, Any]]:
    found = [json.loads(m) for m in re.findall(r"RECORD (\{[^{}]*\})", output)]
    return sorted(found, key=lambda r: r["rank"])


# Both agents together; below pytest's 120 s per test, so that a hang shows their output.
TORCHRUN_TIMEOUT_S = 90.0


def torchrun_agents(
    script: Path, args: list[str], env: dict[str, str], rendezvous: str = "static"
) -> list[subprocess.Popen[str]]:
    """``script`` under torchrun as on real machines: one agent per host of the cluster that is
    up, ``PER_HOST`` workers each, started now (stdout and stderr together, piped).
    ``rendezvous``: "static" (``--node-rank``: node1's ranks first, the master on node1) or
    "c10d" (ranks in the order the agents join, the store on node1)."""
    torchrun = str(Path(sysconfig.get_path("scripts")) / "torchrun")
    common = [torchrun, "--nnodes", str(HOSTS), "--nproc-per-node", str(PER_HOST)]

    def meet(k: int) -> list[str]:
        if rendezvous == "static":
            return ["--node-rank", str(k - 1), "--master-addr", "node1", "--master-port", "29400"]
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400",
                "--rdzv-id", f"test{os.getpid()}"]  # fmt: skip

    return [
        subprocess.Popen(
            ["bash", str(CLUSTER_SH), "exec", f"node{k}", *common, *meet(k), str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=dict(env, GLOO_SOCKET_IFNAME="eth0"),
            cwd=REPO,
        )
        for k in range(1, HOSTS + 1)
    ]


def agents_output(agents: list[subprocess.Popen[str]], timeout_s: float) -> str:
    """Every agent's output once all have ended; past ``timeout_s`` (together) each is killed,
    its output marked so."""
    deadline = Deadline(timeout_s)
    outputs = []
    for k, agent in enumerate(agents, start=1):
        try:
            outputs.append(agent.communicate(timeout=max(1.0, deadline.left_s()))[0])
        except subprocess.TimeoutExpired:
            agent.kill()  # its workers run in the host's namespace: cluster.sh down ends them
            outputs.append(
                f"--- node{k}'s agent, killed after {timeout_s:.0f} s ---\n"
                + agent.communicate()[0]
            )
    codes = ", ".join(f"node{k} {a.returncode}" for k, a in enumerate(agents, start=1))
    return f"agents' exit codes: {codes}\n" + "\n".join(outputs)


def test_torchrun_multinode_on_the_cluster(job: Job, tmp_path: Path) -> None:
    """DDP's launcher as on real machines: one torchrun agent per host, c10d rendezvous on
    node1; gloo's 4 MiB allreduce is exact and crosses the link."""
    script = tmp_path / "baseline.py"
    script.write_text(_BASELINE_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = torchrun_agents(script, ["torchrun"], env, rendezvous="c10d")
    output = agents_output(agents, TORCHRUN_TIMEOUT_S)
    assert [a.returncode for a in agents] == [0] * HOSTS, output
    records = _baseline_records(output)
    assert [r["rank"] for r in records] == list(range(HOSTS * PER_HOST)), output
    for r in records:
        assert r["exact"] and r["local"][1] == PER_HOST, r
        assert r["link_bytes"] > 4 << 20, r  # the 4 MiB sum needs the other host's part
    hosts = sorted(r["host"] for r in records)
    assert hosts == sorted(f"node{k}" for k in range(1, HOSTS + 1) for _ in range(PER_HOST))


# -- commlayer under multi-node torchrun: the same worker, one agent per host, over gloo ----------


@pytest.fixture(scope="module")
def torchrun_job(job: Job, harness: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The worker of ``job`` under torchrun as a DDP user starts it on two machines (static
    rendezvous, node1's ranks first): commlayer.init() forms one job of 4 ranks over gloo."""
    out_dir = tmp_path_factory.mktemp("torchrun")
    env = harness.worker_env(out_dir, JOB_TIMEOUT_S + 10, {})
    agents = torchrun_agents(WORKER, [], env)
    output = agents_output(agents, JOB_TIMEOUT_S)
    records = harness._read_records(out_dir)
    return Job(max(abs(a.returncode) for a in agents), output, records)


def test_torchrun_job_is_one_job_over_gloo(torchrun_job: Job) -> None:
    assert torchrun_job.returncode == 0, torchrun_job.output
    assert len(torchrun_job.each_rank("done")) == HOSTS * PER_HOST
    for r, record in enumerate(torchrun_job.each_rank("topology")):
        host, local = divmod(r, PER_HOST)
        assert record["backend"] == "TorchBackend", record
        assert record["hostname"] == f"node{host + 1}", record
        assert record["size"] == HOSTS * PER_HOST
        assert (record["local_rank"], record["local_size"]) == (local, PER_HOST), record
        assert (record["cross_rank"], record["cross_size"]) == (host, HOSTS), record
        assert record["nodes"] == [q // PER_HOST for q in range(HOSTS * PER_HOST)], record
        assert record["machines"] == [0] * (HOSTS * PER_HOST), record


def test_torchrun_job_bytes_cross_the_link_only_between_hosts(torchrun_job: Job) -> None:
    """As over MPI: a 16 MiB allreduce over all ranks moves at least the buffer each way over
    each host's cable, whatever the algorithm; one inside a host (a process set) moves
    nothing over it (gloo between two ranks of a host goes through lo)."""
    for name, ranks in _algorithms(torchrun_job).items():
        for record in ranks[::PER_HOST]:
            moved = record["bytes"]
            assert moved["eth0_tx"] >= BIG_BYTES and moved["eth0_rx"] >= BIG_BYTES, (name, moved)
    for record in torchrun_job.each_rank("intra_host"):
        assert record["exact"], record
        assert record["bytes"]["eth0_tx"] < NOISE_BYTES, record


def test_horovod_through_the_same_mpiexec(job: Job, tmp_path: Path, harness: ModuleType) -> None:
    """Horovod (scripts/install-horovod.sh) started by commlayerrun on the cluster's hosts sees
    the same topology and reduces exactly across the link."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("horovod.torch is not importable: bash scripts/install-horovod.sh builds it")
    script = tmp_path / "baseline.py"
    script.write_text(_BASELINE_WORKER)
    command = [
        _commlayerrun(), "-np", str(HOSTS * PER_HOST),
        "-H", ",".join(f"node{k}:{PER_HOST}" for k in range(1, HOSTS + 1)),
        sys.executable, str(script), "horovod",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code, stdout, stderr = harness.run_limited(command, env, 120, cwd=REPO)
    output = f"exit code {code}\n{stdout}\n--- stderr ---\n{stderr}"
    assert code == 0, output
    records = _baseline_records(stdout)
    assert [r["rank"] for r in records] == list(range(HOSTS * PER_HOST)), output
    for r in records:
        assert r["exact"] and r["local"][1:] == [PER_HOST, HOSTS], r
        assert r["host"] == f"node{r['rank'] // PER_HOST + 1}", r
        assert r["link_bytes"] > 4 << 20, r
