"""MPI backend: mpi4py nonblocking collectives on torch tensors, zero-copy.

Buffers are passed to MPI by address (``MPI.buffer.fromaddress``), so any dtype, bfloat16
included, travels without a copy. float16 and bfloat16 reductions use user-defined MPI ops that
reduce with torch (MPI has no 16-bit float types); every other dtype uses MPI's built-in ops.

CUDA tensors: where the MPI library is CUDA-aware (``COMMLAYER_CUDA_AWARE_MPI``, detected by
backends/cuda_aware.py), ``direct_path`` says the backend takes them as they are (device.py's
one decision) and ``_spec`` hands MPI the device buffer (mpi4py reads its
``__cuda_array_interface__``) after a host-side wait on the engine's stream (MPI is
stream-unaware). 16-bit floats stay staged: their user-defined reductions read host memory.
Elsewhere CUDA tensors are staged through pinned host buffers (device.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mpi4py

# The engine finalizes MPI itself at exit, and skips it after a peer died (a pending request on
# a dead peer would make MPI_Finalize hang).
mpi4py.rc.finalize = False
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from commlayer.backends import cuda_aware  # noqa: E402
from commlayer.backends.base import (  # noqa: E402
    COMPLETED,
    DIRECT_PATHS,
    SHARED_MEMORY,
    TWO_LEVEL,
    Path,
    Request,
    sync_before_host_call,
)
from commlayer.backends.peers import PeerTable, me  # noqa: E402
from commlayer.common import config  # noqa: E402
from commlayer.common.errors import CommlayerError  # noqa: E402
from commlayer.common.reduce_ops import ReduceOp  # noqa: E402
from commlayer.common.topology import Topology  # noqa: E402

if TYPE_CHECKING:
    from commlayer.backends.shm import BucketWindow, SharedMemoryAllreduce

log = logging.getLogger("commlayer")

_DTYPES: dict[torch.dtype, MPI.Datatype] = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
    torch.float16: MPI.INT16_T,  # carried as 16-bit words, reduced by _HALF_OPS
    torch.bfloat16: MPI.INT16_T,
}

_ABORT_CODE = 70  # MPI_Abort's exit code: sysexits' EX_SOFTWARE, distinct from a Python error's 1
_P2P_TAG = 7  # the schedules' point-to-point messages (the engine makes no others)

_BUILTIN_OPS = {
    ReduceOp.Sum: MPI.SUM,
    ReduceOp.Average: MPI.SUM,
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Product: MPI.PROD,
}


def _make_half_op(dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
    from commlayer.common.reduce_ops import reduce_into

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        reduce_into(
            torch.frombuffer(inoutbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype), op
        )

    return MPI.Op.Create(reduce, commute=True)


_HALF_OPS: dict[tuple[torch.dtype, ReduceOp], MPI.Op] = {}


def _mpi_op(dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
    if dtype in (torch.float16, torch.bfloat16):
        key = (dtype, ReduceOp.Sum if op == ReduceOp.Average else op)
        if key not in _HALF_OPS:
            _HALF_OPS[key] = _make_half_op(*key)
        return _HALF_OPS[key]
    if dtype == torch.bool:
        return {ReduceOp.Min: MPI.LAND, ReduceOp.Product: MPI.LAND}.get(op, MPI.LOR)
    return _BUILTIN_OPS[op]


# Whether this process's MPI takes CUDA buffers: decided once, by the first backend
# (cuda_aware.decide); None until then.
_cuda_aware: bool | None = None
_DIRECT = Path("host", "cuda-mpi")
_STAGED_DTYPES = (torch.float16, torch.bfloat16)  # reduced by user ops on host memory


def detect_cuda_aware(setting: bool | None) -> tuple[bool, str]:
    """(CUDA-aware, why) for ``COMMLAYER_CUDA_AWARE_MPI``'s value (None: auto; MPI
    initialized)."""
    return cuda_aware.decide(setting, config.mpi_gpu_variables(), cuda_aware.library_queries(MPI))


def _spec(tensor: torch.Tensor, count: int | None = None) -> list[Any]:
    """[buffer, count, datatype] for a contiguous tensor, by address (zero-copy); a CUDA
    tensor's device buffer where the MPI is CUDA-aware."""
    if tensor.is_cuda:
        if not _cuda_aware:  # its address is device memory, which this MPI reads as host memory
            raise ValueError(
                f"the MPI backend moves host memory here (not CUDA-aware: "
                f"COMMLAYER_CUDA_AWARE_MPI); got a tensor on {tensor.device} (collectives stage "
                "CUDA tensors through the host: commlayer/core/device.py)"
            )
        sync_before_host_call(tensor)  # the engine's packs and reductions are done
        raw = tensor.reshape(-1).view(torch.uint8)  # any dtype: MPI reads the bytes
        return [raw, tensor.numel() if count is None else count, _DTYPES[tensor.dtype]]
    nbytes = tensor.numel() * tensor.element_size()
    buf = MPI.buffer.fromaddress(tensor.data_ptr() if nbytes else 0, nbytes)
    return [buf, tensor.numel() if count is None else count, _DTYPES[tensor.dtype]]


def _vspec(tensor: torch.Tensor, counts: Sequence[int]) -> list[Any]:
    displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist()
    buf, _, dtype = _spec(tensor)
    return [buf, (list(counts), displs), dtype]


class _MPIRequest:
    __slots__ = ("_req", "_keep")

    def __init__(self, req: MPI.Request, *keep: Any) -> None:
        self._req = req
        self._keep = keep  # buffers MPI reads or writes until completion

    def test(self) -> bool:
        return bool(self._req.Test())


class _GatherBytesRequest:
    """Two-stage allgather of variable-length byte strings: lengths, then payloads."""

    __slots__ = ("_comm", "_payload", "_lengths", "_req", "_data", "out")

    def __init__(self, comm: MPI.Comm, payload: bytes, out: list[bytes]) -> None:
        self._comm = comm
        self._payload = np.frombuffer(payload, dtype=np.uint8) if payload else np.empty(0, np.uint8)
        self._lengths = np.empty(comm.size, dtype=np.int64)
        mine = np.array([len(payload)], dtype=np.int64)
        self._req = comm.Iallgather([mine, MPI.INT64_T], [self._lengths, MPI.INT64_T])
        self._data: np.ndarray | None = None
        self.out = out

    def test(self) -> bool:
        if not self._req.Test():
            return False
        if self._data is None:
            counts = self._lengths.tolist()
            self._data = np.empty(sum(counts), dtype=np.uint8)
            displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist()
            self._req = self._comm.Iallgatherv(
                [self._payload, MPI.BYTE], [self._data, (counts, displs), MPI.BYTE]
            )
            return self.test()
        offsets = np.concatenate(([0], np.cumsum(self._lengths))).tolist()
        self.out[:] = [self._data[a:b].tobytes() for a, b in zip(offsets[:-1], offsets[1:])]
        return True


class MPIWindow:
    """An MPI-3 shared-memory window (``MPI.Win.Allocate_shared``) in a ``Lock_all`` epoch;
    ``Win.Sync`` (MPI_Win_sync) is the barrier MPI-3's shared-memory model asks for."""

    def __init__(self, comm: MPI.Intracomm, segment: int) -> None:
        self._comm = comm
        self.win = MPI.Win.Allocate_shared(segment, 1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.segments: list[np.ndarray] = []
        for r in range(comm.size):
            mem, _ = self.win.Shared_query(r)
            self.segments.append(np.frombuffer(mem, dtype=np.uint8, count=segment))  # type: ignore[call-overload]

    def sync(self) -> None:
        self.win.Sync()

    def barrier(self) -> None:
        self._comm.Barrier()

    def close(self) -> None:
        self.segments = []
        self.win.Unlock_all()
        self.win.Free()


class MPIBackend:
    """Backend over one MPI communicator."""

    # the window needs every rank on one node (the engine checks ``nodes()``)
    capabilities = frozenset({SHARED_MEMORY, TWO_LEVEL, DIRECT_PATHS})

    def __init__(
        self, comm: MPI.Comm | None = None, timeout_s: float = 60.0, cuda_aware: bool | None = None
    ) -> None:
        """Over ``comm``, or over a duplicate of COMM_WORLD made within ``timeout_s``;
        ``cuda_aware``: COMMLAYER_CUDA_AWARE_MPI's value (None: auto), read by the first
        backend made."""
        global _cuda_aware
        self._comm: MPI.Comm = comm if comm is not None else dup_world(timeout_s)
        if _cuda_aware is None:
            _cuda_aware, self.cuda_aware_reason = detect_cuda_aware(cuda_aware)
        else:
            self.cuda_aware_reason = "decided by the first MPI backend of this process"
        self._rank = self._comm.rank
        self._size = self._comm.size
        self._peers = PeerTable(self._rank, self._comm.allgather(me()))
        self._shm: SharedMemoryAllreduce | None = None
        # per node layout (shm_hierarchical_iallreduce): the backends of my node and across
        self._levels: dict[tuple[int, ...], tuple[MPIBackend, MPIBackend]] = {}
        shared = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        leaders = self._comm.allgather(shared.allreduce(self._rank, op=MPI.MIN))
        shared.Free()
        order = sorted(set(leaders))
        self._nodes = [order.index(leader) for leader in leaders]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def comm(self) -> MPI.Comm:
        return self._comm

    def direct_path(self, where: torch.device, dtype: torch.dtype) -> Path | None:
        """device.py's decision: CUDA tensors go to a CUDA-aware MPI as they are."""
        if where.type == "cuda" and _cuda_aware and dtype not in _STAGED_DTYPES:
            return _DIRECT
        return None

    def iallreduce(self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp) -> Request:
        if self._size == 1 or recv.numel() == 0:
            if send is not None and send.data_ptr() != recv.data_ptr():
                recv.copy_(send)
            return COMPLETED
        sendspec: Any = MPI.IN_PLACE if send is None else _spec(send)
        req = self._comm.Iallreduce(sendspec, _spec(recv), _mpi_op(recv.dtype, op))
        return _MPIRequest(req, send, recv)

    def shm_iallreduce(
        self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp
    ) -> Request:
        """iallreduce through a shared-memory window (every rank on one node; backends/shm.py).
        The window is made at the first call, which every rank reaches together."""
        if self._size == 1 or recv.numel() == 0:
            return self.iallreduce(send, recv, op)
        return self._window().iallreduce(send, recv, op)

    def shm_iallreduce_pieces(
        self,
        sources: list[torch.Tensor],
        outputs: list[torch.Tensor],
        scales: list[float],
        op: ReduceOp,
    ) -> Request:
        """shm_iallreduce of the concatenation of ``sources`` into ``outputs``, output i scaled
        by ``scales[i]`` (SharedMemoryAllreduce.iallreduce_pieces; size >= 2)."""
        return self._window().iallreduce_pieces(sources, outputs, scales, op)

    def shm_hierarchical_iallreduce(
        self,
        send: torch.Tensor | None,
        recv: torch.Tensor,
        op: ReduceOp,
        node_of: Sequence[int],
        inter: Callable[[MPIBackend, torch.Tensor], Request] | None = None,
    ) -> Request:
        """iallreduce in two levels (algorithms/hierarchical.py): a shared-memory window over
        each node of ``node_of`` (the node of every rank: equal nodes, each on one machine), and
        between nodes ``inter(cross, part)``, which allreduces ``part`` in place over ``cross``,
        the backend of the ranks with this rank's index in its node (default: MPI's allreduce).
        The communicators and the window are made at the first call for a layout, which every
        rank reaches together."""
        if self._size == 1 or recv.numel() == 0:
            return self.iallreduce(send, recv, op)
        if len(set(node_of)) == 1:
            return self.shm_iallreduce(send, recv, op)
        node, cross = self._two_levels(tuple(node_of))

        def across(part: torch.Tensor) -> Request:
            return cross.iallreduce(None, part, op) if inter is None else inter(cross, part)

        if node.size == 1:
            if send is not None:
                recv.copy_(send)
            return across(recv)
        return node._window().iallreduce(send, recv, op, across)

    def shm_bucket_window(
        self,
        nbytes: int,
        node_of: Sequence[int] | None = None,
        inter: Callable[[MPIBackend, torch.Tensor, ReduceOp], Request] | None = None,
    ) -> BucketWindow | None:
        """A window whose segments are the planned buckets' memory (backends/shm.py's
        BucketWindow; collective: every rank of this group at the same point). A FileWindow,
        not MPI's: a gradient may view its memory after it is freed (elastic re-formation,
        shutdown), which a mapping outlives and MPI_Win_free does not. None on every rank
        where one rank cannot map one.

        ``node_of`` (the node of every rank, as ``shm_hierarchical_iallreduce``'s): the ranks
        on several nodes, a window over each node's ranks, and a part's slices allreduced
        between nodes by ``inter(cross, slice, op)`` (MPI's allreduce when None) over the ranks
        with this rank's index in its node. Without it, every rank on one node."""
        from commlayer.backends.shm import BucketWindow, FileWindow

        comm = self._comm
        if not comm.allreduce(FileWindow.usable(), op=MPI.LAND):
            return None
        token = comm.bcast(f"{os.getpid()}-{secrets.randbits(62):x}" if self._rank == 0 else None)

        def agree(ok: bool) -> bool:  # over the whole group: every node has one, or none
            return bool(comm.allreduce(ok, op=MPI.LAND))

        rank, size, name = self._rank, self._size, token
        across: Callable[[torch.Tensor, ReduceOp], Request] | None = None
        if node_of is not None and len(set(node_of)) > 1:
            node, cross = self._two_levels(tuple(node_of))
            rank, size, name = node._rank, node._size, f"{token}-n{node_of[self._rank]}"

            def across(part: torch.Tensor, op: ReduceOp) -> Request:
                if inter is None:
                    return cross.iallreduce(None, part, op)
                return inter(cross, part, op)

        try:
            return BucketWindow(
                rank,
                size,
                nbytes,
                lambda segment: FileWindow(rank, size, name, segment, agree),
                token,
                across,
            )
        except OSError as exc:
            log.warning("commlayer: %s; buckets stay in process memory", exc)
            return None

    def _window(self) -> SharedMemoryAllreduce:
        if self._shm is None:
            from commlayer.backends.shm import CHUNK_BYTES, SharedMemoryAllreduce

            assert isinstance(self._comm, MPI.Intracomm)
            comm = self._comm
            self._shm = SharedMemoryAllreduce(
                comm.rank, comm.size, CHUNK_BYTES, lambda segment: MPIWindow(comm, segment)
            )
        return self._shm

    def _two_levels(self, node_of: tuple[int, ...]) -> tuple[MPIBackend, MPIBackend]:
        """(my node's backend, the backend across nodes) for a layout; made once, collectively.
        Every rank checks the whole layout, so all of them raise or none does (no hang)."""
        levels = self._levels.get(node_of)
        if levels is None:
            if len(node_of) != self._size or not Topology(node_of).windows_fit(self._nodes):
                raise ValueError(
                    f"rank {self._rank}: node_of={node_of!r} does not fit a two-level allreduce "
                    f"over {self._size} ranks: it needs a node for every rank, the same number "
                    f"of ranks on every node, and the ranks of a node on one machine (detected "
                    f"nodes: {self._nodes!r})"
                )
            mine = node_of[self._rank]
            local = [r for r, n in enumerate(node_of) if n == mine].index(self._rank)
            node = MPIBackend(self._comm.Split(mine, self._rank))
            cross = MPIBackend(self._comm.Split(local, self._rank))
            levels = self._levels[node_of] = (node, cross)
        return levels

    def iallgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Request:
        req = self._comm.Iallgatherv(_spec(send), _vspec(recv, counts))
        return _MPIRequest(req, send, recv)

    def ibcast(self, buf: torch.Tensor, root: int) -> Request:
        if self._size == 1 or buf.numel() == 0:
            return COMPLETED
        return _MPIRequest(self._comm.Ibcast(_spec(buf), root=root), buf)

    def ialltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> Request:
        req = self._comm.Ialltoallv(_vspec(send, send_counts), _vspec(recv, recv_counts))
        return _MPIRequest(req, send, recv)

    def ireduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp
    ) -> Request:
        if self._size == 1:
            recv.copy_(send[: recv.numel()])
            return COMPLETED
        req = self._comm.Ireduce_scatter(
            _spec(send), _spec(recv), list(counts), _mpi_op(send.dtype, op)
        )
        return _MPIRequest(req, send, recv)

    def isend(self, buf: torch.Tensor, peer: int) -> Request:
        return _MPIRequest(self._comm.Isend(_spec(buf), dest=peer, tag=_P2P_TAG), buf)

    def irecv(self, buf: torch.Tensor, peer: int) -> Request:
        return _MPIRequest(self._comm.Irecv(_spec(buf), source=peer, tag=_P2P_TAG), buf)

    def ibarrier(self) -> Request:
        return _MPIRequest(self._comm.Ibarrier())

    def icontrol(self, words: np.ndarray) -> Request:
        if self._size == 1:
            return COMPLETED
        return _MPIRequest(
            self._comm.Iallreduce(MPI.IN_PLACE, [words, MPI.UINT64_T], MPI.BAND), words
        )

    def iallgather_bytes(self, payload: bytes) -> tuple[Request, list[bytes]]:
        out: list[bytes] = []
        if self._size == 1:
            out.append(payload)
            return COMPLETED, out
        return _GatherBytesRequest(self._comm, payload, out), out

    def split(self, ranks: Sequence[int]) -> MPIBackend | None:
        member = self._rank in ranks
        sub = self._comm.Split(0 if member else MPI.UNDEFINED, self._rank)
        return MPIBackend(sub) if member else None

    def nodes(self) -> list[int]:
        return list(self._nodes)

    def hosts(self) -> list[str]:
        return list(self._peers.hosts)

    def machines(self) -> list[int]:
        return list(self._peers.machines)

    def dead_peers(self) -> list[int]:
        return self._peers.dead()

    def lost_peers(self, error: BaseException) -> tuple[str, list[int]] | None:
        return None  # MPI errors name no peer: a death elsewhere ends the job through mpiexec

    def abort(self, reason: str) -> None:
        # Hydra kills every rank it can reach; a rank on a host cut off from mpiexec aborts on
        # its own, when its own watchdog fires.
        _abort(reason, _ABORT_CODE)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        for level in (level for levels in self._levels.values() for level in levels):
            level.close()
        self._levels.clear()
        if self._comm != MPI.COMM_WORLD and self._comm != MPI.COMM_NULL:
            self._comm.Free()


def start(
    comm: Any, settings: config.Config, launch: config.Launch, join: Any = None
) -> MPIBackend:
    """init()'s backend (registry.Lifecycle): over ``comm``, a communicator or a list of
    COMM_WORLD's ranks (None: all of them)."""
    if isinstance(comm, (list, tuple)):
        ranks = list(comm)
        comm = world_subset(ranks)
        if comm is None:
            raise ValueError(
                f"init(comm={ranks!r}): this process (world rank "
                f"{world_rank()}) is not among those ranks"
            )
    return MPIBackend(comm, settings.init_timeout_s, cuda_aware=settings.cuda_aware_mpi)


def end_job(what: str, exc: BaseException) -> bool:
    """An uncaught exception on this rank aborts the job at exit (registry.Lifecycle)."""
    sys.stderr.write(f"commlayer: {what}; the whole job ends, so that no rank waits for it\n")
    abort_at_exit(what, 130 if isinstance(exc, KeyboardInterrupt) else 1)
    return True


def finish(stopped: bool, peer_died: bool) -> None:
    """After the engine's shutdown (registry.Lifecycle): MPI_Finalize would wait for a dead or
    stuck peer; exiting without it ends the job (mpiexec stops every rank when one exits
    without finalizing)."""
    if peer_died or not stopped:
        skip_finalize()


def finalize() -> None:
    """MPI_Finalize, if MPI is initialized and not yet finalized."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def library_version() -> str:
    """First line of the MPI library's version string (e.g. 'MPICH Version: 5.0.2')."""
    # Open MPI ends the string with a NUL, MPICH pads it with spaces
    return " ".join(MPI.Get_library_version().replace("\x00", " ").splitlines()[0].split())


# How long an aborting rank leaves its launcher to forward what it printed last: MPI_Abort has
# mpiexec (hydra) kill every proxy, and a proxy killed before it read this rank's pipe loses the
# lines that say why (the rank's error and this notice: a fresh CI run lost both, twice).
_FORWARD_S = 0.25


def _abort(reason: str, code: int) -> None:
    # MPI_Abort prints which process aborted; the reason goes first, on this rank's stderr.
    sys.stdout.flush()
    sys.stderr.write(f"commlayer: aborting the job: {reason}\n")
    sys.stderr.flush()
    time.sleep(_FORWARD_S)
    MPI.COMM_WORLD.Abort(code)


_finalize_skipped = False
_abort_at_exit: tuple[str, int] | None = None


def skip_finalize() -> None:
    """Do not call MPI_Finalize at exit (a peer died: it would wait for it forever)."""
    global _finalize_skipped
    _finalize_skipped = True


def abort_at_exit(reason: str, code: int) -> None:
    """End the whole job at exit with MPI_Abort(``code``) instead of MPI_Finalize: this rank
    failed (an uncaught exception), and MPICH's MPI_Finalize waits for every rank to finalize
    too, for ever where one waits on this rank. After the other exit handlers, as
    ``python -m mpi4py`` aborts."""
    global _abort_at_exit
    _abort_at_exit = (reason, code)


def _finalize_at_exit() -> None:
    if _abort_at_exit is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        _abort(*_abort_at_exit)
    if not _finalize_skipped:
        finalize()


atexit.register(_finalize_at_exit)


# The tag of init()'s handshake on COMM_WORLD (below MPI's smallest MPI_TAG_UB, 32767)
_INIT_TAG = 31_919


def dup_world(timeout_s: float) -> MPI.Comm:
    """A duplicate of COMM_WORLD, waiting at most ``timeout_s`` for every rank to ask for one:
    a rank that calls init() alone (its peers did not follow a shutdown() with init(), or
    never call it) gets an error naming it instead of a blocking MPI_Comm_dup for ever.

    First a handshake of point-to-point messages (``_handshake``), which leaves nothing
    pending where it times out, so that MPI_Finalize at exit still meets the other ranks'
    (MPICH's waits for every rank's: a rank that skipped it left its peers waiting in theirs,
    until mpiexec, not always, noticed the exit). Then MPI_Comm_idup, every rank being in
    init(), polled with the same deadline (a stale handshake message of an earlier timed-out
    init() could still let a rank through alone). Polls with a growing sleep (0.1 ms to
    10 ms), not a busy loop."""
    world = MPI.COMM_WORLD
    deadline = time.monotonic() + timeout_s
    if world.size > 1:
        _handshake(world, deadline, timeout_s)
    comm, request = world.Idup()
    if not _poll(request.Test, deadline):
        skip_finalize()  # MPI_Finalize would wait for the pending duplicate
        raise _init_alone(timeout_s, "")
    return comm


def _poll(done: Callable[[], bool], deadline: float) -> bool:
    """Call ``done`` until it says True (True) or ``deadline`` (time.monotonic()) passes
    (False), with a growing sleep between calls (0.1 ms to 10 ms), not a busy loop."""
    pause_s = 1e-4
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 0.01)
    return True


def _handshake(world: MPI.Comm, deadline: float, timeout_s: float) -> None:
    """Every rank tells rank 0 it is in init(); rank 0, once all have, tells every rank to go
    on. Small messages (sent eagerly: nothing left pending on the sender) and probes."""
    if world.rank == 0:
        missing = set(range(1, world.size))
        status = MPI.Status()

        def all_arrived() -> bool:
            while world.Iprobe(source=MPI.ANY_SOURCE, tag=_INIT_TAG, status=status):
                source = status.Get_source()
                world.recv(source=source, tag=_INIT_TAG)
                missing.discard(source)
            return not missing

        if not _poll(all_arrived, deadline):
            raise _init_alone(timeout_s, f" (rank(s) {sorted(missing)} did not)")
        for rank in range(1, world.size):
            _send(world, rank, deadline, timeout_s)
        return
    _send(world, 0, deadline, timeout_s)
    if not _poll(lambda: bool(world.Iprobe(source=0, tag=_INIT_TAG)), deadline):
        raise _init_alone(timeout_s, " (rank 0 did not say every rank had)")
    world.recv(source=0, tag=_INIT_TAG)


def _send(world: MPI.Comm, dest: int, deadline: float, timeout_s: float) -> None:
    request = world.isend(None, dest=dest, tag=_INIT_TAG)
    if not _poll(request.Test, deadline):  # done at once where sent eagerly
        request.Cancel()
        raise _init_alone(timeout_s, "")


def _init_alone(timeout_s: float, who: str) -> CommlayerError:
    return CommlayerError(
        f"rank {MPI.COMM_WORLD.rank}: init() waited {timeout_s:g} s for the other "
        f"{MPI.COMM_WORLD.size - 1} rank(s) to call init() too{who}; init() is collective: "
        "every rank calls it, also after shutdown() "
        "(COMMLAYER_INIT_TIMEOUT_SECONDS sets the wait)"
    )


def world_subset(ranks: Sequence[int]) -> MPI.Comm | None:
    """A communicator over some of COMM_WORLD's ranks (collective over COMM_WORLD); None on
    ranks not in ``ranks``."""
    member = MPI.COMM_WORLD.rank in ranks
    sub = MPI.COMM_WORLD.Split(0 if member else MPI.UNDEFINED, MPI.COMM_WORLD.rank)
    return sub if member else None


def world_rank() -> int:
    return int(MPI.COMM_WORLD.rank)
