"""torch.distributed backend: the engine's nonblocking operations over a process group.

The engine, its negotiation and every schedule run unchanged over this backend; it is what
``init()`` picks under ``torchrun`` (``COMMLAYER_BACKEND=auto|torch``). What it maps to:

1. Collectives are torch.distributed's own, ``async_op=True`` on gloo: allreduce, broadcast,
   alltoall (``all_to_all_single`` with split sizes), reduce-scatter, barrier. gloo's allgather
   takes equal sizes only, so ``iallgatherv`` pads every rank's part to the largest and copies
   the parts out once it completes. The negotiation's bit vector is an int64 view of the uint64
   words reduced with ``BAND``; int16 (which gloo cannot reduce) travels widened to int32.
   gloo's allreduces are posted through the group's own ``allreduce`` (``_all_reduce``).
2. gloo's point-to-point and reduce-scatter ``Work`` never report completion to
   ``is_completed()`` (only ``wait()`` finishes them), so each backend keeps waiter threads
   that call ``wait()`` on them in the order they were posted (``wait`` releases the GIL) and
   mark each done, one thread per lane: sends, receives, collectives. A send completes only
   once its receiver has posted the receive: a receive waited for behind a send could hold
   back the very post that send waits for, on two ranks at once. Every send of a step is
   posted when the step starts, so a receive needs nothing from its own rank and the receive
   lane always moves. ``test()`` reads the mark: the engine still never blocks on a transfer.
3. CUDA tensors over NCCL (``COMMLAYER_NCCL``): ``start`` makes an NCCL group over the same
   ranks as the gloo one, and every data call goes over the group of its tensor's device type
   (``_data``), the negotiation (``icontrol``, ``iallgather_bytes``, ``ibarrier``) always over
   gloo. ``direct_path`` tells device.py that CUDA tensors come as they are (``"stream"``: NCCL
   orders its work after the engine thread's current stream, so the engine makes that stream
   wait on the producer's event, no host wait). NCCL's Works report completion to
   ``is_completed()`` (its kernels' events), so they are polled like the collectives, no
   waiter thread. bool and int16 CUDA tensors stay staged (no NCCL reduction for them).
4. Ranks are this group's ranks; torch.distributed calls take the group rank through
   ``group_src``/``group_dst``. ``nodes()`` groups ranks by host name; ``dead_peers()`` checks
   the pids of peers on this host, as the MPI backend does, and ``lost_peers(error)`` names the
   host and ranks whose address a transport error gives (gloo's "Connection closed by peer
   [addr]:port", the only word of a death on another host). ``abort()`` ends this process with
   exit code 70 (the MPI backend's MPI_Abort code): torchrun's agent then stops every other
   rank and reports the failure.
5. Under torchrun, init() starts torch.distributed in a namespace of torchrun's store of its
   own (``start``): the store outlives shutdown() and the workers torchrun restarts.
6. Where every rank is on one machine (``window_capable``, the same on every rank: from the
   start-up gather), allreduces that the engine runs as ``shm`` go through a shared-memory
   window (backends/shm.py's FileWindow: files in /dev/shm, unlinked once mapped) as over MPI,
   not through gloo's TCP over loopback: the MLP of benchmarks/train.py paired with DDP under
   torchrun, 2 cores, 0.88-0.94 of DDP's throughput through gloo and 1.08-1.14 through the
   window at 2 ranks, 0.89 and 1.12 at 4 (benchmarks/README.md).
   The negotiation's bit vector goes through the same window (``icontrol``: a byte per bit,
   reduced by minimum), not through a gloo allreduce: every cycle of every step waits on it.
7. This module is commlayer's one adapter over torch.distributed: besides the engine's
   backend it has :class:`GroupTransport`, a process group's collectives as torch futures
   (the communicator's transport of the DDP hook, integrations/ddp.py, over gloo or NCCL,
   which needs no ``commlayer.init()``), and the groups that the hook's per-host path makes
   (``world_group``, ``host_nodes``). Both post gloo's allreduces through the group's own call
   (``post_all_reduce``) and pack several tensors into one flat buffer the same way
   (``flat_of``, ``unflatten``).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from commlayer.backends.base import (
    COMPLETED,
    DIRECT_PATHS,
    PROGRESS_THREADS,
    SHARED_MEMORY,
    Path,
    Request,
)
from commlayer.backends.peers import PeerTable, addresses, indices, me
from commlayer.backends.shm import CHUNK_BYTES, BucketWindow, FileWindow, SharedMemoryAllreduce
from commlayer.common import config, topology
from commlayer.common.config import Config, Launch
from commlayer.common.errors import CommlayerError, RankDiedError
from commlayer.common.reduce_ops import ReduceOp, scale_into

# torch 2.13 renamed all_gather_into_tensor (now deprecated there); torch 2.1-2.12 have only it.
log = logging.getLogger("commlayer")

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_ABORT_CODE = 70  # as the MPI backend's MPI_Abort: sysexits' EX_SOFTWARE
_P2P_TAG = 7  # the schedules' point-to-point messages

_OPS = {
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Average: dist.ReduceOp.SUM,  # the engine applies the scale
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}
# dtypes gloo cannot reduce, and the dtype they travel as for a reduction
_WIDENED = {torch.int16: torch.int32}
_NCCL = Path("stream", "nccl")
_NOT_NCCL = (torch.bool, torch.int16)  # staged over gloo: NCCL has no reduction for them


def _op(op: ReduceOp) -> Any:
    return _OPS[op]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (a view): what moves when nothing is reduced, whatever the dtype
    (gloo moves no int16, for one)."""
    return tensor.reshape(-1).view(torch.uint8)


def post_all_reduce(tensor: torch.Tensor, op: Any, group: Any, direct: bool) -> Any:
    """``dist.all_reduce(tensor, op, group, async_op=True)``'s Work; ``direct`` (a gloo group):
    through the group's own call, without torch.distributed's Python layer around it (its
    checks and logging decorators: ~40 us a call, and the engine makes two calls an
    operation, the negotiation's and the data's). The same reduction either way."""
    if not direct:
        return dist.all_reduce(tensor, op, group=group, async_op=True)
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return group.allreduce([tensor], options)


def flat_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One buffer that carries ``tensors``: the tensor itself where there is one contiguous
    tensor (moved in place), else their concatenation (``unflatten`` copies it back)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0]
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Each tensor of ``tensors`` overwritten with its part of ``flat`` (``flat_of``'s)."""
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(part.view(tensor.shape))


class _WorkRequest:
    """A torch.distributed collective in flight (its Work reports completion); ``after`` runs
    once, on completion, on the engine thread (copies out of a padded or widened buffer)."""

    __slots__ = ("_work", "_keep", "_after", "_done")

    def __init__(self, work: Any, *keep: Any, after: Any = None) -> None:
        self._work, self._keep, self._after, self._done = work, keep, after, False

    def test(self) -> bool:
        if self._done:
            return True
        if not self._work.is_completed():
            return False
        self._work.wait()  # raises the collective's error, if it failed
        if self._after is not None:
            self._after()
        self._done = True
        return True


class _WaitedRequest:
    """A Work that does not report completion to ``is_completed()`` (gloo's point-to-point and
    reduce-scatter), completed by the backend's waiter thread; ``after`` as in _WorkRequest."""

    __slots__ = ("work", "keep", "done", "error", "_after")

    def __init__(self, work: Any, *keep: Any, after: Any = None) -> None:
        self.work, self.keep, self._after = work, keep, after
        self.done = False
        self.error: BaseException | None = None

    def test(self) -> bool:
        if self.error is not None:
            raise CommlayerError(f"torch.distributed operation failed: {self.error}") from (
                self.error
            )
        if self.done and self._after is not None:
            after, self._after = self._after, None
            after()
        return self.done


class _Waiter:
    """One thread that waits on point-to-point Works in posting order (see the module's 2.)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_WaitedRequest | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, request: _WaitedRequest) -> _WaitedRequest:
        self._queue.put(request)
        return request

    def _run(self) -> None:
        while True:
            request = self._queue.get()
            if request is None:
                return
            try:
                request.work.wait()
                request.done = True
            except BaseException as error:  # handed to the engine thread through test()
                request.error = error
            request.work = None  # drop the Work (and its buffers' references) now

    def stop(self) -> None:
        self._queue.put(None)


class _GatherBytesRequest:
    """Allgather of variable-length byte strings: the lengths, then the padded payloads."""

    __slots__ = ("_backend", "_mine", "_lengths", "_lengths_req", "_data_req", "_data", "out")

    def __init__(self, backend: TorchBackend, payload: bytes, out: list[bytes]) -> None:
        self._backend, self.out = backend, out
        self._mine = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else (torch.empty(0, dtype=torch.uint8))
        )
        self._lengths = torch.empty(backend.size, dtype=torch.int64)
        # the negotiation's: over gloo's group whatever group moves CPU data (module docstring,
        # 3.), so that every rank takes the same group whatever its data routing
        self._lengths_req = backend._gather_equal(
            torch.tensor([len(payload)], dtype=torch.int64), self._lengths, backend._group
        )
        self._data_req: Request | None = None
        self._data = torch.empty(0, dtype=torch.uint8)

    def test(self) -> bool:
        if self._data_req is None:
            if not self._lengths_req.test():
                return False
            counts = self._lengths.tolist()
            self._data = torch.empty(sum(counts), dtype=torch.uint8)
            self._data_req = self._backend.iallgatherv(
                self._mine, self._data, counts, self._backend._group
            )
        if not self._data_req.test():
            return False
        data, counts = self._data.numpy(), self._lengths.tolist()
        offsets = np.concatenate(([0], np.cumsum(counts))).tolist()
        self.out[:] = [data[a:b].tobytes() for a, b in zip(offsets[:-1], offsets[1:])]
        return True


class _Peer(NamedTuple):
    """What every rank tells the others at start (gathered as a plain tuple)."""

    host: str
    pid: int
    machine: str
    gpus: int
    addresses: Sequence[str]
    cpus: int
    window: bool  # FileWindow.usable(): this rank can map a shared-memory window


_CAPABILITIES = frozenset({DIRECT_PATHS, PROGRESS_THREADS})


class TorchBackend:
    """Backend over one torch.distributed process group (gloo)."""

    # transfers progress on gloo's threads, not on the engine's tests: the engine's wait policy
    # counts a core for them (engine._passive)
    progress_threads = 1

    def __init__(self, group: Any = None, data: dict[str, Any] | None = None) -> None:
        """Over ``group`` (default: the default process group, which must be initialized);
        ``data``: the groups that move the tensors of a device type instead ("cuda": an NCCL
        group over the same ranks; module docstring, 3.)."""
        if not dist.is_initialized():
            raise CommlayerError(
                "the torch backend needs torch.distributed initialized "
                "(torch.distributed.init_process_group, or a torchrun launch)"
            )
        self._group: Any = group if group is not None else dist.group.WORLD
        backend_name = dist.get_backend(self._group)
        if backend_name != "gloo":
            raise CommlayerError(
                f"the torch backend runs over a gloo process group (the negotiation is on the "
                f"CPU); got {backend_name!r}"
            )
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        gathered: list[Any] = [None] * self._size
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        mine = _Peer(*me(), gpus, addresses(), os.cpu_count() or 1, FileWindow.usable())
        dist.all_gather_object(gathered, tuple(mine), group=self._group)
        peers = [_Peer(*fields) for fields in gathered]
        self._peers = PeerTable(
            self._rank,
            [(peer.host, peer.pid, peer.machine) for peer in peers],
            [peer.addresses for peer in peers],
        )
        self._machines = self._peers.machines
        self._gpus = {peer.host: peer.gpus for peer in peers}
        # some machine runs more of this group's ranks than it has cores (every rank alike)
        ranks_on = [self._machines.count(m) for m in self._machines]
        self._oversubscribed = any(n > peer.cpus for n, peer in zip(ranks_on, peers))
        self._nodes = indices(self._peers.hosts)
        # the shared-memory window (backends/shm.py) where every rank is on one machine and can
        # map one; made at the first call that uses it (every rank alike), None until then
        self.window_capable = (
            len(set(self._nodes)) == 1
            and len(set(self._machines)) == 1
            and all(peer.window for peer in peers)
        )
        # SHARED_MEMORY where the window can be made (its making may still fail: then
        # shm_iallreduce runs over gloo)
        self.capabilities = _CAPABILITIES | (
            {SHARED_MEMORY} if self.window_capable else frozenset()
        )
        self._shm: SharedMemoryAllreduce | None = None
        # one waiter per lane (module docstring, 2.): a send waits for its receiver to post:
        # in one lane a send waited for first would hold back that receive, on both ranks
        self._waiters = {
            lane: _Waiter(f"commlayer-{lane}-{self._rank}") for lane in ("send", "recv", "coll")
        }
        self._data: dict[str, Any] = {}
        self._polled: set[int] = set()  # ids of data groups whose Works report completion
        for kind, data_group in (data or {}).items():
            self.add_data_group(kind, data_group)

    def add_data_group(self, device_type: str, group: Any) -> None:
        """Move the tensors of ``device_type`` over ``group`` (same ranks, same order); tests
        route CPU tensors over a second gloo group this way (tests/parallel/test_device.py)."""
        self._data[device_type] = group
        if dist.get_backend(group) == "nccl":
            self._polled.add(id(group))

    def direct_path(self, where: torch.device, dtype: torch.dtype) -> Path | None:
        """device.py's decision: CUDA tensors go to the NCCL group as they are."""
        if where.type == "cuda" and "cuda" in self._data and dtype not in _NOT_NCCL:
            return _NCCL
        return None

    def _on(self, tensor: torch.Tensor) -> Any:
        """The group that moves ``tensor``: its device type's data group, else gloo's."""
        return self._data.get(tensor.device.type, self._group) if self._data else self._group

    def _lane(self, group: Any, lane: str, work: Any, *keep: Any, after: Any = None) -> Request:
        """A Work as a Request: polled where it reports completion (NCCL), else completed by
        the waiter thread of ``lane`` (module docstring, 2.)."""
        if id(group) in self._polled:
            return _WorkRequest(work, *keep, after=after)
        return self._waiters[lane].add(_WaitedRequest(work, *keep, after=after))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def group(self) -> Any:
        return self._group

    # -- collectives --------------------------------------------------------------------------
    def iallreduce(self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp) -> Request:
        if send is not None and send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        if self._size == 1 or recv.numel() == 0:
            return COMPLETED
        wide = _WIDENED.get(recv.dtype)
        group = self._on(recv)
        if wide is None:
            return _WorkRequest(self._all_reduce(recv, _op(op), group), recv)
        widened = recv.to(wide)
        work = self._all_reduce(widened, _op(op), group)
        return _WorkRequest(work, widened, after=lambda: recv.copy_(widened))

    def shm_iallreduce(
        self, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp
    ) -> Request:
        """iallreduce through the shared-memory window (``window_capable``: every rank on one
        machine; backends/shm.py), made at the first call, which every rank reaches together
        (an allreduce that the engine's agreed plan runs through the window)."""
        usable = self._size > 1 and recv.numel() and recv.device.type == "cpu"
        window = self._window() if usable else None
        if window is None:
            return self.iallreduce(send, recv, op)
        return window.iallreduce(send, recv, op)

    def shm_iallreduce_pieces(
        self,
        sources: list[torch.Tensor],
        outputs: list[torch.Tensor],
        scales: list[float],
        op: ReduceOp,
    ) -> Request:
        """shm_iallreduce of the concatenation of ``sources`` into ``outputs``, output i scaled
        by ``scales[i]`` (SharedMemoryAllreduce.iallreduce_pieces; size >= 2). Where the
        window could not be made: packed and reduced over gloo, waited for here, each output
        scaled as the window scales it (``scale_into``: the same bits)."""
        window = self._window()
        if window is not None:
            return window.iallreduce_pieces(sources, outputs, scales, op)
        buf = torch.cat([t.reshape(-1) for t in sources])
        self._finish(self._all_reduce(buf, _op(op), self._group))
        at = 0
        for out, scale in zip(outputs, scales):
            part = buf[at : at + out.numel()].view_as(out)
            out.copy_(part) if scale == 1.0 else scale_into(part, scale, out)
            at += out.numel()
        return COMPLETED

    def _window(self) -> SharedMemoryAllreduce | None:
        """The window, made at the first call (every rank together); None where it cannot be
        (not ``window_capable``, or a rank's tmpfs too small: every rank agrees, warns once
        and keeps to gloo)."""
        if self._shm is None and self.window_capable:
            name = self._token()
            try:
                self._shm = SharedMemoryAllreduce(
                    self._rank,
                    self._size,
                    CHUNK_BYTES,
                    lambda segment: FileWindow(self._rank, self._size, name, segment, self._agree),
                )
            except OSError as exc:
                self.window_capable = False
                log.warning("commlayer: %s; allreduces stay on gloo", exc)
        return self._shm

    def shm_bucket_window(self, nbytes: int) -> BucketWindow | None:
        """A window whose segments are the planned buckets' memory (backends/shm.py's
        BucketWindow; collective: every rank of this group at the same point). None on every
        rank where it cannot be made (not ``window_capable``, a tmpfs too small)."""
        if not self.window_capable:
            return None
        name = self._token()
        try:
            return BucketWindow(
                self._rank,
                self._size,
                nbytes,
                lambda segment: FileWindow(self._rank, self._size, name, segment, self._agree),
                name,
            )
        except OSError as exc:
            log.warning("commlayer: %s; buckets stay in process memory", exc)
            return None

    def _token(self) -> str:
        """A name new to a window, the same on every rank (rank 0's, broadcast)."""
        token = torch.zeros(2, dtype=torch.int64)
        if self._rank == 0:
            token[0] = secrets.randbits(62)
            token[1] = os.getpid()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._finish(self._group.broadcast([token], options))
        return f"{int(token[1])}-{int(token[0]):x}"

    def _agree(self, ok: bool) -> bool:
        """True on every rank when every rank passes True (blocking; the window's making)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._finish(self._group.allreduce([flag], options))
        return bool(flag.item())

    def _finish(self, work: Any) -> None:
        """``work.wait()`` for a collective the engine thread blocks on (the window's making,
        a fallback reduction), which a dead peer cannot hold for ever: polled, with this
        backend's peer check every PEER_CHECK_S (RankDiedError naming them), as the engine
        checks while it waits on a request. A gloo collective with a peer that died before
        connecting waits out the whole process-group timeout otherwise (an elastic worker's
        first sync hung there, benchmarks/elastic_recovery.py --changes)."""
        delay, check = 1e-4, time.monotonic() + PEER_CHECK_S
        while not work.is_completed():
            time.sleep(delay)
            delay = min(2 * delay, 0.01)  # ~1 ms of sleeping per call's first ms, then 10 ms
            if time.monotonic() >= check:
                dead = self.dead_peers()
                if dead:
                    raise RankDiedError(
                        f"rank {self._rank}: rank(s) {dead} exited while this rank waited on them"
                    )
                check = time.monotonic() + PEER_CHECK_S
        work.wait()  # raises the collective's error, if it failed

    def _all_reduce(self, tensor: torch.Tensor, op: Any, group: Any) -> Any:
        """``dist.all_reduce(async_op=True)``; on gloo the group's own call
        (``post_all_reduce``)."""
        return post_all_reduce(tensor, op, group, direct=id(group) not in self._polled)

    def _gather_equal(
        self, send: torch.Tensor, recv: torch.Tensor, group: Any | None = None
    ) -> Request:
        """recv <- every rank's send (all the same length), in rank order; over ``group``, or
        the group of ``recv``'s device type."""
        if self._size == 1:
            recv.copy_(send)
            return COMPLETED
        on = self._on(recv) if group is None else group
        work = _all_gather_single(recv, send, group=on, async_op=True)
        return _WorkRequest(work, send, recv)

    def iallgatherv(
        self,
        send: torch.Tensor,
        recv: torch.Tensor,
        counts: Sequence[int],
        group: Any | None = None,
    ) -> Request:
        """``group``: as ``_gather_equal``'s (the negotiation's payloads: always gloo's)."""
        send, recv, item = _raw(send), _raw(recv), send.element_size()
        counts = [c * item for c in counts]
        if self._size == 1:
            recv[: send.numel()].copy_(send)
            return COMPLETED
        if len(set(counts)) == 1:
            return self._gather_equal(send, recv, group)
        width = max(counts)
        padded = torch.zeros(width, dtype=torch.uint8, device=recv.device)
        padded[: send.numel()].copy_(send)
        gathered = torch.empty(width * self._size, dtype=torch.uint8, device=recv.device)

        def unpad() -> None:
            rows = gathered.view(self._size, width)
            offset = 0
            for r, count in enumerate(counts):
                recv[offset : offset + count].copy_(rows[r, :count])
                offset += count

        on = self._on(recv) if group is None else group
        work = _all_gather_single(gathered, padded, group=on, async_op=True)
        return _WorkRequest(work, padded, gathered, recv, after=unpad)

    def ibcast(self, buf: torch.Tensor, root: int) -> Request:
        if self._size == 1 or buf.numel() == 0:
            return COMPLETED
        raw = _raw(buf)
        work = dist.broadcast(raw, group=self._on(raw), group_src=root, async_op=True)
        return _WorkRequest(work, raw)

    def ialltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> Request:
        item = send.element_size()
        send, recv = _raw(send), _raw(recv)
        if self._size == 1:
            recv[: send.numel()].copy_(send[: recv.numel()])
            return COMPLETED
        work = dist.all_to_all_single(
            recv,
            send,
            [c * item for c in recv_counts],
            [c * item for c in send_counts],
            group=self._on(recv),
            async_op=True,
        )
        return _WorkRequest(work, send, recv)

    def ireduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp
    ) -> Request:
        counts = list(counts)
        if self._size == 1:
            recv.copy_(send[: recv.numel()])
            return COMPLETED
        # gloo's reduce-scatter Work never reports completion: the waiter thread waits on it
        wide = _WIDENED.get(send.dtype)
        group = self._on(send)
        if len(set(counts)) == 1 and wide is None:
            work = dist.reduce_scatter_tensor(
                recv, send[: sum(counts)], _op(op), group=group, async_op=True
            )
            return self._lane(group, "coll", work, send, recv)
        # uneven blocks (or a dtype gloo cannot reduce): one list entry per rank's block
        dtype = wide or send.dtype
        blocks = list(send[: sum(counts)].to(dtype).split(counts))
        out = torch.empty(counts[self._rank], dtype=dtype, device=send.device)
        work = dist.reduce_scatter(out, blocks, _op(op), group=group, async_op=True)
        return self._lane(group, "coll", work, blocks, out, after=lambda: recv.copy_(out))

    def ibarrier(self) -> Request:
        if self._size == 1:
            return COMPLETED
        token = torch.zeros(1, dtype=torch.int32)
        return _WorkRequest(self._all_reduce(token, dist.ReduceOp.SUM, self._group), token)

    def icontrol(self, words: np.ndarray) -> Request:
        if self._size == 1:
            return COMPLETED
        window = self._window() if self.window_capable else None
        if window is not None:
            # the window has no bitwise AND: one byte per bit, and the minimum of 0/1 bytes
            # is their AND (304 B of words: 2,432 B; module docstring, 6.)
            bits = torch.from_numpy(np.unpackbits(words.view(np.uint8)))

            def pack() -> None:
                words.view(np.uint8)[:] = np.packbits(bits.numpy())

            return _Then(window.iallreduce(None, bits, ReduceOp.Min), pack)
        view = torch.from_numpy(words.view(np.int64))  # shares memory: reduced in place
        work = self._all_reduce(view, dist.ReduceOp.BAND, self._group)
        return _WorkRequest(work, view, words)

    def iallgather_bytes(self, payload: bytes) -> tuple[Request, list[bytes]]:
        out: list[bytes] = []
        if self._size == 1:
            out.append(payload)
            return COMPLETED, out
        return _GatherBytesRequest(self, payload, out), out

    # -- point to point -----------------------------------------------------------------------
    def _p2p(self, call: Any, buf: torch.Tensor, peer: int) -> Request:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(
                f"rank {self._rank}: peer {peer} is not another rank of [0, {self._size})"
            )
        key = "group_dst" if call is dist.isend else "group_src"
        group = self._on(buf)
        work = call(_raw(buf), group=group, tag=_P2P_TAG, **{key: peer})
        return self._lane(group, "send" if call is dist.isend else "recv", work, buf)

    def isend(self, buf: torch.Tensor, peer: int) -> Request:
        if buf.numel() == 0:
            return COMPLETED
        return self._p2p(dist.isend, buf, peer)

    def irecv(self, buf: torch.Tensor, peer: int) -> Request:
        if buf.numel() == 0:
            return COMPLETED
        return self._p2p(dist.irecv, buf, peer)

    # -- groups and the job -------------------------------------------------------------------
    def split(self, ranks: Sequence[int]) -> TorchBackend | None:
        members = [dist.get_global_rank(self._group, r) for r in ranks]

        def group(backend: str) -> Any:
            if self._size == dist.get_world_size():  # every process takes part, as new_group asks
                return dist.new_group(members, backend=backend)
            # only the members of a smaller group meet
            return dist.new_group(members, backend=backend, use_local_synchronization=True)

        if self._size != dist.get_world_size() and self._rank not in ranks:
            return None
        sub = group("gloo")
        data = {kind: group(dist.get_backend(g)) for kind, g in self._data.items()}
        return TorchBackend(sub, data) if self._rank in ranks else None

    def nodes(self) -> list[int]:
        return list(self._nodes)

    def oversubscribed(self) -> bool:
        """Whether some machine runs more of this group's ranks than it has cores: the same
        answer on every rank (each rank's core count travels in the start-up gather), for
        decisions that change which collectives every rank posts (runners/allreduce.py, 3.)."""
        return self._oversubscribed

    def crowded_hosts(self) -> list[str]:
        """Hosts running more of this group's ranks than they have GPUs ("host: n ranks, m
        GPUs"), the same list on every rank."""
        hosts = self.hosts()
        return [
            f"{host}: {hosts.count(host)} ranks, {gpus} GPUs"
            for host, gpus in sorted(self._gpus.items())
            if hosts.count(host) > gpus
        ]

    def hosts(self) -> list[str]:
        return list(self._peers.hosts)

    def machines(self) -> list[int]:
        return list(self._machines)

    def dead_peers(self) -> list[int]:
        return self._peers.dead(_reported_dead)

    def lost_peers(self, error: BaseException) -> tuple[str, list[int]] | None:
        """(host, its ranks) when ``error`` is a transport error naming a peer's address (gloo:
        "Connection closed by peer [10.213.0.2]:59012", as soon as a process there exits, on
        whatever host); None when it names none. The engine's error then says who."""
        return self._peers.lost(error)

    def abort(self, reason: str) -> None:
        sys.stderr.write(f"commlayer: aborting the job (rank {self._rank}): {reason}\n")
        sys.stderr.flush()
        os._exit(_ABORT_CODE)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        for waiter in self._waiters.values():
            waiter.stop()
        for group in (self._group, *self._data.values()):
            if group is not dist.group.WORLD and dist.is_initialized():
                dist.destroy_process_group(group)


class _Then:
    """A request and what runs once, on the engine thread, when it completes."""

    __slots__ = ("_request", "_after")

    def __init__(self, request: Request, after: Callable[[], None]) -> None:
        self._request: Request | None = request
        self._after = after

    def test(self) -> bool:
        if self._request is None:
            return True
        if not self._request.test():
            return False
        self._request = None
        self._after()
        return True


class GroupTransport:
    """torch.distributed's collectives of a process group as a communicator's transport
    (comm/communicator.py's ``Transport``: the DDP hook's, integrations/ddp.py), each
    returning a torch future; over gloo on CPU, NCCL on GPU, with no commlayer engine.

    gloo needs every rank to launch collectives in the same order, which callbacks do not
    keep: a multi-round compressor's earlier rounds are waited for by the caller
    (``chains_rounds``, ddp.py's docstring)."""

    __slots__ = ("group", "rank", "size", "_direct")
    chains_rounds = False

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._direct = dist.get_backend(group) == "gloo"  # post_all_reduce's fast path

    def allreduce_(
        self, tensors: list[torch.Tensor], name: str, op: ReduceOp, prescale: float,
        postscale: float,
    ) -> torch.futures.Future[Any]:  # fmt: skip
        """Sum every tensor over the group in one allreduce, written back in place (PowerSGD
        keeps the reduced Q it sent as its next warm start)."""
        if op != ReduceOp.Sum or prescale != 1.0 or postscale != 1.0:
            raise ValueError(f"the DDP hook sums pre-divided buckets; got {op.name} for {name!r}")
        flat = flat_of(tensors)
        # torch's Python layer reduces a complex tensor as its real view: left to it
        direct = self._direct and not flat.is_complex()
        work = post_all_reduce(flat, dist.ReduceOp.SUM, self.group, direct)
        future: torch.futures.Future[Any] = work.get_future()
        if flat is tensors[0]:
            return future
        return future.then(lambda _: unflatten(flat, tensors))

    def broadcast_(
        self, tensors: list[torch.Tensor], root: int, name: str
    ) -> torch.futures.Future[Any]:
        """Each tensor overwritten with the group's rank ``root``'s, in one broadcast (a flat
        copy where there are several)."""
        source = dist.get_global_rank(self.group, root)
        flat = flat_of(tensors)
        future = dist.broadcast(flat, source, group=self.group, async_op=True).get_future()
        if flat is tensors[0]:
            return future
        return future.then(lambda _: unflatten(flat, tensors))

    def allgather_bytes(self, record: torch.Tensor, name: str) -> torch.futures.Future[Any]:
        """Every rank's record (the same length on every rank for one compressor and bucket)."""
        out = [torch.empty_like(record) for _ in range(self.size)]
        work = dist.all_gather(out, record, group=self.group, async_op=True)
        return work.get_future().then(lambda _: torch.cat(out))

    def sparse(self, *_: Any) -> None:
        """No sparse reduction over torch.distributed: sparse payloads are gathered."""
        return None


# torch.distributed groups made by world_group, by their ranks, per default group (a new
# init_process_group makes a new one): made once, shared by every caller.
_groups: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()


def world_group(ranks: tuple[int, ...]) -> Any:
    """The torch.distributed group of ``ranks`` (of the default group), made the first time
    it is asked for, collectively: every rank of the world asks for every group, in the same
    order (``dist.new_group``'s contract); ranks outside it get torch's non-member marker."""
    known = _groups.setdefault(dist.group.WORLD, {})
    if ranks not in known:
        known[ranks] = dist.new_group(list(ranks))
    return known[ranks]


def host_nodes(group: Any, posed: str) -> list[int]:
    """The node of every rank of the world (a collective over ``group``): as ``posed``
    (COMMLAYER_TOPOLOGY) poses it where it fits the world, else by host name, gathered over
    ``group`` (-1 for ranks outside it)."""
    ranks = dist.get_process_group_ranks(group)
    names: list[Any] = [None] * len(ranks)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    detected = [-1] * dist.get_world_size()
    for rank, node in zip(ranks, indices(names)):
        detected[rank] = node
    if posed:
        try:
            return list(topology.build(posed, len(detected), detected).node_of)
        except ValueError as exc:
            raise ValueError(
                f"rank {dist.get_rank()}: COMMLAYER_TOPOLOGY={posed!r} does not fit the "
                f"{len(detected)} ranks of torch.distributed's world: {exc}"
            ) from None
    return detected


def nccl_wanted(setting: bool | None, cuda: bool, nccl: bool, crowded: list[str]) -> bool:
    """Whether the torch backend moves CUDA tensors over an NCCL group (``COMMLAYER_NCCL``):
    None (auto) when torch has CUDA and NCCL and no host runs more ranks than it has GPUs
    (``crowded`` names those hosts: NCCL refuses two ranks on one GPU); True the same, or an
    error saying what is missing; False never. The same on every rank (``crowded`` is)."""
    if setting is False:
        return False
    missing = (
        "CUDA (torch.cuda.is_available() is False)"
        if not cuda
        else "NCCL (torch.distributed.is_nccl_available() is False)"
        if not nccl
        else ""
    )
    if setting and missing:
        raise CommlayerError(f"COMMLAYER_NCCL=on, but this torch has no {missing}")
    if setting and crowded:
        raise CommlayerError(
            f"COMMLAYER_NCCL=on, but {'; '.join(crowded)}: NCCL needs a GPU per rank (use "
            "COMMLAYER_NCCL=auto or off to stage CUDA tensors over gloo)"
        )
    return not missing and not crowded


_starts = 0  # torch.distributed started by init() in this process (every rank counts the same)
_owns_default_group = False  # init() initialized torch.distributed (finish() destroys it)


# Ranks of the current world that commlayer's elastic driver reported dead (report_dead):
# dead_peers() names them too, wherever they ran.
_reported_dead: frozenset[int] = frozenset()
PEER_CHECK_S = 0.5  # how often a blocking collective checks for dead peers (``_finish``)


def report_dead(ranks: Sequence[int]) -> None:
    """The elastic driver saw these ranks of the current world exit (commlayer/elastic/
    rendezvous.py); an empty list when a new world starts."""
    global _reported_dead
    _reported_dead = frozenset(ranks) if ranks else frozenset()


def start(
    comm: Any,
    settings: Config,
    launch: Launch,
    join: Callable[[float], None] | None = None,
) -> TorchBackend:
    """The backend init() runs on (registry.Lifecycle); ``join``: the elastic driver's
    rendezvous, which starts torch.distributed over this generation's world.

    Under torchrun, torch.distributed is initialized here from torchrun's variables (gloo,
    the rendezvous waiting ``timeout_s`` for every rank); a plain process with no launcher is a
    one-rank job (an in-memory store). An already initialized torch.distributed is used as it
    is. The engine runs on a gloo group of its own over the same ranks (``comm``: None), over
    the ranks of a list of global ranks, or over a process group passed in."""
    global _owns_default_group
    timeout_s = settings.init_timeout_s
    if join is not None:
        join(timeout_s)
    _owns_default_group = join is not None or not dist.is_initialized()
    if not dist.is_initialized():
        _start_default_group(timeout_s, launch)
    group = comm
    if isinstance(comm, (list, tuple)):
        ranks = list(comm)
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() not in ranks:
            raise ValueError(
                f"init(comm={ranks!r}): this process (rank {dist.get_rank()} of "
                "torch.distributed's default group) is not among those ranks"
            )
    elif comm is None:
        # A group of the engine's own: the user's collectives (DDP's, torch.distributed's) on
        # the default group are issued from other threads in an order the engine cannot know,
        # and gloo matches the collectives of one group by their order. Gloo also when the
        # default group is NCCL: the engine negotiates on the CPU.
        group = dist.new_group(backend="gloo")
    backend = TorchBackend(group)
    cuda = torch.cuda.is_available()
    if nccl_wanted(settings.nccl, cuda, cuda and dist.is_nccl_available(), backend.crowded_hosts()):
        # CUDA tensors over NCCL (module docstring, 3.), over the gloo group's ranks
        ranks = dist.get_process_group_ranks(backend.group)
        every = len(ranks) == dist.get_world_size()
        nccl_group = dist.new_group(ranks, backend="nccl", use_local_synchronization=not every)
        backend.add_data_group("cuda", nccl_group)
    return backend


def _start_default_group(timeout_s: float, launch: Launch) -> None:
    """torch.distributed's default group, started by init(): from torchrun's variables, or
    alone in a plain process (start's docstring)."""
    global _starts
    if launch.launcher == "torchrun":
        _starts += 1
        rank = -1
        try:
            store, rank, world = next(
                dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s))
            )
            # Every init() a namespace of its own in torchrun's store, which outlives it and
            # the workers (restarted by --max-restarts, they find the same store): the keys
            # of the last one (each rank's gloo address) are still there, and a rank that
            # read one connected to a port closed since ("Connection refused", or a hang;
            # plain init_process_group fails so on torchrun's restarts too).
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"commlayer/{launch.attempt}/{_starts}/", store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        except Exception as error:  # torch's own types vary (DistStoreError, RuntimeError)
            if isinstance(error, dist.DistStoreError) and rank >= 0:
                # in torchrun's store, waiting for the others' keys: they never came
                raise CommlayerError(
                    f"rank {rank}: init() waited {timeout_s:g} s for the other "
                    f"{launch.world_size - 1} rank(s) to call init() too; init() is "
                    "collective: every rank calls it, also after shutdown() "
                    f"(COMMLAYER_INIT_TIMEOUT_SECONDS sets the wait; torch.distributed: "
                    f"{error})"
                ) from error
            raise CommlayerError(
                f"init(): torch.distributed could not start (torchrun, WORLD_SIZE="
                f"{launch.world_size}, waited up to {timeout_s:g} s: "
                f"COMMLAYER_INIT_TIMEOUT_SECONDS): {error}"
            ) from error
    elif launch.launcher == "mpi":
        raise CommlayerError(
            "COMMLAYER_BACKEND=torch, but this process was started by mpiexec and "
            "torch.distributed is not initialized: launch with torchrun, call "
            "torch.distributed.init_process_group() before commlayer.init(), or use "
            "COMMLAYER_BACKEND=mpi (or auto)"
        )
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def end_job(what: str, exc: BaseException) -> bool:
    """An uncaught exception on this rank (registry.Lifecycle): it exits at once, its peers
    in collectives get an error naming it, and torchrun's agent stops them (commlayerrun's
    elastic driver instead has the others go on without it)."""
    then = (
        "commlayerrun's elastic driver has the others go on without it"
        if config.elastic_worker() is not None
        else "torchrun's agent then stops them"
    )
    sys.stderr.write(f"commlayer: {what}; this rank exits without waiting for its peers ({then})\n")
    return False


def finish(stopped: bool, peer_died: bool) -> None:
    """After the engine's shutdown (registry.Lifecycle): destroy the default group if init()
    made it (so that init() can start again), else leave torch.distributed to its owner; not
    while the engine thread is still inside a gloo call (not ``stopped``)."""
    if stopped and _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
