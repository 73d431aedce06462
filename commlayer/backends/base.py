"""Backend protocol: the small set of nonblocking operations the engine runs on flat buffers.

Every data call takes contiguous CPU torch tensors and returns a :class:`Request` at once; the
engine decides how to wait (``Request.test()`` in a loop that yields the CPU rather than
busy-polling: on 2 cores a busy-polling progress loop halves training throughput,
benchmarks/README.md, Yardsticks). Counts are in elements, never bytes. Only the engine thread
calls a backend.

Reductions receive ``ReduceOp.Sum/Min/Max/Product``; Average is Sum plus a scale the engine
applies. Results must be bitwise identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from commlayer.core.reduce_ops import ReduceOp


@runtime_checkable
class Request(Protocol):
    """A nonblocking operation in flight."""

    def test(self) -> bool:
        """True once the operation has completed (its output buffers hold the result)."""
        ...


@runtime_checkable
class SizedRequest(Protocol):
    """A receive of unknown length in flight: ``tensor`` is the message once ``test()`` is
    True (a new 1-D tensor of the requested dtype)."""

    tensor: torch.Tensor | None

    def test(self) -> bool: ...


class Backend(Protocol):
    """Transport for one group of ranks (a communicator)."""

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

    def isend_any(self, buf: torch.Tensor, peer: int) -> Request:
        """Send buf to ``peer``, which receives it with ``irecv_any`` (not knowing its length):
        MPI's receiver probes for the length, a backend without a probe sends it first."""
        ...

    def irecv_any(self, dtype: torch.dtype, peer: int) -> SizedRequest:
        """Receive the next ``isend_any`` message from ``peer``, whatever its length (the sparse
        allreduce's data-dependent streams); the request's ``tensor`` holds it once complete.
        Ordered with ``irecv`` as MPI orders receives; don't mix the two for one peer at the
        same time."""
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


def bytes_of(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's storage span (tensor must be contiguous)."""
    return tensor.numel() * tensor.element_size()
