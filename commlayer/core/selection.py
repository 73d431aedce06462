"""The engine's allreduce: picks the algorithm for each buffer and starts it.

``Allreducer(algorithm)(backend, send, buf, op)`` returns a Request like the backend's own
``iallreduce``, so the engine waits on every algorithm the same way (yield, then sleep; a dead
peer noticed): the backend's own for ``native`` and ``shm``, else the algorithm's schedule run
by algorithms/executor.py's ``ScheduleRequest``. ``auto`` asks the cost model
(costmodel/model.py) and, with online tuning, measures its best candidates
(algorithms/autotune.py). It is the core's, above the cost model it asks and the algorithms
it runs (DESIGN.md's layers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from commlayer import algorithms
from commlayer.algorithms import autotune, hierarchical
from commlayer.algorithms.executor import BufferPool, ScheduleRequest
from commlayer.algorithms.registry import NATIVE_ALLREDUCE
from commlayer.algorithms.schedule import Schedule
from commlayer.backends.base import (
    COMPLETED,
    SHARED_MEMORY,
    TWO_LEVEL,
    Backend,
    Request,
    SharedMemory,
    TwoLevel,
)
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.costmodel import model as costmodel
from commlayer.costmodel.calibration import Calibration


class Allreducer:
    """The engine's allreduce: the configured algorithm for each fused buffer."""

    def __init__(
        self,
        algorithm: str,
        calibrations: list[Calibration] | None = None,
        topology: Topology | None = None,
        tuning: bool = False,
        simulated: costmodel.Simulated | None = None,
    ) -> None:
        """``topology``: the job's, when COMMLAYER_TOPOLOGY overrides the detected one; it
        applies to groups of its size (the global set), others use their detected nodes.
        ``tuning``: ``auto`` measures its candidates online (algorithms/autotune.py).
        ``simulated``: a simulated table of this machine (COMMLAYER_SIM_TABLE) that ``auto``
        reads before the calibrations where it fits the job (costmodel.choose)."""
        self.algorithm = algorithms.check_name(algorithm)
        self._override = topology
        # per backend object (not its id: a removed process set's id can be reused): its
        # topology, whether it can use the shared-memory window, and whether hierarchical
        # runs as that window within nodes (see _backend_facts)
        self._facts: dict[Backend, tuple[Topology, bool, bool]] = {}
        self._scratch = BufferPool()
        self._schedules: dict[tuple[str, int, int, int, Topology], Schedule] = {}
        self._calibrations = {(c.size, c.nodes): c for c in calibrations or ()}
        self._auto: dict[tuple[int, int, int, int, bool], str] = {}
        self._tuning = tuning
        self._tuner = autotune.Tuner()
        self._simulated = simulated

    def choose(self, backend: Backend, numel: int, element_size: int) -> str:
        """The algorithm for a buffer: the configured one, or for ``auto`` the pick measured
        by online tuning (algorithms/autotune.py) once agreed for the buffer's power-of-two size
        class, else the cost model's pick for the class (costmodel.choose); ``shm`` falls back
        to ``native`` when the ranks are not all on one node. Every rank decides the same from the
        same facts (sizes, node layout, the calibration agreed at start, agreed measurements)."""
        name = self.algorithm
        topology, capable, _ = self._backend_facts(backend)
        if name == algorithms.AUTO:
            if self._tuning:
                decided = self._tuner.decided(self._class(backend, numel, element_size))
                if decided:
                    return decided
            key = (backend.size, topology.nodes, numel.bit_length(), element_size, capable)
            name = self._auto.get(key, "")
            if not name:
                facts = self._model(backend, numel, element_size)
                name = costmodel.choose(*facts, simulated=self._simulated)
                self._auto[key] = name
        if name == "shm" and not capable:
            return NATIVE_ALLREDUCE
        return name

    def _class(self, backend: Backend, numel: int, element_size: int) -> tuple[Any, ...]:
        return (backend, numel.bit_length(), element_size)

    def _model(
        self, backend: Backend, numel: int, element_size: int
    ) -> tuple[int, int, int, int, Calibration | None, Topology]:
        """What the cost model decides a buffer's size class from (``costmodel.choose`` and
        ``costmodel.ranked``): a representative size, element size, ranks, nodes, calibration
        and topology."""
        topology, _, _ = self._backend_facts(backend)
        representative = 1 << max(numel.bit_length() - 1, 0)
        cal = self._calibrations.get((backend.size, topology.nodes))
        return representative, element_size, backend.size, topology.nodes, cal, topology

    def _ranked(self, backend: Backend, numel: int, element_size: int, count: int) -> list[str]:
        """The cost model's best ``count`` for the buffer's size class, as this backend can run
        them (``shm`` only where every rank is on one node)."""
        capable = self._backend_facts(backend)[1]
        facts = self._model(backend, numel, element_size)
        names = costmodel.ranked(*facts, count, simulated=self._simulated)
        return list(
            dict.fromkeys(NATIVE_ALLREDUCE if n == "shm" and not capable else n for n in names)
        )

    def _next(self, backend: Backend, numel: int, element_size: int) -> tuple[str, Any]:
        """The algorithm of this call and, under online tuning, its size class."""
        if not self._tuning or self.algorithm != algorithms.AUTO or backend.size == 1:
            return self.choose(backend, numel, element_size), None
        key = self._class(backend, numel, element_size)
        name = self._tuner.peek(key)
        if name is None:
            names = self._ranked(backend, numel, element_size, autotune.CANDIDATES)
            low = (1 << max(numel.bit_length() - 1, 0)) * element_size
            label = f"buffers of {low}-{2 * low} B on {backend.size} ranks"
            runs = autotune.samples(numel * element_size)
            name = self._tuner.add(key, names, runs, label)
        return name, key

    def __call__(
        self,
        backend: Backend,
        send: torch.Tensor | None,
        buf: torch.Tensor,
        op: ReduceOp,
        packed_s: float = 0.0,
    ) -> Request:
        """Start the allreduce of ``buf`` (from ``send`` when given). ``hierarchical`` runs in
        two levels, the shared-memory window in each node and ``hierarchical.INTER`` across,
        when the backend can and the nodes allow it (``_backend_facts``); else its schedule.
        ``packed_s``: what packing ``buf`` took, counted twice (pack and the unpack that
        mirrors it) when online tuning measures this call."""
        return self.start(backend, send, buf, op, packed_s)[0]

    def start(
        self,
        backend: Backend,
        send: torch.Tensor | None,
        buf: torch.Tensor,
        op: ReduceOp,
        packed_s: float = 0.0,
        before_alone: Callable[[], None] | None = None,
    ) -> tuple[Request, bool]:
        """``__call__``, and whether the request may stay in flight beside others: the
        backend's own allreduce (``native``: gloo or MPI match collectives by the order they are
        posted, which is the same on every rank), not timed by online tuning. A schedule's
        point-to-point steps, the shared-memory window (one buffer) and a measured call run
        alone: ``before_alone`` is called before such a request is posted (the caller waits
        for what it has in flight, so a measurement times this call only)."""
        if buf.device.type != "cpu":
            # A device buffer (a direct CUDA operation, device.py): the backend's own allreduce
            # (NCCL's, a CUDA-aware MPI's) unless a schedule was asked for by name; the cost
            # model, the tuner and the shared-memory window know host memory only.
            name = self.algorithm
            if name in (algorithms.AUTO, "shm", "hierarchical"):
                name = NATIVE_ALLREDUCE
            if name != NATIVE_ALLREDUCE and before_alone is not None:
                before_alone()
            topology = self._backend_facts(backend)[0]
            return self._run(name, backend, send, buf, op, topology), name == NATIVE_ALLREDUCE
        name, key = self._next(backend, buf.numel(), buf.element_size())
        alone = name != NATIVE_ALLREDUCE or (key is not None and self._tuner.measures(key))
        if alone and before_alone is not None:
            before_alone()
        topology, _, two_level = self._backend_facts(backend)
        if name == "hierarchical" and two_level:
            levels: TwoLevel = backend  # type: ignore[assignment]  # two_level: TWO_LEVEL
            request = levels.shm_hierarchical_iallreduce(
                send, buf, op, topology.node_of, lambda cross, part: self._inter(cross, part, op)
            )
        else:
            request = self._run(name, backend, send, buf, op, topology)
        if key is not None:
            request = self._tuner.start(key, name, backend, request, 2 * packed_s)
        return request, not alone

    def pieces(
        self,
        backend: Backend,
        sources: list[torch.Tensor],
        outputs: list[torch.Tensor],
        scales: list[float],
        op: ReduceOp,
        before_alone: Callable[[], None] | None = None,
    ) -> Request | None:
        """Start the allreduce of a fused bucket without a fusion buffer (fusion.pieces), where
        the algorithm of this call is the shared-memory window, which copies every byte in and
        out of the window anyway; None elsewhere (the caller packs and calls this object).
        The window runs alone: ``before_alone`` (as ``start``'s) is called before it is posted."""
        numel = sum(t.numel() for t in sources)
        name, key = self._next(backend, numel, sources[0].element_size())
        if backend.size == 1 or name != "shm":
            return None
        if before_alone is not None:
            before_alone()
        window: SharedMemory = backend  # type: ignore[assignment]  # "shm": only where capable
        request = window.shm_iallreduce_pieces(sources, outputs, scales, op)
        return request if key is None else self._tuner.start(key, name, backend, request)

    def windowed(self, backend: Backend, numel: int, element_size: int) -> bool:
        """Whether a buffer of ``numel`` elements goes through the shared-memory window (as
        ``pieces`` or packed): the caller keeps such a bucket whole, on every rank alike (a
        joined rank, which packs its zeros, too)."""
        return backend.size > 1 and self._next(backend, numel, element_size)[0] == "shm"

    def prepare(self, backend: Backend, wait: Callable[[Request], None]) -> None:
        """Make now, with a small allreduce each waited for by ``wait``, what an algorithm makes
        at its first call with a blocking collective: the shared-memory window, hierarchical's
        communicators per node and across. A planned lane (core/planned.py) calls it as it
        opens, inside a negotiated operation every rank runs, so that nothing it posts later
        blocks (a rank blocked there while a peer blocks on another communicator would
        deadlock)."""
        if backend.size == 1:
            return
        topology, capable, two_level = self._backend_facts(backend)
        if capable:
            window: SharedMemory = backend  # type: ignore[assignment]  # capable: SHARED_MEMORY
            wait(window.shm_iallreduce(None, torch.zeros(64), ReduceOp.Sum))
        if two_level:
            levels: TwoLevel = backend  # type: ignore[assignment]  # two_level: TWO_LEVEL
            wait(
                levels.shm_hierarchical_iallreduce(
                    None,
                    torch.zeros(64),
                    ReduceOp.Sum,
                    topology.node_of,
                    lambda cross, part: self._inter(cross, part, ReduceOp.Sum),
                )
            )

    def runs_alone(self, backend: Backend, numel: int, element_size: int) -> bool:
        """Whether the next call for a host buffer of ``numel`` elements must run alone (the
        ``start`` of it would call ``before_alone``), asked before it is posted: a planned lane
        (core/planned.py) posts it only once nothing else of its own is in flight."""
        if backend.size == 1:
            return False
        name, key = self._next(backend, numel, element_size)
        return name != NATIVE_ALLREDUCE or (key is not None and self._tuner.measures(key))

    def bucket_window(self, backend: Backend, nbytes: int) -> Any:
        """The shared-memory window of DistributedOptimizer's planned buckets over
        ``backend``'s ranks (backends/shm.py's BucketWindow; collective), or None, every rank
        alike. On several nodes where hierarchical's window per node fits (``TWO_LEVEL``, the
        same facts as the two-level allreduce's, COMMLAYER_TOPOLOGY's nodes included), a
        window per node whose parts' slices cross between nodes with ``hierarchical.INTER``;
        else, every rank on one detected node (``SHARED_MEMORY``), one window; else None.
        Not with one rank a node: no local leg to save, and MPI's allreduce of a whole part
        in a window (a tmpfs mapping) took 1.5-1.6 times that of process memory (8 MiB, 2
        ranks as 2 nodes: benchmarks/window_buckets.py --nodes 2)."""
        topology, capable, two_level = self._backend_facts(backend)
        if two_level and topology.size == topology.nodes:
            return None
        if two_level:
            levels: TwoLevel = backend  # type: ignore[assignment]  # two_level: TWO_LEVEL
            return levels.shm_bucket_window(nbytes, topology.node_of, self._inter)
        if capable:
            window: SharedMemory = backend  # type: ignore[assignment]  # capable: SHARED_MEMORY
            return window.shm_bucket_window(nbytes)
        return None

    def _inter(self, cross: Backend, part: torch.Tensor, op: ReduceOp) -> Request:
        """The leg across nodes of the two-level hierarchical: ``hierarchical.INTER``, as in
        the schedule form (the ranks of ``cross`` are one per node, so a flat topology)."""
        return self._run(hierarchical.INTER, cross, None, part, op, Topology.flat(cross.size))

    def _run(
        self,
        name: str,
        backend: Backend,
        send: torch.Tensor | None,
        buf: torch.Tensor,
        op: ReduceOp,
        topology: Topology,
    ) -> Request:
        if name == NATIVE_ALLREDUCE or backend.size == 1:
            return backend.iallreduce(send, buf, op)
        if name == "shm":
            window: SharedMemory = backend  # type: ignore[assignment]  # no cast() call per op
            return window.shm_iallreduce(send, buf, op)
        if send is not None:
            buf.copy_(send)
        key = (name, backend.rank, backend.size, buf.numel(), topology)
        schedule = self._schedules.get(key)
        if schedule is None:
            if len(self._schedules) > 256:
                self._schedules.clear()
            schedule = algorithms.schedule(name, backend.rank, backend.size, buf.numel(), topology)
            self._schedules[key] = schedule
        if not schedule:
            return COMPLETED
        return ScheduleRequest(backend, schedule, buf.view(-1), op, self._scratch)

    def topology(self, backend: Backend) -> Topology:
        return self._backend_facts(backend)[0]

    def _backend_facts(self, backend: Backend) -> tuple[Topology, bool, bool]:
        """(topology, shm capable, hierarchical two-level), from facts every rank shares."""
        found = self._facts.get(backend)
        if found is None:
            detected = tuple(backend.nodes())
            if self._override is not None and self._override.size == backend.size:
                topology = self._override
            else:
                topology = Topology(detected)
            # shm needs real shared memory: the detected nodes, not an override
            capable = SHARED_MEMORY in backend.capabilities and len(set(detected)) == 1
            # hierarchical's window per node: more than one node (on one, the schedule the cost
            # model predicts), and a window per node fits (Topology.windows_fit)
            two_level = (
                TWO_LEVEL in backend.capabilities
                and topology.nodes > 1
                and topology.windows_fit(detected)
            )
            found = self._facts[backend] = (topology, capable, two_level)
        return found
