"""Backend protocol: the small set of nonblocking operations the engine runs on flat buffers.

Every data call takes contiguous CPU torch tensors and returns a :class:`Request` at once; the
engine decides how to wait (``Request.test()`` in a loop that yields the CPU rather than
busy-polling: on 2 cores a busy-polling progress loop halves training throughput,
benchmarks/README.md, Yardsticks). Counts are in elements, never bytes. Only the engine thread
calls a backend.

Reductions receive ``ReduceOp.Sum/Min/Max/Product``; Average is Sum plus a scale the engine
applies. Results must be bitwise identical on every rank.

:class:`Backend` is what every backend does. What only some do is declared, not probed: a
backend's ``capabilities`` (a frozenset, fixed when the backend is made) names the optional
protocols below that it implements, and a caller checks membership once (cached where the
answer is asked per operation) before it casts to that protocol:

- ``SHARED_MEMORY`` (:class:`SharedMemory`): allreduces through a shared-memory window over the
  ranks of one machine (backends/shm.py); declared only where every rank can map one;
- ``TWO_LEVEL`` (:class:`TwoLevel`): hierarchical's window per node plus a leg across nodes;
- ``DIRECT_PATHS`` (:class:`DirectPaths`): takes some device tensors as they are (core/device.py);
- ``PROGRESS_THREADS`` (:class:`ProgressThreads`): transfers progress on threads of its own
  (gloo's), which need cores too (the engine's wait policy, runners/allreduce.py's split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from commlayer.common.reduce_ops import ReduceOp


@runtime_checkable
class Request(Protocol):
    """A nonblocking operation in flight."""

    def test(self) -> bool:
        """True once the operation has completed (its output buffers hold the result)."""
        ...


class Backend(Protocol):
    """Transport for one group of ranks (a communicator)."""

    capabilities: frozenset[str]  # the optional protocols it implements (module docstring)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        ...

    def iallreduce(self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp) -> Request:
        """recv <- reduction over ranks of send (or of recv itself when send is None)."""
        ...

    def iallgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Request:
        """recv <- concatenation of every rank's send; counts[r] elements come from rank r."""
        ...

    def ibcast(self, buf: torch.Tensor, root: int) -> Request:
        """buf <- root's buf on every rank."""
        ...

    def ialltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> Request:
        """Rank r sends send_counts[q] consecutive elements to q and receives recv_counts[q]
        from q, both laid out in rank order."""
        ...

    def ireduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp
    ) -> Request:
        """recv <- block `rank` (counts[rank] elements) of the reduction of every rank's send."""
        ...

    def isend(self, buf: torch.Tensor, peer: int) -> Request:
        """Send buf to ``peer``; messages between two ranks arrive in the order sent."""
        ...

    def irecv(self, buf: torch.Tensor, peer: int) -> Request:
        """Receive the next message from ``peer`` into buf (same number of elements)."""
        ...

    def ibarrier(self) -> Request:
        """Completes once every rank has entered."""
        ...

    def icontrol(self, words: np.ndarray) -> Request:
        """In place bitwise AND of a uint64 vector over ranks (the negotiation bit vector)."""
        ...

    def iallgather_bytes(self, payload: bytes) -> tuple[Request, list[bytes]]:
        """Gather every rank's payload; the list is filled, in rank order, once the request
        completes."""
        ...

    def split(self, ranks: Sequence[int]) -> Backend | None:
        """A backend over ``ranks`` (global ranks of this group, ascending); collective over
        this group; returns None on ranks not in ``ranks``."""
        ...

    def nodes(self) -> list[int]:
        """Node index of every rank of this group (ranks sharing memory share an index; nodes
        numbered in order of their lowest rank)."""
        ...

    def hosts(self) -> list[str]:
        """Host name of every rank of this group (for messages naming where a rank runs)."""
        ...

    def machines(self) -> list[int]:
        """Machine index of every rank of this group: ranks whose processes share one kernel,
        hence its cores, share an index (numbered in order of their lowest rank), even where
        they are different hosts to MPI (the namespace cluster's hosts, containers)."""
        ...

    def dead_peers(self) -> list[int]:
        """Ranks of this group known to have exited (empty when none or when unknown)."""
        ...

    def lost_peers(self, error: BaseException) -> tuple[str, list[int]] | None:
        """(host, its ranks) when ``error``, raised by a request, is this transport saying the
        connection to ranks elsewhere closed (their pids cannot be checked from here); None
        when it does not say so, or the transport never does."""
        ...

    def abort(self, reason: str) -> None:
        """End the whole job now, every rank of every group (MPI_Abort on COMM_WORLD): the way
        out when a request can neither complete nor be cancelled. ``reason`` is logged first."""
        ...

    def close(self) -> None:
        """Release the group's resources (not the library itself)."""
        ...


class CompletedRequest:
    """A request that finished when it was created (size-1 groups, empty buffers)."""

    __slots__ = ()

    def test(self) -> bool:
        return True


COMPLETED = CompletedRequest()


SHARED_MEMORY = "shared_memory"
TWO_LEVEL = "two_level"
DIRECT_PATHS = "direct_paths"
PROGRESS_THREADS = "progress_threads"


class SharedMemory(Backend, Protocol):
    """``SHARED_MEMORY``: allreduces through a window every rank of this group maps (one
    machine; backends/shm.py). The window is made at the first call, which every rank reaches
    together."""

    def shm_iallreduce(
        self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp
    ) -> Request: ...

    def shm_iallreduce_pieces(
        self,
        sources: list[torch.Tensor],
        outputs: list[torch.Tensor],
        scales: list[float],
        op: ReduceOp,
    ) -> Request:
        """shm_iallreduce of the concatenation of ``sources`` into ``outputs``, output i
        scaled by ``scales[i]`` (size >= 2)."""
        ...

    def shm_bucket_window(self, nbytes: int) -> Any:
        """A window of ``nbytes`` a rank for DistributedOptimizer's planned buckets
        (backends/shm.py's BucketWindow), or None where one cannot be made (every rank alike).
        Collective: every rank of the group calls it at the same point, on the engine thread
        (a WINDOW operation)."""
        ...


class TwoLevel(Backend, Protocol):
    """``TWO_LEVEL``: the two-level allreduce of algorithms/hierarchical.py, a window over each
    node of ``node_of`` and between nodes ``inter(cross, part)`` (MPI's allreduce when None)."""

    def shm_hierarchical_iallreduce(
        self,
        send: torch.Tensor | None,
        recv: torch.Tensor,
        op: ReduceOp,
        node_of: Sequence[int],
        inter: Callable[[Any, torch.Tensor], Request] | None = None,
    ) -> Request: ...

    def shm_bucket_window(
        self,
        nbytes: int,
        node_of: Sequence[int] | None = None,
        inter: Callable[[Any, torch.Tensor, ReduceOp], Request] | None = None,
    ) -> Any:
        """SharedMemory's ``shm_bucket_window`` over several nodes (``node_of``): a window
        per node, a part's slices allreduced between nodes by ``inter(cross, slice, op)``."""
        ...


@dataclasses.dataclass(frozen=True)
class Path:
    """How a backend takes a device's tensors directly (core/device.py's **Direct**)."""

    wait: str  # "stream": the backend queues after the engine's stream (NCCL); "host": MPI
    channel: str = ""  # negotiated: what every rank of an operation must use ("": nothing)


class DirectPaths(Backend, Protocol):
    """``DIRECT_PATHS``: device tensors this backend takes as they are."""

    def direct_path(self, where: torch.device, dtype: torch.dtype) -> Path | None:
        """How it takes ``where``'s tensors of ``dtype`` directly; None: stage them."""
        ...


class ProgressThreads(Backend, Protocol):
    """``PROGRESS_THREADS``: transfers progress on threads of the backend's own, not on the
    engine's tests."""

    progress_threads: int  # threads per rank that need a core while transfers run

    def oversubscribed(self) -> bool:
        """Whether some machine runs more of this group's ranks than it has cores (the same
        answer on every rank)."""
        ...


def sync_before_host_call(tensor: torch.Tensor) -> None:
    """Before a stream-unaware backend (MPI) touches ``tensor``'s device memory: wait, host-side,
    for the work the engine thread queued on its current stream (packs, reductions)."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
