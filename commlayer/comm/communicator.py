"""Communicator: compress -> move the payload -> decompress, for the optimizer and the DDP hook.

``Communicator(transport).reduce(tensors, compressor, name)`` returns a future; when it is done
every tensor of ``tensors`` holds its reduction over the transport's ranks (written in place).
Callers choose what to compress and when; how the payload travels is decided here, from what
the compressor declares (compression/base.py):

1. ``summable`` (none, fp16, bf16, randomk, powersgd): each tensor's payload is allreduced in
   place, all of the call's payloads in one grouped operation, then decompressed. A multi-round
   compressor (PowerSGD: ``final=False``, ``next_round``) has its next round sent as the
   previous one completes, named ``<name>.round<k>``. ``Average`` of float16 payloads sums
   values divided before the sum, so n ranks cannot overflow 65504.
2. Not summable (qsgd, topk, efsignsgd, onebit): every payload tensor of the call is packed
   into one byte record (core/wire.py) and gathered; each rank's record is decoded with
   the local context and summed; ``Average`` divides by the records received (a joined rank
   sends none). A peer's malformed payload is a PayloadError naming this rank, the tensor and
   the peer.
3. ``sparse`` payloads (top-k's values and int32 indices) under a sparse algorithm
   (``sparse_algorithm`` other than allgather) are reduced sparse through the engine instead
   (sparse_reduction.py), on the process set's topology; gtopk's dropped entries go to the
   compressor's error feedback.
4. Per host (``per_host=True``, with the ``levels`` of comm/hierarchy.py, where the process
   set spans several hosts): the host's ranks sum the tensors uncompressed, the bucket's
   leader compresses the sum once for the host, the leaders move their payloads among
   themselves as 1.-3. say (``Average`` over the whole set's ranks: ``average_over``), the
   leader decompresses and shares the result inside the host. comm/hierarchy.py has the steps
   and why.
The payload of an ``identity`` compressor (none; auto before it decides) is the tensors
themselves: they are reduced where they lie, with no compress, decompress or callback.

Where compression runs: a transport that has ``defer`` (:class:`EngineTransport`) gets the
compress-and-send of CPU tensors as a task for the engine's thread (``Engine.call_soon``):
``reduce`` returns at once, so the training thread (a gradient hook during backward, the DDP
hook, ``step``'s last bucket) never waits for a compressor; the engine thread compresses,
starts the collectives, and decompresses as they complete, while backward goes on (torch ops
and the numba kernels release the GIL). One thread does all of a compressor's work, in
submission order, so its state (residuals, warm starts, QSGD's call counter) is touched by
one thread and its results are those of compressing on the caller's thread, bit for bit. CUDA
tensors are compressed on the caller's thread: their kernels are queued on the caller's
streams, which is no wait for it. An error of ``compress`` fails the future.

The transport moves bytes and returns futures: :class:`EngineTransport` (commlayer's engine,
on a process set) here, a torch.distributed one in integrations/ddp.py. Rounds chain on the
transport's futures with no thread and no wait, except where a transport cannot take
collectives in an order that differs between ranks (``chains_rounds = False``, gloo): there the
earlier rounds are waited for by the caller, and only the last one is returned as a future.

This module, like sparse_reduction.py, is in the API layer: it moves bytes through the core's
``submit`` (core/submit.py) with tensors it already knows, not through the checking public
collectives of commlayer/ops.py; ``commlayer.compression`` itself does not import it.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from commlayer.comm.sparse_reduction import SparseReduction, engine_algorithm
from commlayer.common.errors import PayloadError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.compression.base import (
    DECOMPRESS_ADD,
    DECOMPRESS_INTO,
    DECOMPRESS_SUM,
    MULTI_ROUND,
    RESIDUALS,
    Compressed,
    Compressor,
    CompressorBase,
    DecompressAdd,
    DecompressInto,
    DecompressSum,
    MultiRound,
    RecordError,
    Residuals,
    declared,
)
from commlayer.compression.factory import create
from commlayer.core import runtime, wire
from commlayer.core.future import Future, combined
from commlayer.core.negotiation import ALLGATHER, ALLREDUCE, BROADCAST
from commlayer.core.process_sets import ProcessSet, global_process_set
from commlayer.core.submit import Request, batch, in_place, in_place_group, submit, topology


class FutureLike(Protocol):
    """What transports return: a commlayer Future or a torch.futures.Future."""

    def wait(self) -> Any: ...

    def value(self) -> Any: ...

    def add_done_callback(self, callback: Callable[[Any], None]) -> None: ...


class Transport(Protocol):
    """How payloads travel among ``size`` ranks (this one ``rank``)."""

    rank: int
    size: int
    chains_rounds: bool  # may a round's collective start from the previous one's callback?

    def allreduce_(
        self, tensors: list[torch.Tensor], name: str, op: ReduceOp, prescale: float,
        postscale: float,
    ) -> FutureLike:  # fmt: skip
        """Reduce each tensor over the ranks, in place."""
        ...

    def allgather_bytes(self, record: torch.Tensor, name: str) -> FutureLike:
        """Every rank's uint8 ``record``, concatenated in rank order."""
        ...

    def broadcast_(self, tensors: list[torch.Tensor], root: int, name: str) -> FutureLike:
        """Each tensor overwritten with rank ``root``'s (of this transport's ranks), in place."""
        ...

    def sparse(
        self, name: str, compressed: Compressed, compressor: CompressorBase, op: ReduceOp
    ) -> FutureLike | None:
        """A ``sparse`` compressor's payload (values, int32 indices) reduced sparse (future of
        the dense result), or None: gather it."""
        ...


class EngineTransport:
    """commlayer's collectives on a process set (the optimizer's transport)."""

    __slots__ = ("rank", "size", "process_set", "sparse_algorithm", "prefix", "_topology")
    chains_rounds = True  # the engine negotiates an order every rank shares

    def __init__(
        self,
        process_set: ProcessSet = global_process_set,
        sparse_algorithm: str = "allgather",
        prefix: str = "",
    ) -> None:
        """``prefix`` goes before every operation name (the DDP hook's ``ddp<id>.``)."""
        self.rank = runtime.rank()
        self.size = process_set.size()
        self.process_set = process_set
        self.sparse_algorithm = sparse_algorithm
        self.prefix = prefix
        self._topology: Topology | None = None

    def allreduce_(
        self, tensors: list[torch.Tensor], name: str, op: ReduceOp, prescale: float,
        postscale: float,
    ) -> Future:  # fmt: skip
        # a future of the list of tensors; plain ones (a bucket's) checked in one pass
        works, finish = in_place_group(tensors, "grouped_allreduce_")
        return submit(
            Request(
                ALLREDUCE, self.prefix + name, works, works, self.process_set, op=op,
                prescale=prescale, postscale=postscale, finish=finish,
            )
        )  # fmt: skip

    def allgather_bytes(self, record: torch.Tensor, name: str) -> Future:
        # a record is a 1-D uint8 tensor (wire.pack)
        return submit(Request(ALLGATHER, self.prefix + name, [record], [], self.process_set))

    def broadcast_(self, tensors: list[torch.Tensor], root: int, name: str) -> Future:
        """One broadcast a tensor (``<name>.<j>``), submitted together."""
        handles = []
        with batch():
            for j, tensor in enumerate(tensors):
                work, finish = in_place(tensor, "broadcast_")
                handles.append(
                    submit(
                        Request(
                            BROADCAST, f"{self.prefix}{name}.{j}", [work], [work],
                            self.process_set, root=root, finish=finish,
                        )
                    )
                )  # fmt: skip
        return combined(name, handles, lambda _: tensors)

    @staticmethod
    def defer(task: Callable[[], None]) -> None:
        """Run ``task`` (compress, then start the collectives) on the engine's thread."""
        runtime.engine().call_soon(task)

    def sparse(
        self, name: str, compressed: Compressed, compressor: CompressorBase, op: ReduceOp
    ) -> Future | None:
        if self.sparse_algorithm == "allgather":
            return None
        values, indices = compressed.payload
        shape = compressed.ctx[0]
        algorithm = engine_algorithm(
            self.sparse_algorithm, self.size, shape.numel(), values.numel()
        )
        if algorithm == "allgather":
            return None
        if self._topology is None:
            self._topology = topology(self.process_set)
        reduction = SparseReduction(
            name, values, indices, shape, algorithm, self.process_set, op,
            sink=cast(Residuals, compressor) if RESIDUALS in compressor.capabilities else None,
            topology=self._topology,
        )  # fmt: skip
        return chain(reduction.handle, reduction.advance, lambda: reduction.value)


class Levels(Protocol):
    """The transports of the per-host path (4.) as this rank sees them (comm/hierarchy.py):
    its host's ranks (None: alone on its host), the ranks of the other hosts with its index on
    theirs (None: this index leads no bucket), that index, and which index leads a bucket."""

    intra: Transport | None
    across: Transport | None
    local_index: int

    def leader(self, name: str) -> int:
        """The local index of the rank that compresses bucket ``name`` on every host."""
        ...


def chain(
    first: FutureLike, advance: Callable[[Any], FutureLike | None], final: Callable[[], Any]
) -> Future:
    """A future over rounds: ``advance(result)`` takes a round's result and returns the next
    round's future, or None when the last is done; the value is then ``final()``. Each round
    is started from the previous one's callback."""
    out = Future()

    def done(fut: Any) -> None:
        try:
            following = advance(fut.value())
        except BaseException as exc:  # noqa: BLE001 - the chained future's outcome
            out.set_exception(exc)
            return
        if following is None:
            _settle(out, final)
        else:
            following.add_done_callback(done)

    first.add_done_callback(done)
    return out


def _settle(out: Future, compute: Callable[[], Any]) -> None:
    try:
        result = compute()
    except BaseException as exc:  # noqa: BLE001 - the future's outcome
        out.set_exception(exc)
    else:
        out.set_result(result)


class Communicator:
    """compress -> move -> decompress (module docstring), over ``transport``.

    ``op``: Average or Sum. ``predivide``: Average divides by this before the sum and by
    size / predivide after (Horovod's gradient_predivide_factor). ``what``: how errors name
    the tensor ("gradient").
    """

    __slots__ = ("transport", "op", "predivide", "what", "levels", "average_over")

    def __init__(
        self,
        transport: Transport,
        op: ReduceOp = ReduceOp.Average,
        predivide: float = 1.0,
        what: str = "tensor",
        levels: Levels | None = None,
        average_over: int | None = None,
    ) -> None:
        """``levels``: the per-host path's transports (4.), None where it does not apply.
        ``average_over``: the ranks ``Average`` divides by (the per-host path's leaders stand
        for all of them); None: the transport's, or the records received."""
        self.transport, self.op, self.predivide, self.what = transport, op, predivide, what
        self.levels = levels
        self.average_over = average_over

    def reduce(
        self,
        tensors: Sequence[torch.Tensor],
        compressor: Compressor | CompressorBase,
        name: str,
        names: Sequence[str] | None = None,
        per_host: bool = False,
    ) -> Future:
        """Reduce ``tensors`` in place; a future whose value is the list of them. Several
        tensors travel together (one collective a round, named ``name``); each is compressed
        alone under its own name (``names``; default ``<name>.p<j>``, or ``name`` for a single
        one), which keys the compressor's state (error-feedback residuals, warm starts).
        ``per_host``: compressed once per host (4.) where this communicator has ``levels``;
        every rank of the process set must pass the same."""
        tensors = list(tensors)
        compressor = declared(compressor)  # itself where made by create (the default)
        # The payload is the tensors: reduce them where they lie ("auto" before or without a
        # decision sends them as they are: compression/auto.py).
        if compressor.identity:
            return self._identity(tensors, name)
        if names is None:
            names = [name] if len(tensors) == 1 else [f"{name}.p{j}" for j in range(len(tensors))]
        names = list(names)
        if per_host and self.levels is not None:
            return self._per_host(tensors, names, compressor, name, self.levels)
        defer = getattr(self.transport, "defer", None)
        if defer is None or any(t.device.type != "cpu" for t in tensors):
            return self._compressed(tensors, names, compressor, name)
        out = Future(name)

        def task() -> None:  # on the engine thread
            try:
                reduced = self._compressed(tensors, names, compressor, name)
            except BaseException as exc:  # noqa: BLE001 - the caller's future's outcome
                out.set_exception(exc)
            else:
                reduced.add_done_callback(functools.partial(_forward, out))

        defer(task)
        return out

    def _compressed(
        self, tensors: list[torch.Tensor], names: list[str], compressor: CompressorBase, name: str
    ) -> Future:
        compressed = [compressor.compress(t, n) for t, n in zip(tensors, names)]
        if compressor.summable:
            return self._summable(tensors, names, compressed, compressor, name)
        return self._gathered(tensors, names, compressed, compressor, name)

    def scaling(self, dtype: torch.dtype) -> tuple[ReduceOp, float, float]:
        """(op, prescale, postscale) of a summed payload of ``dtype``."""
        if self.op != ReduceOp.Average:
            return self.op, 1.0, 1.0
        ranks = self.average_over or self.transport.size
        if dtype == torch.float16:
            # Divide before summing: n float16 gradients can overflow 65504 when summed.
            return ReduceOp.Sum, 1.0 / ranks, 1.0
        if self.average_over is None:  # the engine's Average divides by the set's size
            return self.op, 1.0 / self.predivide, self.predivide
        return ReduceOp.Sum, 1.0 / self.predivide, self.predivide / ranks

    def _divisor(self, records: int) -> float:
        """What ``Average`` divides a gathered sum of ``records`` by."""
        return float(self.average_over or records)

    def _identity(self, tensors: list[torch.Tensor], name: str) -> Future:
        """Uncompressed: one grouped in-place allreduce, no compress, decompress or callback of
        ours (DistributedOptimizer's every bucket: ~50 us of Python a bucket saved on the hook
        thread and as much on the engine's, measured at 4 ranks on the benchmark MLP)."""
        op, prescale, postscale = self.scaling(tensors[0].dtype)
        future = self.transport.allreduce_(tensors, name, op, prescale, postscale)
        if isinstance(future, Future):
            return future  # the engine's: its value is the list of tensors
        return chain(future, lambda _: None, lambda: tensors)

    # -- 1. summable -----------------------------------------------------------------------------
    def _summable(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        compressed: list[Compressed],
        compressor: CompressorBase,
        name: str,
    ) -> Future:
        pending = list(enumerate(compressed))
        for payload in compressed:
            if len(payload.payload) != 1:
                raise ValueError(
                    f"summable compressor {compressor.name!r} returned "
                    f"{len(payload.payload)} payload tensors for {name!r}; a summable payload "
                    "is one tensor"
                )
        round_index = [1]

        def send() -> FutureLike:
            payloads = [c.payload[0] for _, c in pending]
            op, prescale, postscale = self.scaling(payloads[0].dtype)
            label = name if round_index[0] == 1 else f"{name}.round{round_index[0]}"
            return self.transport.allreduce_(payloads, label, op, prescale, postscale)

        def advance(_: Any) -> FutureLike | None:
            more = []
            for j, c in pending:
                if c.final:
                    _decompress_into(compressor, c, tensors[j])
                else:
                    more.append((j, c))
            rounds = [(c, names[j]) for j, c in more]
            following: list[Compressed | None] = []
            if rounds:
                if MULTI_ROUND not in compressor.capabilities:
                    raise TypeError(
                        f"compressor {compressor.name!r} returned a payload that is not final "
                        "but does not declare MULTI_ROUND (next_round)"
                    )
                # PowerSGD: one batched QR
                following = cast(MultiRound, compressor).next_rounds(rounds)
            if any(nxt is None for nxt in following):
                raise RuntimeError(
                    f"compressor {compressor.name!r} ended a round that was not final"
                )
            pending[:] = [(j, nxt) for (j, _), nxt in zip(more, following) if nxt is not None]
            if not pending:
                return None
            round_index[0] += 1
            return send()

        first = send()
        if not self.transport.chains_rounds:
            while any(not c.final for _, c in pending):
                result = first.wait()
                following = advance(result)
                assert following is not None  # a round that was not final has a next one
                first = following
        return chain(first, advance, lambda: tensors)

    # -- 4. per host -------------------------------------------------------------------------------
    def _per_host(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        compressor: CompressorBase,
        name: str,
        levels: Levels,
    ) -> Future:
        """Sum inside the host, compress once on the bucket's leader, exchange among the
        leaders, share inside the host (comm/hierarchy.py): stages started one from the
        previous one's callback, or, where the transport does not chain rounds (gloo), all but
        the share waited for in the caller, which starts every collective of a group in the
        order the other ranks do."""
        lead = levels.local_index == levels.leader(name)
        intra = levels.intra

        def host_sum() -> FutureLike | None:
            if not lead:
                _fold_residuals(compressor, tensors, names)
            if intra is None:
                return None
            return intra.allreduce_(tensors, f"{name}.host", ReduceOp.Sum, 1.0, 1.0)

        def exchange() -> FutureLike | None:
            assert levels.across is not None  # a leading index has its leaders' transport
            across = Communicator(
                levels.across, self.op, self.predivide, self.what,
                average_over=self.transport.size,
            )  # fmt: skip
            return across._compressed(tensors, names, compressor, name)

        def share() -> FutureLike | None:
            if intra is None:
                return None
            return intra.broadcast_(tensors, levels.leader(name), f"{name}.share")

        stages = [host_sum, exchange, share] if lead else [host_sum, share]
        if self.transport.chains_rounds:
            return _staged(name, stages, tensors)
        for stage in stages[:-1]:
            pending = stage()
            if pending is not None:
                pending.wait()
        return _staged(name, stages[-1:], tensors)

    # -- 2. and 3. gathered, or sparse -----------------------------------------------------------
    def _gathered(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        compressed: list[Compressed],
        compressor: CompressorBase,
        name: str,
    ) -> Future:
        parts: list[FutureLike] = []
        rest = []  # tensors not reduced sparse: gathered together
        declared_sparse = compressor.sparse
        # Average over other ranks than the set's (average_over): summed, then scaled
        sparse_op, sparse_scale = self.op, 1.0
        if self.op == ReduceOp.Average and self.average_over is not None:
            sparse_op, sparse_scale = ReduceOp.Sum, 1.0 / self.average_over
        for j, tensor in enumerate(tensors):
            sparse = None
            if declared_sparse:
                sparse = self.transport.sparse(names[j], compressed[j], compressor, sparse_op)
            if sparse is None:
                rest.append(j)
            else:
                write = functools.partial(_write, tensor, scale=sparse_scale)
                parts.append(chain(sparse, write, lambda: None))
        if rest:
            record = wire.pack([t for j in rest for t in compressed[j].payload])
            gathered = self.transport.allgather_bytes(record, name)
            mine = [tensors[j] for j in rest]
            local = [compressed[j] for j in rest]

            def decode(result: Any) -> None:
                self._sum_records(result, mine, local, compressor, name)

            parts.append(chain(gathered, decode, lambda: None))
        return combined(name, parts, lambda _: tensors)

    def _sum_records(
        self,
        gathered: torch.Tensor,
        tensors: list[torch.Tensor],
        compressed: list[Compressed],
        compressor: CompressorBase,
        name: str,
    ) -> None:
        """Decode every rank's record and sum, per tensor, into the tensors."""
        counts = [len(c.payload) for c in compressed]
        dtypes = [t.dtype for c in compressed for t in c.payload]
        try:
            records = wire.split(gathered, dtypes)
        except PayloadError as exc:
            raise self._malformed(name, exc) from None
        start = 0
        for tensor, local, count in zip(tensors, compressed, counts):
            parts = [record[start : start + count] for record in records]
            start += count
            try:
                if not (
                    self._sum_together(tensor, parts, local, compressor)
                    or self._add_records(tensor, parts, local, compressor)
                ):
                    self._sum_dense(tensor, parts, local, compressor)
            except _FromRank as exc:
                raise self._malformed(
                    name, PayloadError(f"{compressor.name} payload from rank {exc.rank}: {exc}")
                ) from None

    def _sum_together(
        self,
        tensor: torch.Tensor,
        parts: list[list[torch.Tensor]],
        local: Compressed,
        compressor: CompressorBase,
    ) -> bool:
        """Every record decoded and summed into ``tensor`` by the compressor's
        ``decompress_sum_`` (QSGD: one write of the tensor, the bits of ``_sum_dense``): False
        where it has none or the tensor is not one flat block."""
        if DECOMPRESS_SUM not in compressor.capabilities or not tensor.is_contiguous():
            return False
        together = cast(DecompressSum, compressor).decompress_sum_
        divisor = self._divisor(len(parts)) if self.op == ReduceOp.Average else 1.0
        try:
            together([Compressed(p, local.ctx) for p in parts], tensor.view(-1), divisor)
        except RecordError as exc:
            raise _FromRank(exc.record, str(exc)) from None
        return True

    def _add_records(
        self,
        tensor: torch.Tensor,
        parts: list[list[torch.Tensor]],
        local: Compressed,
        compressor: CompressorBase,
    ) -> bool:
        """Sum the records into ``tensor`` itself with the compressor's ``decompress_add_``
        (top-k: k entries a record, no dense tensor per rank): False where it has none or the
        tensor is not one flat block. The tensor's own values were read by ``compress``
        already; it is zeroed and each record added, scaled by 1 / records under Average."""
        if DECOMPRESS_ADD not in compressor.capabilities or not tensor.is_contiguous():
            return False
        adding = cast(DecompressAdd, compressor)
        alpha = 1.0 / self._divisor(len(parts)) if self.op == ReduceOp.Average else 1.0
        flat = tensor.view(-1)
        # Check every record before the gradient is touched: a malformed one leaves it as is.
        for source, payload in enumerate(parts):
            try:
                adding.check_payload(Compressed(payload, local.ctx))
            except PayloadError as exc:
                raise _FromRank(source, str(exc)) from None
        flat.zero_()
        for payload in parts:
            adding.decompress_add_(Compressed(payload, local.ctx), flat, alpha)
        return True

    def _sum_dense(
        self,
        tensor: torch.Tensor,
        parts: list[list[torch.Tensor]],
        local: Compressed,
        compressor: CompressorBase,
    ) -> None:
        total: torch.Tensor | None = None
        for source, payload in enumerate(parts):
            try:
                part = compressor.decompress(Compressed(payload, local.ctx))
            except PayloadError as exc:
                raise _FromRank(source, str(exc)) from None
            total = part.clone() if total is None else total.add_(part)
        assert total is not None  # this rank's own record is always there
        if self.op == ReduceOp.Average:
            total.div_(self._divisor(len(parts)))
        _write(tensor, total)

    def _malformed(self, name: str, exc: PayloadError) -> PayloadError:
        return PayloadError(f"rank {self.transport.rank}: {self.what} {name!r}: malformed {exc}")


class _FromRank(PayloadError):
    """A peer's payload refused while summing: which rank sent it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _decompress_into(
    compressor: CompressorBase, compressed: Compressed, tensor: torch.Tensor
) -> None:
    """The reduced payload decompressed into ``tensor``: by the compressor's
    ``decompress_into`` where it has one (casts: one converting copy; PowerSGD: the product
    written in place), else ``decompress`` and a copy."""
    if DECOMPRESS_INTO in compressor.capabilities:
        cast(DecompressInto, compressor).decompress_into(compressed, tensor)
    else:
        _write(tensor, compressor.decompress(compressed))


def _fold_residuals(
    compressor: CompressorBase, tensors: list[torch.Tensor], names: list[str]
) -> None:
    """Before the sum inside the host, on a rank that does not lead the bucket: the residuals
    it keeps for its tensors (error feedback's ``take_residual``: the flat path's, or its own
    from when it led them), added to them so that they are delayed, not lost. A residual is a
    rank's delayed part of the sum on either path, so it goes in as it is."""
    if RESIDUALS not in compressor.capabilities:
        return
    take = cast(Residuals, compressor).take_residual
    for tensor, name in zip(tensors, names):
        kept = take(name)
        if kept is not None and kept.numel() == tensor.numel():
            tensor.add_(kept.to(tensor.device, tensor.dtype).view_as(tensor))


def _staged(name: str, stages: Sequence[Callable[[], FutureLike | None]], result: Any) -> Future:
    """A future of ``result`` once ``stages`` ran in order: each returns the future of what it
    started (the next stage runs from its callback, on the thread that completes it) or None
    when it had nothing to wait for. A stage's error, or its future's, fails the whole."""
    out = Future(name)

    def run(index: int) -> None:
        while index < len(stages):
            try:
                pending = stages[index]()
            except BaseException as exc:  # noqa: BLE001 - the staged future's outcome
                out.set_exception(exc)
                return
            index += 1
            if pending is not None:
                pending.add_done_callback(functools.partial(after, index))
                return
        out.set_result(result)

    def after(index: int, done: Any) -> None:
        try:
            done.wait()  # done: returns at once, or raises the stage's error
        except BaseException as exc:  # noqa: BLE001 - the staged future's outcome
            out.set_exception(exc)
            return
        run(index)

    run(0)
    return out


def _forward(out: Future, done: Any) -> None:
    """``done``'s outcome (a commlayer or torch future) onto ``out``."""
    try:
        result = done.wait()
    except BaseException as exc:  # noqa: BLE001 - the outcome to forward
        out.set_exception(exc)
    else:
        out.set_result(result)


def _write(tensor: torch.Tensor, value: torch.Tensor, scale: float = 1.0) -> None:
    """The reduced value into the caller's tensor (nothing to do when reduced in place),
    times ``scale``."""
    if value is not tensor:
        tensor.copy_(value.reshape(tensor.shape))
    if scale != 1.0:
        tensor.mul_(scale)


class Loopback:
    """A transport that completes every call at once, for measuring the CPU side alone: a
    summable payload is "reduced" as it is, a gathered record comes back ``ranks`` times."""

    chains_rounds = True

    def __init__(self, ranks: int) -> None:
        self.rank, self.size = 0, ranks

    @staticmethod
    def _done(value: Any) -> Future:
        future = Future("loopback")
        future.set_result(value)
        return future

    def allreduce_(
        self, tensors: list[torch.Tensor], name: str, op: ReduceOp, prescale: float,
        postscale: float,
    ) -> Future:  # fmt: skip
        return self._done(tensors)

    def allgather_bytes(self, record: torch.Tensor, name: str) -> Future:
        return self._done(record.repeat(self.size))

    def broadcast_(self, tensors: list[torch.Tensor], root: int, name: str) -> Future:
        return self._done(tensors)

    def sparse(self, *args: Any) -> None:
        return None


def measure_cpu(
    spec: str | CompressorBase, tensors: Sequence[torch.Tensor], ranks: int, repeats: int = 2
) -> float:
    """Seconds ``Communicator.reduce`` spends on (clones of) ``tensors`` with ``spec`` as a rank
    of ``ranks`` does, communication left out: the fastest of ``repeats`` calls after a first
    (numba's compile, error feedback's first residual). compression="auto" reads it. A
    compressor object is measured on a copy: its own state (residuals) is the job's."""
    compressor = create(spec, rank=0, seed=0) if isinstance(spec, str) else copy.deepcopy(spec)
    comm = Communicator(Loopback(ranks))
    work = [t.detach().clone() for t in tensors]
    names = [f"auto.measure.{j}" for j in range(len(work))]
    best = float("inf")
    for attempt in range(repeats + 1):
        for w, t in zip(work, tensors):
            w.copy_(t)
        start = time.perf_counter()
        comm.reduce(work, compressor, "auto.measure", names).wait()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best
