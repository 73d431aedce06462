"""Faults across hosts of the namespace cluster (scripts/cluster.sh, issue 21): each ends with
a named error on every surviving rank, or with the whole job exiting non-zero and naming the
failed process, within 10 s of the fault, never a hang.

1. A rank on node2 SIGKILLed in the middle of a DistributedOptimizer step: hydra sees its
   proxy's child die of a signal and kills the job ("BAD TERMINATION ... PID p RUNNING AT
   node2"), about a second after the fault.
2. node2's cable pulled (``cluster.sh link node2 down``) in the middle of a loop of
   allreduces: MPI over TCP would retransmit for minutes; commlayer's watchdog
   (COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS, 5 s here) fails the allreduce on every rank, on both
   sides of the cut, with CollectiveTimeoutError naming it and the hosts it waits on, and the
   job aborts (MPI_Abort): commlayerrun exits non-zero.

   1. and 2. also with DistributedOptimizer's buckets in a shared-memory window per host
   (COMMLAYER_WINDOW_BUCKETS, issue 52: each rank's slices cross between hosts from the
   window's memory), checked to be there before the fault; 2. then cuts the link in the middle
   of training steps instead of the allreduce loop.
3. 5% packet loss on node2's link: 16 MiB allreduces stay exact, and get slower.
4. 1 and 2 again under multi-node torchrun (one agent per host, commlayer over gloo): node2's
   agent stops its other rank and exits non-zero; node1's ranks get RankDiedError naming node2
   and its ranks (gloo's "Connection closed by peer" names the address); the cut cable ends in
   the same watchdog error, each rank exiting with the abort's code 70 that its agent reports.

Each test measures the time from the fault (the wall clock, one clock for every host) to the
error and to the job's exit, prints it, and asserts the 10 s bound. Skipped like
test_cluster.py where namespaces are not permitted or a cluster is already up; the cluster is
always taken down at the end. Measured on the loaded 2-core machine: ~1.3 s (SIGKILL), ~6 s
(cable, watchdog 5 s); the file takes ~60 s, most of it three job startups.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_cluster import REPO, _commlayerrun, cluster, permitted, torchrun_agents
from waiting import Deadline, poll

__all__ = ["permitted"]  # a fixture of test_cluster.py, used here (harness: conftest.py)

WORKER = Path(__file__).parent / "scripts" / "fault_worker.py"
HOSTS = "node1:2,node2:2"
WITHIN_S = 10.0  # the bound, from the fault to the error or the job's end
WATCHDOG_S = 5.0
STARTUP_S = 60.0  # torch and MPI_Init of 4 ranks on the loaded 2-core machine: 8-20 s


class Job:
    """A worker job running in the background on the cluster, started by ``launcher``:
    commlayerrun (one mpiexec), or torchrun (an agent on each host, commlayer over gloo)."""

    def __init__(
        self, harness: ModuleType, out_dir: Path, mode: str, env: dict[str, str], launcher: str
    ):
        self.harness, self.out_dir = harness, out_dir
        job_env = harness.worker_env(out_dir, 120.0, env)
        if launcher == "torchrun":
            self.command = ["torchrun on node1 and node2:", str(WORKER), mode]
            self.procs = torchrun_agents(WORKER, [mode], job_env)
        else:
            self.command = [
                _commlayerrun(), "-np", "4", "-H", HOSTS, sys.executable, str(WORKER), mode,
            ]  # fmt: skip
            self.procs = [
                subprocess.Popen(
                    self.command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=job_env,
                    cwd=REPO,
                    text=True,
                    start_new_session=True,
                )
            ]
        self.output = ""
        self.ended_at = 0.0
        self.codes: list[int] = []

    def running(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.out_dir.glob("rank*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip() and line.endswith("}"):
                    found.append(json.loads(line))
        return [r for r in found if event is None or r["event"] == event]

    def wait_for(self, ready: Callable[[], bool], limit_s: float, what: str) -> None:
        # stop early if the job ended: what it did not do by then it never will
        if not poll(lambda: ready() or not self.running(), limit_s, poll_s=0.05) or not ready():
            self.end(0.1)
            pytest.fail(f"never saw {what}\n{self.explain()}", pytrace=False)

    def end(self, limit_s: float) -> int:
        """The job's exit code (torchrun: the first agent's that is not 0), waiting at most
        ``limit_s`` for every process; past it everything is killed and the test fails (a
        hang)."""
        deadline = Deadline(limit_s)
        outputs = []
        try:
            for proc in self.procs:
                outputs.append(proc.communicate(timeout=deadline.left_s())[0])
        except subprocess.TimeoutExpired:
            self.kill()
            self.output = "\n".join(proc.communicate()[0] for proc in self.procs)
            pytest.fail(f"HANG: job killed after {limit_s:g} s\n{self.explain()}", pytrace=False)
        self.ended_at = time.time()
        self.output = "\n".join(outputs)
        self.codes = [proc.returncode for proc in self.procs]
        return next((code for code in self.codes if code != 0), 0)

    def kill(self) -> None:
        tree = [p for proc in self.procs for p in (proc.pid, *self.harness._descendants(proc.pid))]
        self.harness._signal_all(tree, signal.SIGKILL)
        self.harness._wait_gone(tree)

    def explain(self) -> str:
        codes = [proc.returncode for proc in self.procs]
        return f"$ {' '.join(self.command)}\nexit codes {codes}\n{self.output}"


@pytest.fixture(scope="module")
def up(permitted: None) -> Iterator[None]:
    """2 hosts on 1 Gbit/s links for the module; down at the end whatever happened."""
    try:
        cluster("up", "2", "--rate", "1gbit")
        yield
    finally:
        cluster("down")


@pytest.fixture
def start(up: None, harness: ModuleType, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """``start(mode, **env)``: a worker job; after the test, node2's link is healthy again and
    nothing of the job is left running."""
    jobs: list[Job] = []

    def run(mode: str, launcher: str = "commlayerrun", **env: str) -> Job:
        jobs.append(Job(harness, tmp_path, mode, env, launcher))
        return jobs[-1]

    try:
        yield run
    finally:
        for job in jobs:
            if any(proc.poll() is None for proc in job.procs):
                job.kill()
                for proc in job.procs:
                    proc.communicate()
        cluster("link", "node2", "up")
        cluster("set", "node2", "--loss", "0%")


def _steps(job: Job, rank: int) -> int:
    return sum(1 for r in job.records("step") if r["rank"] == rank)


# DistributedOptimizer's planned buckets in a shared-memory window per host, their slices
# crossing between hosts (issue 52): the faults of 1. and 2. hit them too.
WINDOW = {"COMMLAYER_WINDOW_BUCKETS": "1"}


def _assert_window_per_host(job: Job) -> None:
    """Every rank's planned buckets were in its host's window (2 ranks), slices crossing."""
    housed = sorted(job.records("housed"), key=lambda r: r["rank"])
    assert [r["rank"] for r in housed] == [0, 1, 2, 3], job.explain()
    for record in housed:
        assert (record["window_size"], record["across"]) == (2, True), record
        assert record["in_window"] and all(record["in_window"]), record  # every bucket view


@pytest.mark.parametrize("buckets", ["process_memory", "window"])
def test_rank_sigkilled_on_another_host_ends_the_job(
    start: Callable[..., Job], buckets: str
) -> None:
    job = start("sigkill", **(WINDOW if buckets == "window" else {}))
    code = job.end(STARTUP_S + WITHIN_S)
    if buckets == "window":
        _assert_window_per_host(job)
    [failing] = [r for r in job.records("failing")]
    took = job.ended_at - failing["time"]
    print(f"SIGKILL of rank 3 on node2: job exited {code} after {took:.2f} s")
    assert failing["rank"] == 3, job.explain()
    assert code != 0, job.explain()
    assert took < WITHIN_S, f"the job took {took:.1f} s to end\n{job.explain()}"
    # Hydra names the first bad termination it sees: the killed rank, or its neighbour on
    # node2 when hydra's cleanup reached that one first (seen once in CI) - a node2 rank either way.
    on_node2 = [r["pid"] for r in job.records("ready") if r["hostname"] == "node2"]
    assert any(f"PID {pid} RUNNING AT node2" in job.output for pid in on_node2), job.explain()
    assert "EXIT CODE: 9" in job.output, job.explain()
    for record in job.records("error"):  # a survivor that reported before hydra killed it
        assert record["error"] in ("RankDiedError", "ShutdownError"), record


@pytest.mark.parametrize(
    ("launcher", "mode"),
    [
        pytest.param("commlayerrun", "loop", id="commlayerrun"),
        pytest.param("torchrun", "loop", id="torchrun"),
        # DistributedOptimizer's steps, buckets in a window per host (WINDOW)
        pytest.param("commlayerrun", "train", id="commlayerrun-window_buckets"),
    ],
)
def test_link_down_mid_allreduce_fails_every_rank_and_aborts(
    start: Callable[..., Job], launcher: str, mode: str
) -> None:
    env = {"COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS": str(WATCHDOG_S)}
    job = start(mode, launcher, **env, **(WINDOW if mode == "train" else {}))
    job.wait_for(lambda: _steps(job, 3) >= 3, STARTUP_S, f"the {mode} loop running")
    if mode == "train":
        _assert_window_per_host(job)
    fault = time.time()
    cluster("link", "node2", "down")
    code = job.end(WITHIN_S + 20.0)  # the bound is asserted below; this only ends a hang
    took = job.ended_at - fault
    errors = {r["rank"]: r for r in job.records("error")}
    print(
        f"{launcher}, node2's link down: job exited {job.codes} after {took:.2f} s; errors after "
        + ", ".join(f"rank {r} {errors[r]['time'] - fault:.2f} s" for r in sorted(errors))
    )
    assert code != 0, job.explain()
    assert took < WITHIN_S, f"the job took {took:.1f} s to end\n{job.explain()}"
    if launcher == "torchrun":  # each agent names its ranks' exit code: the abort's
        assert job.output.count("exitcode  : 70") >= 2, job.explain()
    else:
        # The watchdog's abort (70): its exit code, or hydra's line about it, whichever survives
        # the abort killing the proxies that forward the ranks' output (both were lost once).
        # Or a rank's user code got the watchdog's error first and ended the job as any
        # uncaught error does (MPI_Abort(1), a fresh CI run): its notice names the error.
        watchdog = code == 70 or "MPI_Abort(MPI_COMM_WORLD, 70)" in job.output
        uncaught = re.search(r"commlayer: aborting the job: rank \d+ raised an uncaught "
                             r"CollectiveTimeoutError", job.output)  # fmt: skip
        assert watchdog or (code == 1 and uncaught), job.explain()
    # The watchdog's error as each rank's user code saw it, and as each aborting rank wrote it to
    # stderr. Under torchrun the abort (os._exit(70)) can end a rank before its user thread
    # reports (2 of 3 runs), and a rank whose neighbour on its host aborted first may see that
    # first: RankDiedError naming it (the neighbour's abort line names the watchdog's error).
    messages = {r: e["message"] for r, e in errors.items() if e["error"] != "RankDiedError"}
    for rank, text in re.findall(r"commlayer: aborting the job \(rank (\d+)\): (.*)", job.output):
        messages.setdefault(int(rank), text)
    assert errors or launcher == "torchrun", f"no rank reported the error\n{job.explain()}"
    assert messages, f"no rank named the error\n{job.explain()}"
    for record in errors.values():
        if record["error"] == "RankDiedError" and launcher == "torchrun":
            assert "exited while this rank waited on them" in record["message"], record
            continue
        assert record["error"] == "CollectiveTimeoutError", record
        # the watchdog counts from the collective's last progress, which may be a step before
        # the cut (CI once saw 4.998 s): not early by more than a step, not later than the bound
        assert WATCHDOG_S - 1.0 <= record["time"] - fault < WITHIN_S, record
    for rank, message in messages.items():
        host, other = ("node1", "node2") if rank < 2 else ("node2", "node1")
        # the cut hits the data allreduce or the negotiation before it, whichever is running
        assert message.startswith(f"rank {rank} (host {host}): "), message
        collective = "allreduce of 'loop' on" if mode == "loop" else "allreduce of "
        assert collective in message or "the negotiation" in message, message
        assert f"made no progress for {WATCHDOG_S:.1f} s" in message, message
        assert f"on {other}" in message, message


def test_packet_loss_is_exact_and_slower(start: Callable[..., Job]) -> None:
    job = start("exact")
    job.wait_for(lambda: len(job.records("before")) == 4, STARTUP_S, "the timed allreduces")
    cluster("set", "node2", "--loss", "5%")
    (job.out_dir / "go").touch()
    code = job.end(90.0)
    assert code == 0, job.explain()
    before, after = job.records("before"), job.records("after")
    assert len(after) == 4 and all(r["exact"] for r in before + after), job.explain()
    median = {
        name: sorted(t for r in records for t in r["seconds"])[10]
        for name, records in (("0%", before), ("5%", after))
    }
    print(
        f"16 MiB allreduce, 2 hosts x 2 ranks, 1 Gbit/s: median {median['0%']:.3f} s at 0% "
        f"loss, {median['5%']:.3f} s at 5% loss ({median['5%'] / median['0%']:.1f}x)"
    )
    assert median["5%"] > median["0%"], median


# -- a rank SIGKILLed under multi-node torchrun (the cut cable: parametrized above) -------------


def test_rank_sigkilled_on_another_host_ends_the_torchrun_job(start: Callable[..., Job]) -> None:
    job = start("sigkill", launcher="torchrun")
    code = job.end(STARTUP_S + WITHIN_S)
    [failing] = job.records("failing")
    took = job.ended_at - failing["time"]
    errors = {r["rank"]: r for r in job.records("error")}
    print(
        f"torchrun, SIGKILL of rank 3 on node2: agents exited {job.codes} after {took:.2f} s; "
        + "; ".join(f"rank {r}: {e['error']}: {e['message'][:160]}" for r, e in errors.items())
    )
    assert failing["rank"] == 3, job.explain()
    assert code != 0, job.explain()
    assert took < WITHIN_S, f"the job took {took:.1f} s to end\n{job.explain()}"
    assert "Signal 9 (SIGKILL) received by PID" in job.output, job.explain()  # node2's agent
    # a survivor that reported before its agent stopped it names rank 3: by its pid on node2
    # (or by its closed connection, which the kernel closes a moment before the killed process
    # is a zombie that the pid check sees), by the address its closed connection came from on
    # node1
    for rank, record in errors.items():
        assert record["error"] == "RankDiedError", record
        where = (
            ("rank(s) [3] exited", "the connection to rank(s) [3] on node2 closed")
            if rank == 2
            else ("rank(s) [2, 3] on node2 closed",)
        )
        assert any(w in record["message"] for w in where), record
