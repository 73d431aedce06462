"""A sparse allreduce's local work: a schedule's steps over (index, value) streams.

:class:`ScheduleRun` keeps a rank's vector and applies a schedule's steps to it, apart from how
streams travel (comm/sparse_reduction.py moves them through the engine's collectives, one
alltoall per round):
1. The vector is kept per block, the finest partition the schedule's ranges make; a block is
   a sorted (indices, values) list or a dense tensor of the block's length.
2. A send of range [a, b) is one stream: the indices (None when the stream is dense) and the
   values. Sparse blocks of the range are concatenated (a single block goes zero-copy); the
   stream is dense when a block is, or when the policy switches and the pairs would be at
   least as large as the dense range.
3. Once every transfer of the step arrived, each received stream is merged into (summed;
   ``kernels.merge_sum`` or a scatter-add into dense blocks) or copied over its blocks, then
   blocks that got too dense turn dense (policy ``switch``) or the top k are re-selected
   (policy ``select``, gtopk: see gtopk.py for the definition and the fold).

Everything runs on the input's device: blocks, buffers and masks are made there, received
streams are moved there (a no-op unless the transport staged them through the host), and the
kernels dispatch by it (CUDA kernels for CUDA tensors). Counts and cuts read back with
``tolist`` are control data and stay on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlayer import kernels
from commlayer.algorithms import sparse
from commlayer.algorithms.schedule import Schedule, Step, Transfer
from commlayer.common.errors import CommlayerError


@dataclass(slots=True)
class SparseResult:
    """A sparse allreduce's result: ``indices`` None means ``values`` is the dense vector."""

    numel: int
    indices: torch.Tensor | None
    values: torch.Tensor

    @property
    def nnz(self) -> int:
        return self.values.numel() if self.indices is not None else self.numel

    def dense(self) -> torch.Tensor:
        if self.indices is None:
            return self.values
        return kernels.densify(self.indices.long(), self.values, self.numel)


def prepare(
    indices: torch.Tensor, values: torch.Tensor, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's input as a sorted list without repeated indices (repeats summed), indices in
    ``index_dtype(numel)``. ValueError for an index outside [0, numel) or mismatched lengths."""
    indices, values = indices.reshape(-1), values.reshape(-1)
    if indices.numel() != values.numel():
        raise ValueError(f"{indices.numel()} indices for {values.numel()} values")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
        raise ValueError(f"sparse indices must be in [0, {numel}), got [{int(indices.min())}, "
                         f"{int(indices.max())}]")  # fmt: skip
    dtype = kernels.index_dtype(numel)
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        indices, order = indices.sort()
        values = values[order]
        if bool((indices[1:] == indices[:-1]).any()):
            unique, inverse = torch.unique_consecutive(indices, return_inverse=True)
            summed = torch.zeros(unique.numel(), dtype=values.dtype, device=values.device)
            values = summed.index_add_(0, inverse, values)
            indices = unique
    return indices.to(dtype).contiguous(), values.contiguous()


def sparse_bytes(nnz: int, index_bytes: int, value_bytes: int) -> int:
    return nnz * (index_bytes + value_bytes)


class _Block:
    __slots__ = ("idx", "val")

    def __init__(self, idx: torch.Tensor | None, val: torch.Tensor) -> None:
        self.idx, self.val = idx, val  # idx None: val is dense over the block


class SparseVector:
    """A vector of ``numel`` elements kept per block (``bounds``: block starts, then numel)."""

    def __init__(
        self, bounds: list[int], idx: torch.Tensor, val: torch.Tensor, switch: bool, choice: str
    ) -> None:
        self.bounds, self.switch, self.choice = bounds, switch, choice
        self.numel = bounds[-1]
        self.index_dtype, self.dtype, self.device = idx.dtype, val.dtype, val.device
        self._ib, self._vb = idx.element_size(), val.element_size()
        self._at = {b: i for i, b in enumerate(bounds)}
        edges = torch.tensor(bounds, dtype=idx.dtype, device=idx.device)
        cuts = torch.searchsorted(idx, edges).tolist()
        self.blocks = [
            _Block(idx[cuts[i] : cuts[i + 1]], val[cuts[i] : cuts[i + 1]])
            for i in range(len(bounds) - 1)
        ]
        for i in range(len(self.blocks)):
            self._maybe_densify(i)

    def _span(self, start: int, stop: int) -> range:
        return range(self._at[start], self._at[stop])

    def _too_dense(self, nnz: int, length: int) -> bool:
        return self.switch and sparse_bytes(nnz, self._ib, self._vb) >= length * self._vb

    def _maybe_densify(self, i: int) -> None:
        block = self.blocks[i]
        a, b = self.bounds[i], self.bounds[i + 1]
        if block.idx is not None and self._too_dense(block.idx.numel(), b - a):
            block.val = kernels.densify((block.idx - a).long(), block.val, b - a)
            block.idx = None

    def take(self, start: int, stop: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The stream of range [start, stop): (indices, values), or (None, dense values)."""
        span = [self.blocks[i] for i in self._span(start, stop)]
        nnz = sum(b.val.numel() for b in span)
        if any(b.idx is None for b in span) or self._too_dense(nnz, stop - start):
            if len(span) == 1 and span[0].idx is None:
                return None, span[0].val
            out = torch.zeros(stop - start, dtype=self.dtype, device=self.device)
            for i in self._span(start, stop):
                block, a = self.blocks[i], self.bounds[i] - start
                if block.idx is None:
                    out[a : a + block.val.numel()].copy_(block.val)
                else:
                    kernels.scatter_add_(out, (block.idx - start).long(), block.val, self.choice)
            return None, out
        if len(span) == 1:
            return span[0].idx, span[0].val
        return torch.cat([b.idx for b in span]), torch.cat([b.val for b in span])  # type: ignore[misc]

    def put(
        self, start: int, stop: int, idx: torch.Tensor | None, val: torch.Tensor, reduce: bool
    ) -> None:
        """Merge (``reduce``) or copy a received stream into its blocks."""
        span = self._span(start, stop)
        if idx is not None:
            edges = torch.tensor(
                self.bounds[span.start : span.stop + 1], dtype=idx.dtype, device=idx.device
            )
            cuts = torch.searchsorted(idx, edges).tolist()
        for n, i in enumerate(span):
            a, b = self.bounds[i], self.bounds[i + 1]
            block = self.blocks[i]
            if idx is None:
                part_i, part_v = None, val[a - start : b - start]
            else:
                part_i, part_v = idx[cuts[n] : cuts[n + 1]], val[cuts[n] : cuts[n + 1]]
            if not reduce:
                self.blocks[i] = _Block(part_i, part_v)
            elif part_i is None:  # dense stream: ours is added to it (a buffer we own)
                if block.idx is None:
                    part_v += block.val
                else:
                    kernels.scatter_add_(part_v, (block.idx - a).long(), block.val, self.choice)
                self.blocks[i] = _Block(None, part_v)
            elif block.idx is None:
                kernels.scatter_add_(block.val, (part_i - a).long(), part_v, self.choice)
            else:
                merged = kernels.merge_sum(block.idx, block.val, part_i, part_v, self.choice)
                self.blocks[i] = _Block(*merged)
            self._maybe_densify(i)

    def select(self, k: int) -> torch.Tensor:
        """Keep the k entries of largest magnitude (the vector must be sparse, one block);
        returns the indices dropped."""
        (block,) = self.blocks
        assert block.idx is not None, "gtopk keeps its vector sparse"
        if block.val.numel() <= k:
            return block.idx[:0]
        keep = kernels.topk(block.val, k)[0].long()  # positions in the block, ascending
        mask = torch.ones(block.val.numel(), dtype=torch.bool, device=block.val.device)
        mask[keep] = False
        dropped = block.idx[mask]
        block.idx, block.val = block.idx[keep], block.val[keep]
        return dropped

    def result(self) -> SparseResult:
        if all(b.idx is not None for b in self.blocks):
            if len(self.blocks) == 1:
                return SparseResult(self.numel, self.blocks[0].idx, self.blocks[0].val)
            idx = torch.cat([b.idx for b in self.blocks])  # type: ignore[misc]
            return SparseResult(self.numel, idx, torch.cat([b.val for b in self.blocks]))
        return SparseResult(self.numel, None, self.take(0, self.numel)[1])


def check_stream(
    t: Transfer, idx: torch.Tensor, val: torch.Tensor, rank: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A received stream for transfer ``t``: (indices, values), or (None, dense values) when it
    came dense (no indices, the range's length of values); CommlayerError naming both ranks
    when it fits neither."""
    if idx.numel() == 0 and val.numel() == t.numel:
        return None, val
    if idx.numel() != val.numel() or (
        idx.numel() and (int(idx[0]) < t.start or int(idx[-1]) >= t.stop)
    ):
        raise CommlayerError(
            f"rank {rank}: sparse stream from rank {t.peer} for [{t.start}, {t.stop}) has "
            f"{idx.numel()} indices and {val.numel()} values"
        )
    return idx, val


def with_residual_step(schedule: Schedule, policy: sparse.Policy, numel: int) -> list[Step]:
    """The steps a rank runs: ``schedule``, plus, for gtopk (``select``) with a fold, one last
    step in which the partner returns an extra rank's dropped entries."""
    steps = list(schedule)
    if not policy.select or not steps:
        return steps
    first = steps[0]
    if first.sends and not first.recvs:  # an extra rank: sends its vector first
        steps.append(Step((), (Transfer(first.sends[0].peer, 0, numel),), reduce=False))
    elif first.recvs and not first.sends:  # its partner
        steps.append(Step((Transfer(first.recvs[0].peer, 0, numel),), (), reduce=False))
    return steps


Stream = tuple[Transfer, "torch.Tensor | None", torch.Tensor]


def _moved(stream: Stream, device: torch.device) -> Stream:
    """A received stream on ``device``: where the vector is, wherever the transport put it."""
    t, idx, val = stream
    return t, None if idx is None else idx.to(device), val.to(device)


class ScheduleRun:
    """A schedule's steps over a SparseVector, apart from how streams travel: ``outgoing(i)``
    is what step i sends, ``incoming(i, streams)`` applies what it received, ``finish()``
    gives the result (and ``dropped``, gtopk)."""

    def __init__(
        self,
        schedule: Schedule,
        idx: torch.Tensor,
        val: torch.Tensor,
        numel: int,
        policy: sparse.Policy,
        k: int,
        choice: str,
    ) -> None:
        bounds = sorted({0, numel, *(e for s in schedule for t in (*s.sends, *s.recvs)
                                     for e in (t.start, t.stop))})  # fmt: skip
        self._policy, self._k = policy, k
        self.steps = with_residual_step(schedule, policy, numel)
        self._residual_index = len(self.steps) - 1 if len(self.steps) > len(schedule) else -1
        self.vec = SparseVector(bounds, idx, val, policy.switch, choice)
        self._input = (idx, val)
        self._lost: list[torch.Tensor] = []  # gtopk: indices dropped from vectors holding ours
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # folded-in peers' input
        self.dropped: SparseResult | None = None

    def outgoing(self, index: int) -> list[Stream]:
        streams: list[Stream] = []
        for t in self.steps[index].sends:
            idx: torch.Tensor | None
            if index == self._residual_index:
                idx, val = self._lost_part(*self._held[t.peer])
            else:
                idx, val = self.vec.take(t.start, t.stop)
            streams.append((t, idx, val))
        return streams

    def incoming(self, index: int, streams: list[Stream]) -> None:
        step = self.steps[index]
        streams = [_moved(stream, self.vec.device) for stream in streams]
        if index == self._residual_index and step.recvs:
            _, idx, val = streams[0]
            assert idx is not None, "dropped entries travel sparse"
            self.dropped = SparseResult(self.vec.numel, idx, val)
            return
        for t, idx, val in streams:
            if self._policy.select and step.reduce and not step.sends and idx is not None:
                self._held[t.peer] = (idx, val)  # an extra rank folded in: we account for it
            self.vec.put(t.start, t.stop, idx, val, step.reduce)
        if self._policy.select and step.reduce and step.sends and step.recvs:
            self._lost.append(self.vec.select(self._k))

    def _lost_part(self, idx: torch.Tensor, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of (idx, val) at indices dropped from a vector that carried them."""
        if not self._lost:
            return idx[:0], val[:0]
        # A dense mask, not torch.isin: 25M elements, 2.5M lost: ~20 ms against ~320 ms.
        hit = torch.zeros(self.vec.numel, dtype=torch.bool, device=self.vec.device)
        for lost in self._lost:
            hit[lost.long()] = True
        mask = hit[idx.long()]
        return idx[mask], val[mask]

    def finish(self) -> SparseResult:
        if self._policy.select and self.dropped is None:
            self.dropped = SparseResult(self.vec.numel, *self._lost_part(*self._input))
        return self.vec.result()
