"""pytest plugin of scripts/horovod_suite.py, loaded on every rank of the mpiexec (or torchrun)
job.

1. Each rank appends its outcome of each test to HVD_SUITE_REPORTS/rank<r>.jsonl as it happens
   (one JSON line: test, outcome, and for a failure the phase and the error's first line), so a
   rank that hangs or dies mid-file still leaves what it finished.
2. With HVD_SUITE_SYNC_S set (the whole file in one job): after each test the ranks meet in a
   barrier on MPI_COMM_WORLD (non-blocking, polled with a sleep; under torchrun a counter in
   torchrun's store, polled the same way: commlayer runs over torch.distributed there, and the
   tests' own process groups come and go). A rank that left a test while
   another is still inside it (stuck in a collective the first never reached) waits at most
   HVD_SUITE_SYNC_S, reports the test as "desync" and ends the job; a test that runs longer than
   HVD_SUITE_TEST_TIMEOUT_S is reported "hung" and ends the job. The driver then starts a fresh
   job at the next test, so one failing test cannot poison the ones after it.
"""

from __future__ import annotations

import json
import os
import threading
import time

_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
_rank = os.environ.get(
    "RANK" if _torchrun else "PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")
)
if _torchrun:
    # What `horovodrun --gloo` gives each rank of a job over Horovod's gloo controller: the
    # tests read them to know their rank and size without MPI (and run the re-init tests, which
    # they skip under MPI).
    os.environ.setdefault("HOROVOD_RANK", _rank)
    os.environ.setdefault("HOROVOD_SIZE", os.environ["WORLD_SIZE"])
_out = open(  # noqa: SIM115 - one file for the whole session
    os.path.join(os.environ["HVD_SUITE_REPORTS"], f"rank{_rank}.jsonl"), "a"
)
_failed: set[str] = set()
_sync_s = float(os.environ.get("HVD_SUITE_SYNC_S", "0"))
_test_timeout_s = float(os.environ.get("HVD_SUITE_TEST_TIMEOUT_S", "300"))
_watchdog: threading.Timer | None = None


def _write(record: dict) -> None:
    _out.write(json.dumps(record) + "\n")
    _out.flush()


def _name(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def _end_job(name: str, outcome: str, code: int) -> None:
    _write({"test": name, "outcome": outcome})
    os._exit(code)


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    global _watchdog
    if _sync_s:
        _watchdog = threading.Timer(_test_timeout_s, _end_job, (_name(nodeid), "hung", 4))
        _watchdog.daemon = True
        _watchdog.start()


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest's TestReport
    name = _name(report.nodeid)
    if report.failed:
        _failed.add(name)
        crash = getattr(report.longrepr, "reprcrash", None)
        error = crash.message if crash else str(report.longrepr).strip()
        _write(
            {
                "test": name,
                "outcome": "failed",
                "when": report.when,
                "error": " ".join(error.split())[:300],
            }
        )
    elif (report.when == "call" or (report.when == "setup" and report.skipped)) and (
        name not in _failed
    ):
        _write({"test": name, "outcome": report.outcome})


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if not _sync_s:
        return
    if _watchdog is not None:
        _watchdog.cancel()
    deadline = time.monotonic() + _sync_s
    if _torchrun:
        store, size = _store(), int(os.environ["WORLD_SIZE"])
        key = f"hvdsuite/{nodeid}"
        store.add(key, 1)
        while store.add(key, 0) < size:
            if time.monotonic() > deadline:
                _end_job(_name(nodeid), "desync", 3)
            time.sleep(0.005)
        return
    # The MPI that commlayer started (importing its backend sets mpi4py.rc first).
    from commlayer.backends import mpi as mpi_backend

    request = mpi_backend.MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        if time.monotonic() > deadline:
            _end_job(_name(nodeid), "desync", 3)
        time.sleep(0.005)


_client = None


def _store():  # noqa: ANN202 - torch.distributed.TCPStore, imported late
    """A client of torchrun's store (its agent serves it at MASTER_ADDR:MASTER_PORT)."""
    global _client
    if _client is None:
        from datetime import timedelta

        import torch.distributed as dist

        _client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=_sync_s),
        )
    return _client
