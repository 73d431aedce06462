"""Top-k payloads reduced sparse through the engine's collectives (the communicator's sparse
path: comm/communicator.py, its only caller; API layer, like the communicator).

The engine negotiates and runs whole collectives (it has no point-to-point operations), so
every sparse algorithm is cast as a sequence of them:

1. ``dsar`` and ``ssar_split_allgather``, two collectives:
   a. alltoall: this rank's (index, value) pairs of block q (the index space cut in p blocks)
      go to rank q, as rows of index and value bytes (wire.pack_rows, as
      ``ops.sparse_allreduce_async`` gathers COO entries); rank q merges the p sorted lists it
      receives, in rank order (kernels.merge_sum);
   b. allgather: each owner's merged block, as one record (wire.pack: indices, values, dense):
      sparse, or dense once nnz x (index + value bytes) >= block length x value bytes
      (``dsar``; ``ssar_split_allgather`` stays sparse); every rank writes every block.
2. The point-to-point schedules (``ssar_recursive_doubling``, ``gtopk``, ``topo_sparse``): one
   alltoall per round, each rank's streams of that round in it as wire records to their
   peers (no bytes to the others). Rounds line the ranks' steps up (``rounds``): a step and
   the step that receives its streams share a round, a rank's steps keep their order, and a
   rank with no step in a round (an extra rank while the others double) sends nothing. The
   local work is executor.ScheduleRun's, the same as over MPI point-to-point. The schedules
   get the process set's real topology (the backend's nodes, or COMMLAYER_TOPOLOGY), so
   ``topo_sparse`` reduces within nodes first, as it does over MPI.

The result is the exact sum of the ranks' top-k vectors, the same bits on every rank, except
for gtopk, whose result keeps k entries (gtopk.py): the entries of this rank's payload dropped
on the way are added to its error-feedback residual (``ErrorFeedback.add_dropped``) when the
compressor has one, so that the sum over ranks of what they compressed equals p x the averaged
result + the sum of their residuals; without error feedback (``ef=0``) they are lost, as the
top-k selection's are. ``COMMLAYER_SPARSE_ALGORITHM``: ``allgather`` (default) keeps the
compressor's allgather; ``auto`` runs whichever exact algorithm the cost model predicts
fastest for k.

The local work (sorting, merging, densifying, decoding) runs on the payload's device, where
the collectives return their results (commlayer/core/device.py brings staged CUDA results back);
only the splits and cuts read with ``tolist`` live on the host.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Protocol, cast

import torch

from commlayer import kernels
from commlayer.algorithms import sparse
from commlayer.algorithms.schedule import Step, blocks
from commlayer.algorithms.sparse.executor import (
    ScheduleRun,
    SparseResult,
    Stream,
    check_stream,
    prepare,
    with_residual_step,
)
from commlayer.common.errors import PayloadError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.common.topology import Topology
from commlayer.core import wire
from commlayer.core.future import Handle
from commlayer.core.negotiation import ALLGATHER, ALLTOALL
from commlayer.core.process_sets import ProcessSet
from commlayer.core.submit import Request, submit
from commlayer.costmodel import sparse as cost

ENGINE_ALGORITHMS = ("ssar_split_allgather", "dsar")  # the two-collective ones


class DroppedSink(Protocol):
    """Where gtopk's dropped entries go: ErrorFeedback (compression/error_feedback.py)."""

    def add_dropped(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None: ...


def engine_algorithm(configured: str, size: int, numel: int, nnz: int) -> str:
    """What DistributedOptimizer runs for ``configured`` (``auto``: the cost model's pick for
    the largest nnz, which is k on every rank, so every rank picks the same)."""
    if configured == sparse.AUTO:
        return cost.choose(size, numel, nnz)
    return sparse.check_name(configured)


@functools.lru_cache(maxsize=64)
def rounds(
    name: str, size: int, numel: int, topology: Topology | None = None
) -> tuple[tuple[int, ...], ...]:
    """Per rank, the round of each of its steps (on ``topology``, default flat), so that the
    k-th stream rank r sends to rank q and the k-th q receives from r share a round, and a
    rank's steps keep their order. A fixed point: rounds only grow, bounded by the total
    number of steps."""
    policy = sparse.policy(name)
    topology = topology or Topology.flat(size)
    steps = [
        with_residual_step(sparse.schedule(name, r, size, numel, topology), policy, numel)
        for r in range(size)
    ]
    at = [list(range(len(s))) for s in steps]
    sent: dict[tuple[int, int], list[int]] = defaultdict(list)
    received: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, rank_steps in enumerate(steps):
        for i, step in enumerate(rank_steps):
            for t in step.sends:
                sent[r, t.peer].append(i)
            for t in step.recvs:
                received[t.peer, r].append(i)
    if any(len(sent[key]) != len(received[key]) for key in {*sent, *received}):
        raise ValueError(f"{name} at {size} ranks: sends and receives do not pair up")
    pairs = [(a, i, b, j) for (a, b), idx in sent.items() for i, j in zip(idx, received[a, b])]
    for _ in range(sum(map(len, steps)) + 1):
        changed = False
        for r in range(size):
            for i in range(1, len(at[r])):
                if at[r][i] <= at[r][i - 1]:
                    at[r][i], changed = at[r][i - 1] + 1, True
        for a, i, b, j in pairs:
            if at[a][i] != at[b][j]:
                at[a][i] = at[b][j] = max(at[a][i], at[b][j])
                changed = True
        if not changed:
            return tuple(tuple(r) for r in at)
    raise ValueError(f"{name} at {size} ranks: its steps cannot be put in rounds")


class _Rounds:
    """A point-to-point schedule as one alltoall per round (module docstring, 2)."""

    def __init__(
        self,
        name: str,
        algorithm: str,
        idx: torch.Tensor,
        val: torch.Tensor,
        numel: int,
        process_set: ProcessSet,
        topology: Topology,
    ) -> None:
        self.name, self.process_set = name, process_set
        rank, size = process_set.rank(), process_set.size()
        schedule = sparse.schedule(algorithm, rank, size, numel, topology)
        policy, k = sparse.policy(algorithm), max(idx.numel(), 1)
        self.run = ScheduleRun(schedule, idx, val, numel, policy, k, kernels.configured())
        everyone = rounds(algorithm, size, numel, topology)
        self._step_of = {at: i for i, at in enumerate(everyone[rank])}
        # at least one round, so there is a handle even with nothing to exchange (one rank)
        self._total = 1 + max((at for r in everyone for at in r), default=0)
        self._round = 0
        self.result: SparseResult | None = None
        self.handle = self._submit()

    def _submit(self) -> Handle:
        size = self.process_set.size()
        records: list[list[torch.Tensor]] = [[] for _ in range(size)]
        index = self._step_of.get(self._round)
        vec = self.run.vec
        empty = torch.empty(0, dtype=vec.index_dtype, device=vec.device)
        for t, idx, val in self.run.outgoing(index) if index is not None else []:
            records[t.peer].append(wire.pack([empty if idx is None else idx, val]))
        flat = [r for peer in records for r in peer]
        data = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=vec.device)
        splits = tuple(sum(r.numel() for r in peer) for peer in records)
        name = f"{self.name}.sparse.{self._round}"
        return submit(Request(ALLTOALL, name, [data], [], self.process_set, splits=splits))

    def advance(self, result: object) -> Handle | None:
        """Apply a round's alltoall result; the next round's handle, or None when done."""
        index = self._step_of.get(self._round)
        if index is not None:
            output, received = cast(tuple[torch.Tensor, Any], result)
            splits = received.tolist() if isinstance(received, torch.Tensor) else list(received)
            self.run.incoming(index, self._streams(self.run.steps[index], output, splits))
        self._round += 1
        if self._round < self._total:
            self.handle = self._submit()
            return self.handle
        self.result = self.run.finish()
        return None

    def _streams(self, step: Step, output: torch.Tensor, splits: list[int]) -> list[Stream]:
        rank, vec = self.process_set.rank(), self.run.vec
        offsets = [0, *torch.tensor(splits, dtype=torch.int64).cumsum(0).tolist()]
        by_peer: dict[int, list[list[torch.Tensor]]] = {}
        for peer in {t.peer for t in step.recvs}:
            part = output[offsets[peer] : offsets[peer + 1]]
            try:
                by_peer[peer] = wire.split(part, [vec.index_dtype, vec.dtype])
            except PayloadError as exc:
                raise PayloadError(f"rank {rank}: {self.name}: rank {peer} sent {exc}") from None
            expected = sum(t.peer == peer for t in step.recvs)
            if len(by_peer[peer]) != expected:
                raise PayloadError(
                    f"rank {rank}: {self.name}: rank {peer} sent {len(by_peer[peer])} sparse "
                    f"streams in round {self._round}, expected {expected}"
                )
        streams: list[Stream] = []
        for t in step.recvs:
            idx, val = by_peer[t.peer].pop(0)
            streams.append((t, *check_stream(t, idx, val, rank)))
        return streams


class SparseReduction:
    """One top-k gradient's reduction: ``handle`` is the collective in flight; ``advance``
    takes its result and returns the next one's handle, or None once ``value`` (the reduced
    dense gradient) is ready. ``sink``: where gtopk's dropped entries go (the compressor's
    error feedback), if anywhere."""

    def __init__(
        self,
        name: str,
        values: torch.Tensor,
        indices: torch.Tensor,
        shape: torch.Size,
        algorithm: str,
        process_set: ProcessSet,
        op: ReduceOp,
        sink: DroppedSink | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.name, self.shape, self.op, self.process_set = name, shape, op, process_set
        self.numel, self.dtype, self.device = shape.numel(), values.dtype, values.device
        self.switch = sparse.policy(algorithm).switch
        self.value: torch.Tensor | None = None
        self._sink = sink
        self._rounds: _Rounds | None = None
        if algorithm not in ENGINE_ALGORITHMS:
            idx, val = prepare(indices, values, self.numel)
            topology = topology or Topology.flat(process_set.size())
            self._rounds = _Rounds(name, algorithm, idx, val, self.numel, process_set, topology)
            self.handle: Handle = self._rounds.handle
            return
        size = process_set.size()
        self.blocks = blocks(self.numel, size)
        idx, order = indices.to(torch.int32).sort()
        val = values[order].contiguous()
        edges = torch.tensor(
            [b[0] for b in self.blocks] + [self.numel], dtype=torch.int32, device=idx.device
        )
        cuts = torch.searchsorted(idx, edges).tolist()
        splits = [cuts[q + 1] - cuts[q] for q in range(size)]
        rows = wire.pack_rows(idx, val)  # (nnz, row bytes): contiguous, split along dim 0
        self.handle = submit(
            Request(ALLTOALL, f"{name}.sparse", [rows], [], process_set, splits=tuple(splits))
        )

    def advance(self, result: object) -> Handle | None:
        if self._rounds is not None:
            following = self._rounds.advance(result)
            if following is None:
                self._finish_rounds()
                return None
            self.handle = following
            return following
        if self.value is None and not hasattr(self, "_gathering"):
            self._gathering = True
            rows, received = cast(tuple[torch.Tensor, Any], result)  # alltoall's
            merged = self._merge(
                rows, received.tolist() if isinstance(received, torch.Tensor) else received
            )
            self.handle = submit(
                Request(ALLGATHER, f"{self.name}.sparse.gather", [merged], [], self.process_set)
            )
            return self.handle
        self.value = self._decode(result)  # type: ignore[arg-type]
        return None

    def _finish_rounds(self) -> None:
        assert self._rounds is not None
        run = self._rounds.run
        result = self._rounds.result or run.finish()
        out = result.dense().to(self.dtype, copy=True)
        if self.op == ReduceOp.Average:
            out /= self.process_set.size()
        dropped = run.dropped
        if self._sink is not None and dropped is not None and dropped.indices is not None:
            self._sink.add_dropped(self.name, dropped.indices, dropped.values)
        self.value = out.view(self.shape)

    def _merge(self, rows: torch.Tensor, received: list[int]) -> torch.Tensor:
        """This rank's block, summed over ranks, as a record."""
        start, stop = self.blocks[self.process_set.rank()]
        idx_all, val_all = wire.split_rows(rows, torch.int32, (), self.dtype, ())
        if idx_all.numel() and (int(idx_all.min()) < start or int(idx_all.max()) >= stop):
            raise PayloadError(f"{self.name}: a peer sent indices outside block [{start}, {stop})")
        idx, val = idx_all[:0], val_all[:0]
        offset = 0
        for count in received:
            part = slice(offset, offset + count)
            idx, val = kernels.merge_sum(idx, val, idx_all[part], val_all[part])
            offset += count
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        vb = val.element_size()
        if self.switch and idx.numel() * (4 + vb) >= (stop - start) * vb:
            dense = kernels.densify((idx - start).long(), val, stop - start)
            return wire.pack([idx[:0], empty, dense])
        return wire.pack([idx, val, empty])

    def _decode(self, gathered: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        records = wire.split(gathered, [torch.int32, self.dtype, self.dtype])
        if len(records) != len(self.blocks):
            raise PayloadError(f"{self.name}: {len(records)} blocks for {len(self.blocks)} ranks")
        for (start, stop), (idx, val, dense) in zip(self.blocks, records):
            if dense.numel():
                if dense.numel() != stop - start:
                    raise PayloadError(f"{self.name}: dense block of {dense.numel()} elements")
                out[start:stop] = dense
            elif idx.numel():
                if idx.numel() != val.numel() or int(idx.min()) < start or int(idx.max()) >= stop:
                    raise PayloadError(f"{self.name}: malformed sparse block [{start}, {stop})")
                out[idx.long()] = val
        if self.op == ReduceOp.Average:
            out /= self.process_set.size()
        return out.view(self.shape)
