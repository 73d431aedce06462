"""Parallel-test harness: the same files run under ``pytest`` (1 rank) and ``mpiexec -n N pytest``.

1. commlayer is started once per session, as a training script would, and shut down at the end;
   tests use ``commlayer.rank()``/``size()`` and must pass at 1, 2, 3 and 4 ranks.
2. Every rank must run the same tests in the same order, or the ranks call different collectives
   and hang. So the collected test ids are compared across ranks before any test runs, and skip
   decisions may only depend on values all ranks share (``size()``, settings), never on ``rank()``.
3. Only rank 0 prints pytest's report, so a 4-rank run reads like a 1-rank run. The other ranks
   keep their exit status (mpiexec fails if any rank fails) and write each failure, prefixed
   with their rank, to stderr, so a failure seen on rank 2 alone is not lost.
4. Each test gets a timeout (120 s unless set by ``--timeout``, PYTEST_TIMEOUT or the ini file)
   with pytest-timeout's "thread" method: a rank stuck in a collective dumps every thread's
   stack and exits, which ends the mpiexec job instead of hanging CI. On ranks != 0, whose
   terminal is silenced, the same is done by a timer that writes to stderr.
5. DistributedOptimizer and the DDP hook take their whole path over one rank too
   (``COMMLAYER_FORCE_FULL_PATH``; else they are the identity there, as Horovod): these tests
   check that path at every size, a 1-rank run included. test_one_rank.py checks the identity,
   with the switch off.
6. When the engine aborts the job (its collective watchdog: ``backend.abort``, which ends the
   process at once), the reason would go to pytest's captured stderr and be lost with the
   process. So the backends' ``abort`` first writes the reason, the running test and every
   thread's stack to the process's own stderr.

Run it as ``pytest tests/parallel`` (so this conftest is loaded before pytest configures).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

import pytest
from launch import under_torchrun

import commlayer

_DEFAULT_TIMEOUT_S = 120.0
_TIMER_KEY = pytest.StashKey[threading.Timer]()
# Ranks != 0: the process's stderr, duplicated before pytest captures fd 2 during tests.
_rank_stderr: TextIO | None = None
# Every rank: the same, for an abort's report (6. in the module docstring).
_job_stderr: TextIO | None = None
_running_test = "(between tests)"


class _TorchWorld:
    """torch.distributed's default group (gloo) with the three calls this harness makes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self._dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj)
        return out


_torch_world: _TorchWorld | None = None


def _world() -> Any:
    """MPI.COMM_WORLD, started the way commlayer's MPI backend starts it; under torchrun,
    torch.distributed's default group, which commlayer.init() then runs over."""
    global _torch_world
    if under_torchrun():
        if _torch_world is None:
            _torch_world = _TorchWorld()
        return _torch_world
    # Imported here, not at the top: importing the backend sets mpi4py.rc, then initializes MPI.
    from commlayer.backends import mpi as mpi_backend

    return mpi_backend.MPI.COMM_WORLD


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # tryfirst: before pytest-timeout reads its settings and the terminal reporter is created.
    global _rank_stderr
    if (
        config.getoption("timeout", None) is None
        and not os.environ.get("PYTEST_TIMEOUT")
        and not config.getini("timeout")
    ):
        config.option.timeout = _DEFAULT_TIMEOUT_S
    if config.getoption("timeout_method", None) is None:
        config.option.timeout_method = "thread"
    _install_abort_report()
    if _world().rank != 0:
        _rank_stderr = os.fdopen(os.dup(sys.stderr.fileno()), "w")
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  the terminal reporter's, for good


def pytest_unconfigure(config: pytest.Config) -> None:
    global _job_stderr, _rank_stderr
    for stream in (_job_stderr, _rank_stderr):
        if stream is not None:
            stream.close()
    _job_stderr = _rank_stderr = None


def _install_abort_report() -> None:
    """6. in the module docstring: both backends' ``abort`` report before they end the job."""
    global _job_stderr
    _job_stderr = os.fdopen(os.dup(sys.stderr.fileno()), "w")
    from commlayer.backends import torch_distributed

    classes: list[Any] = [torch_distributed.TorchBackend]
    if not under_torchrun():
        from commlayer.backends import mpi as mpi_backend

        classes.append(mpi_backend.MPIBackend)
    for cls in classes:
        _wrap_abort(cls)


def _wrap_abort(cls: Any) -> None:
    abort = cls.abort

    def reporting_abort(self: Any, reason: str) -> None:
        assert _job_stderr is not None
        _write_stacks(_job_stderr, f"ABORT during {_running_test}: {reason}")
        abort(self, reason)

    cls.abort = reporting_abort


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    global _running_test
    _running_test = nodeid


def pytest_report_header(config: pytest.Config) -> str:
    over = "torch.distributed (torchrun)" if under_torchrun() else "MPI"
    return f"commlayer parallel tests: {_world().size} rank(s) over {over}; report from rank 0 only"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # trylast: compare the final list, after -k/-m deselection. commlayer is not started yet,
    # so this thread may still call MPI (or torch.distributed) directly.
    world = _world()
    ids = [item.nodeid for item in items]
    differ = [r for r, other in enumerate(world.allgather(ids)) if other != ids]
    if differ:
        raise pytest.UsageError(
            f"rank {world.rank}: ranks {differ} collected different tests than this rank; every "
            "rank must collect the same tests in the same order (look for rank-dependent "
            "imports, parametrization or collection errors)"
        )


def _report_failure(report: pytest.CollectReport | pytest.TestReport) -> None:
    if _rank_stderr is not None and report.failed:
        when = getattr(report, "when", "collect")
        _rank_stderr.write(
            f"[rank {_world().rank}] FAILED {report.nodeid} ({when})\n{report.longreprtext}\n"
        )
        _rank_stderr.flush()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _report_failure(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _report_failure(report)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Ranks != 0: pytest-timeout's "thread" method, reporting to stderr instead of os.devnull."""
    if _rank_stderr is None:
        return None  # rank 0: pytest-timeout's own timer, reporting to the terminal
    timer = threading.Timer(settings.timeout, _dump_stacks_and_exit, (item.nodeid, settings))
    timer.daemon = True
    item.stash[_TIMER_KEY] = timer
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    timer = item.stash.get(_TIMER_KEY, None)
    if timer is None:
        return None
    timer.cancel()
    timer.join()
    del item.stash[_TIMER_KEY]
    return True


def _write_stacks(stream: TextIO, headline: str) -> None:
    """``headline`` (after this rank's number), then every thread's stack, to ``stream``."""
    stream.write(f"[rank {_world().rank}] {headline}; stacks of all threads:\n")
    stream.flush()
    faulthandler.dump_traceback(file=stream, all_threads=True)
    stream.flush()


def _dump_stacks_and_exit(nodeid: str, settings: Any) -> None:
    assert _rank_stderr is not None
    _write_stacks(_rank_stderr, f"TIMEOUT: {nodeid} still running after {settings.timeout} s")
    os._exit(1)


@pytest.fixture(scope="session", autouse=True)
def _commlayer_session() -> Iterator[None]:
    # hasattr: the API is being written; until init() exists, tests get no engine.
    if not hasattr(commlayer, "init"):
        yield
        return
    with commlayer.common.config.override(force_full_path=1):  # 5. in the module docstring
        commlayer.init()
        yield
        commlayer.shutdown()
