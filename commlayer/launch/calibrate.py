"""The measuring behind ``commlayer calibrate``: times this machine's transfers, local work and
native allreduces over a backend (collective: every rank calls it together).

The exchange curve is measured with every rank exchanging with a partner at once through the real
executor (algorithms/executor.py), so Python's per-step overhead and the contention of ranks sharing
one memory bus are in it; the executor's copy of the received bytes over the buffer is taken out
of it (the model adds the step's own copy or reduction; counting it twice overpredicted every
large step). Several nodes: ``exchange_inter``, between partners on different nodes, every pair
at once. gamma and copy are measured on local buffers from 16 KiB (in cache) to 64 MiB. The
native algorithms (``native``, ``shm``) are timed at sizes 1 KiB - 64 MiB. ``overlap``: how much
of a local reduction running between posting an exchange and waiting for it is hidden; ~0 when
the MPI library moves data only inside MPI calls (MPICH between ranks of one node here), nearer
1 with transfers that progress on their own (RDMA NICs, progress threads).
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from commlayer.algorithms.executor import BufferPool, ScheduleRequest
from commlayer.algorithms.registry import NATIVE_ALLREDUCE
from commlayer.algorithms.schedule import Schedule, Step, Transfer
from commlayer.backends.base import SHARED_MEMORY
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.costmodel.calibration import Calibration
from commlayer.costmodel.model import local_curve_time

NATIVE_SIZES = tuple(1 << k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB
# run_local_collective times loops of ~10 ms: the skew of ranks leaving its barrier is spread
# over more calls, nearer the long loops of benchmarks/algorithms.py (2 ms before; the
# difference was within this machine's noise in the one comparison made)
_LOOP_S = 10e-3


def _local_rate(fn: Callable[[], object], nbytes: int, repeats: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / nbytes


def calibrate(
    backend: Any, *, quick: bool = False, topology: Topology | None = None
) -> Calibration:
    """Measure this machine over ``backend`` (an MPI backend; collective: every rank calls it
    together) on its detected nodes, or on ``topology`` (COMMLAYER_TOPOLOGY: one machine as
    several nodes). Every number is the slowest rank's, so all ranks return the same."""
    size, rank = backend.size, backend.rank
    topology = topology or Topology(tuple(backend.nodes()))
    nodes = topology.nodes
    local_sizes = [1 << k for k in range(14, 27, 4)]  # 16 KiB .. 64 MiB
    rates = torch.zeros(2, len(local_sizes), dtype=torch.float64)
    for i, nbytes in enumerate(local_sizes):
        a, b = torch.rand(nbytes // 4), torch.rand(nbytes // 4)
        repeats = 3 if nbytes > 1 << 24 else 20
        rates[0, i] = _local_rate(functools.partial(torch.Tensor.add_, a, b), nbytes, repeats)
        rates[1, i] = _local_rate(functools.partial(torch.Tensor.copy_, a, b), nbytes, repeats)
    _finish(backend.iallreduce(None, rates, ReduceOp.Max))
    gamma, copy = float(rates[0, -1]), float(rates[1, -1])
    local = {
        kind: [(n, float(rates[row, i]) * n) for i, n in enumerate(local_sizes)]
        for row, kind in enumerate(("reduce", "copy"))
    }

    # alpha, beta: every rank exchanges with a partner at once, through the executor (inside
    # its node, and on several nodes also with one on another node); and the native
    # algorithms' times. This machine's speed drifts by up to 2x within a minute: every size is
    # taken in turn (its exchanges and natives at one moment, as auto compares them), in rounds
    # over all sizes, and each point is the median of its rounds.
    scratch = BufferPool()
    partners = {"exchange": _partner(topology, rank, False)}
    if nodes > 1:
        partners["exchange_inter"] = _partner(topology, rank, True)
    exchange_sizes = [8, *(1 << k for k in range(10, 27, 4 if quick else 2))]  # 8 B .. 64 MiB
    native_sizes = NATIVE_SIZES[::2] if quick else NATIVE_SIZES
    natives = _natives(backend, nodes)
    timed: dict[tuple[str, int], list[float]] = {}
    for _ in range(1 if quick else 3):
        for nbytes in sorted({*exchange_sizes, *native_sizes}):
            numel = max(nbytes // 4, 1)
            buf = torch.zeros(numel)
            jobs: list[tuple[str, Callable[[], None]]] = []
            if nbytes in exchange_sizes:
                for key, partner in partners.items():
                    schedule = []
                    if partner is not None:
                        both = (Transfer(partner, 0, numel),)
                        schedule.append(Step(both, both, False))

                    def exchange(buf: torch.Tensor = buf, schedule: Schedule = schedule) -> None:
                        _finish(ScheduleRequest(backend, schedule, buf, ReduceOp.Sum, scratch))

                    jobs.append((key, exchange))
            if nbytes in native_sizes:
                for name, start in natives.items():

                    def allreduce(buf: torch.Tensor = buf, start: _Start = start) -> None:
                        _finish(start(buf))

                    jobs.append((name, allreduce))
            for key, fn in jobs:
                timed.setdefault((key, nbytes), []).append(run_local_collective(backend, fn, True))
    medians = {
        key: [(n, statistics.median(timed[key, n])) for n in exchange_sizes] for key in partners
    }
    # The executor copied each received message over the buffer, which step_time counts on its
    # own (local "copy"): the curves keep the transfer alone (at least half of what was timed).
    curves = {
        key: [(n, max(t - local_curve_time(local["copy"], n), t / 2)) for n, t in points]
        for key, points in medians.items()
    }
    native = {
        name: [(n, statistics.median(timed[name, n])) for n in native_sizes] for name in natives
    }
    alpha, beta = _fit([(float(n), t) for n, t in curves["exchange"]])
    overlap = _measure_overlap(backend, partners["exchange"], quick)
    return Calibration(
        size=size,
        nodes=nodes,
        alpha_s=alpha,
        beta_s_per_byte=beta,
        gamma_s_per_byte=gamma,
        copy_s_per_byte=copy,
        native=native,
        exchange=curves["exchange"],
        local=local,
        overlap=overlap,
        host=platform.node(),
        date=datetime.date.today().isoformat(),
        exchange_inter=curves.get("exchange_inter", []),
    )


_Start = Callable[[torch.Tensor], Any]  # starts an allreduce (sum) of a buffer: a request


def _natives(backend: Any, nodes: int) -> dict[str, _Start]:
    """The native algorithms to time, started as the engine's Allreducer starts them: ``shm``
    only on one node, and as ``native`` (the backend's own allreduce) where the window cannot
    run (no window in the backend, or the ranks not all on one machine)."""

    def native(buf: torch.Tensor) -> Any:
        return backend.iallreduce(None, buf, ReduceOp.Sum)

    def shm(buf: torch.Tensor) -> Any:
        return backend.shm_iallreduce(None, buf, ReduceOp.Sum)

    if nodes > 1:
        return {NATIVE_ALLREDUCE: native}
    capable = (
        backend.size > 1
        and SHARED_MEMORY in backend.capabilities
        and len(set(backend.nodes())) == 1
    )
    return {NATIVE_ALLREDUCE: native, "shm": shm if capable else native}


def _partner(topology: Topology, rank: int, inter: bool) -> int | None:
    """``rank``'s partner for the exchange curves: inside the node, local index i with i ^ 1;
    across (``inter``), the rank of the same local index on node j ^ 1 for this node j (nodes
    in order of appearance). None when there is none: the rank still joins the timing."""
    node = topology.node_of[rank]
    members = topology.members(node)
    index = members.index(rank)
    if not inter:
        return members[index ^ 1] if index ^ 1 < len(members) else None
    nodes = sorted(set(topology.node_of))
    other = nodes.index(node) ^ 1
    if other >= len(nodes):
        return None
    members = topology.members(nodes[other])
    return members[index] if index < len(members) else None


def _measure_overlap(backend: Any, partner: int | None, quick: bool) -> float:
    """How much of a 4 MiB reduction, run between posting a 4 MiB exchange with the partner
    and waiting for it, hides behind the exchange: (comm + local - both) / min(comm, local),
    clipped to [0, 1]; the slowest-to-hide rank's value, the same on every rank (collective;
    a rank without a partner, the last one of an odd size, does not vote)."""
    numel = (4 << 20) // 4
    a, b = torch.rand(numel), torch.rand(numel)
    out, into = torch.zeros(numel), torch.zeros(numel)

    def exchange(work: bool, comm: bool = True) -> None:
        requests = []
        if comm and partner is not None:
            requests = [backend.irecv(into, partner), backend.isend(out, partner)]
        if work:
            a.add_(b)
        for request in requests:
            _finish(request)

    rounds = []  # the three timed back to back, several times: a load change between them
    for _ in range(3 if quick else 7):  # (another job, a helper) would skew one round only
        comm = run_local_collective(backend, functools.partial(exchange, False), True)
        local = run_local_collective(backend, functools.partial(exchange, True, False), True)
        both = run_local_collective(backend, functools.partial(exchange, True), True)
        rounds.append((comm + local - both) / max(min(comm, local), 1e-12))
    hidden = 1.0 if partner is None else sorted(rounds)[len(rounds) // 2]
    result = torch.tensor([min(1.0, max(0.0, hidden))], dtype=torch.float64)
    _finish(backend.iallreduce(None, result, ReduceOp.Min))
    return float(result)


def _finish(request: Any) -> None:
    """Wait for a backend request, yielding the CPU between tests (calibration runs alone)."""
    while not request.test():
        os.sched_yield()


def run_local_collective(backend: Any, fn: Callable[[], object], quick: bool) -> float:
    """Median over repetitions of the slowest rank's time for fn, all ranks starting together
    (a barrier); the same number on every rank."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    _finish(backend.iallreduce(None, once, ReduceOp.Max))
    # Loops of ~_LOOP_S: the skew of ranks leaving the barrier is spread over many calls.
    loop = max(1, min(200, int(_LOOP_S / max(float(once), 1e-7))))
    samples = torch.zeros(3 if quick else 7, dtype=torch.float64)
    for i in range(samples.numel()):
        _finish(backend.ibarrier())
        t0 = time.perf_counter()
        for _ in range(loop):
            fn()
        samples[i] = (time.perf_counter() - t0) / loop
    _finish(backend.iallreduce(None, samples, ReduceOp.Max))
    return float(samples.median())


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising the relative error of alpha + beta * n over the points."""
    rows = np.array([[1.0 / t, n / t] for n, t in points])
    solution, *_ = np.linalg.lstsq(rows, np.ones(len(points)), rcond=None)
    alpha, beta = float(solution[0]), float(solution[1])
    if alpha <= 0 or beta <= 0:  # degenerate: smallest time for alpha, largest slope for beta
        alpha = min(t for _, t in points)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        beta = max((t1 - t0) / (n1 - n0), 1e-12)
    return alpha, beta
