"""What every rank agrees on before its engine's thread starts (collectives, in this order, on
the job's backend): that every rank could open its timeline (``agreed_start``), then, for
``allreduce_algorithm=auto``, rank 0's calibrations and simulated table (``allreducer``: the
algorithm selection every rank builds alike). Also COMMLAYER_TOPOLOGY applied to the job.

The engine (engine.py) calls these once, from its constructor; none runs on the engine thread.
"""

from __future__ import annotations

import logging
import time

from commlayer import costmodel
from commlayer.backends.base import Backend
from commlayer.common import topology
from commlayer.common.config import Config
from commlayer.common.errors import ConfigError
from commlayer.common.topology import Topology
from commlayer.core.selection import Allreducer
from commlayer.core.timeline import NullTimeline, Timeline, open_timeline
from commlayer.costmodel import simulated

log = logging.getLogger("commlayer")

_BACKOFF_S = 50e-6  # between tests of a start-up collective (the engine's _MIN_BACKOFF_S)


def opened_timeline(backend: Backend, path: str) -> Timeline | NullTimeline:
    """COMMLAYER_TIMELINE's file for this rank, opened where every rank agrees it could be
    (``agreed_start``): only rank 0 writes a path without '{rank}', and a rank that could not
    open its file must not leave the others in the engine's first collective."""
    failure = ""
    try:
        opened = open_timeline(path, backend.rank)
    except OSError as exc:
        opened, failure = NullTimeline(), str(exc)
    agreed_start(backend, failure)
    return opened


def agreed_start(backend: Backend, failure: str) -> None:
    """Whether every rank can start its engine (collective, the engine's first): ``failure``
    says what this rank could not do, "" when nothing failed. Any rank's failure is a
    ConfigError on every rank naming the ranks and what failed there: init() fails everywhere
    within the same call, where the others would wait for ever on a rank that had raised."""
    payloads = [failure.encode()]
    if backend.size > 1:
        request, payloads = backend.iallgather_bytes(payloads[0])
        while not request.test():
            time.sleep(_BACKOFF_S)
    failed = {rank: payload.decode() for rank, payload in enumerate(payloads) if payload}
    if failed:
        raise ConfigError(
            f"rank {backend.rank}: commlayer cannot start, rank(s) {sorted(failed)} failed: "
            + "; ".join(failed.values())
        )


def allreducer(config: Config, backend: Backend) -> Allreducer:
    """The allreduce algorithm selection (core/selection.py) for ``config``: with ``auto``,
    built from rank 0's calibrations and simulated table (collectives: every rank alike)."""
    topo = job_topology(config, backend)
    auto = config.allreduce_algorithm == "auto"
    return Allreducer(
        config.allreduce_algorithm,
        agreed_calibrations(backend, costmodel.load_all()) if auto else None,
        topo,
        tuning=config.auto_tuning,
        simulated=agreed_sim_table(backend, config.sim_table) if auto else None,
    )


def agreed_calibrations(
    backend: Backend, calibrations: list[costmodel.Calibration]
) -> list[costmodel.Calibration]:
    """Rank 0's calibrations, on every rank (collective, at engine start). ``auto`` must pick
    the same algorithm for a buffer on every rank, but each node reads its own calibration file,
    which can differ (calibrated apart, or missing on some): a difference is logged by rank 0."""
    if backend.size == 1:
        return calibrations
    payload = _rank0s(
        backend,
        costmodel.to_bytes(calibrations),
        "commlayer: rank(s) %s read calibrations that differ from rank 0's (run `commlayer "
        "calibrate` once for the job, or copy its file to every node); every rank uses rank 0's",
    )
    return costmodel.from_bytes(payload)


def agreed_sim_table(backend: Backend, text: str) -> costmodel.Simulated | None:
    """COMMLAYER_SIM_TABLE's rows as rank 0 read them, on every rank (collective, at engine
    start, when a table is given: every rank's config has it): ``auto`` must pick alike. A
    rank whose files differ from rank 0's is logged by rank 0; ConfigError on every rank when
    rank 0's cannot be read (they were checked at init(): changed since)."""
    if not text:
        return None
    try:
        mine = simulated.to_bytes(simulated.load(text))
    except ValueError:
        mine = b""  # rank 0's decides, below; no rank leaves the collective early
    payload = _rank0s(
        backend,
        mine,
        "commlayer: rank(s) %s read a COMMLAYER_SIM_TABLE that differs from rank 0's; every "
        "rank uses rank 0's",
    )
    if not payload:
        raise ConfigError(
            f"rank {backend.rank}: COMMLAYER_SIM_TABLE={text!r}: rank 0 could not read it "
            "(changed since init() checked it?)"
        )
    return simulated.from_bytes(payload)


def _rank0s(backend: Backend, mine: bytes, differ: str) -> bytes:
    """Rank 0's ``mine`` on every rank (collective: an allgather, waited on with backoff).
    Rank 0 logs ``differ`` with the ranks whose bytes are not its own, when it has any."""
    if backend.size == 1:
        return mine
    request, payloads = backend.iallgather_bytes(mine)
    while not request.test():
        time.sleep(_BACKOFF_S)
    others = [r for r, payload in enumerate(payloads) if payload != payloads[0]]
    if others and backend.rank == 0 and payloads[0]:
        log.warning(differ, others)
    return payloads[0]


def job_topology(config: Config, backend: Backend) -> Topology | None:
    """COMMLAYER_TOPOLOGY applied to the job; ConfigError when it does not fit its size."""
    if not config.topology:
        return None
    try:
        return topology.build(config.topology, backend.size, backend.nodes())
    except ValueError as exc:
        raise ConfigError(
            f"rank {backend.rank}: COMMLAYER_TOPOLOGY={config.topology!r} does not fit this job: "
            f"{exc}"
        ) from None
