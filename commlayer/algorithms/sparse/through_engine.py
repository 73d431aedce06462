"""Top-k gradients reduced sparse by DistributedOptimizer, through the engine's collectives.

The engine negotiates and runs whole collectives (it has no point-to-point operations), so
DistributedOptimizer runs the split-allgather family, which is made of two of them:

1. alltoall: this rank's (index, value) pairs of block q (the index space cut in p blocks) go
   to rank q, as rows of index and value bytes; rank q merges the p sorted lists it receives,
   in rank order (kernels.merge_sum);
2. allgather: each owner's merged block, as one record (wire.pack: indices, values, dense):
   sparse, or dense once nnz x (index + value bytes) >= block length x value bytes (``dsar``;
   ``ssar_split_allgather`` stays sparse); every rank writes every block into the gradient.

The result is the exact sum of the ranks' top-k vectors, the same bits on every rank (each
block is summed once, by its owner). ``COMMLAYER_SPARSE_ALGORITHM``: ``allgather`` (default)
keeps the compressor's allgather; ``dsar`` and ``ssar_split_allgather`` run here; ``auto``
runs here as whichever of the three the cost model predicts fastest for k; the algorithms
that need point-to-point steps (``ssar_recursive_doubling``, ``gtopk``, ``topo_sparse``) run
here as ``dsar`` until the engine has a sparse collective.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from commlayer import kernels, ops
from commlayer.algorithms import sparse
from commlayer.algorithms.schedule import blocks
from commlayer.algorithms.sparse import cost
from commlayer.compression import wire
from commlayer.engine import Handle
from commlayer.errors import PayloadError
from commlayer.process_sets import ProcessSet
from commlayer.reduce_ops import ReduceOp

ENGINE_ALGORITHMS = ("ssar_split_allgather", "dsar")


def engine_algorithm(configured: str, size: int, numel: int, nnz: int) -> str:
    """What DistributedOptimizer runs for ``configured``: ``allgather`` or one of
    ENGINE_ALGORITHMS (the same on every rank: size, numel and k are)."""
    if configured == sparse.AUTO:
        return min(
            ("allgather", *ENGINE_ALGORITHMS),
            key=lambda name: cost.predict(name, size, numel, nnz).seconds,
        )
    return configured if configured in ("allgather", *ENGINE_ALGORITHMS) else "dsar"


def _rows(idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """One row of index bytes then value bytes per entry (the alltoall moves rows)."""
    nnz, vb = idx.numel(), val.element_size()
    as_bytes = [idx.view(torch.uint8).reshape(nnz, 4), val.view(torch.uint8).reshape(nnz, vb)]
    return torch.cat(as_bytes, 1)


class SparseReduction:
    """One top-k gradient's two rounds; ``advance`` takes a round's result and returns the
    next round's handle, or None once ``value`` (the reduced dense gradient) is ready."""

    def __init__(
        self,
        name: str,
        values: torch.Tensor,
        indices: torch.Tensor,
        shape: torch.Size,
        algorithm: str,
        process_set: ProcessSet,
        op: ReduceOp,
    ) -> None:
        self.name, self.shape, self.op, self.process_set = name, shape, op, process_set
        self.numel, self.dtype = shape.numel(), values.dtype
        self.switch = sparse.policy(algorithm).switch
        size = process_set.size()
        self.blocks = blocks(self.numel, size)
        idx, order = indices.to(torch.int32).sort()
        val = values[order].contiguous()
        edges = torch.tensor([b[0] for b in self.blocks] + [self.numel], dtype=torch.int32)
        cuts = torch.searchsorted(idx, edges).tolist()
        splits = [cuts[q + 1] - cuts[q] for q in range(size)]
        self.handle: Handle = ops.alltoall_async(
            _rows(idx, val), splits=splits, name=f"{name}.sparse", process_set=process_set
        )
        self.value: torch.Tensor | None = None

    def advance(self, result: object) -> Handle | None:
        if self.value is None and not hasattr(self, "_gathering"):
            self._gathering = True
            rows, received = cast(tuple[torch.Tensor, Any], result)  # alltoall's
            self.handle = ops.allgather_async(
                self._merge(
                    rows, received.tolist() if isinstance(received, torch.Tensor) else received
                ),
                name=f"{self.name}.sparse.gather",
                process_set=self.process_set,
            )
            return self.handle
        self.value = self._decode(result)  # type: ignore[arg-type]
        return None

    def _merge(self, rows: torch.Tensor, received: list[int]) -> torch.Tensor:
        """This rank's block, summed over ranks, as a record."""
        start, stop = self.blocks[self.process_set.rank()]
        idx_all = rows[:, :4].contiguous().view(torch.int32).view(-1)
        val_all = rows[:, 4:].contiguous().view(self.dtype).view(-1)
        if idx_all.numel() and (int(idx_all.min()) < start or int(idx_all.max()) >= stop):
            raise PayloadError(f"{self.name}: a peer sent indices outside block [{start}, {stop})")
        idx, val = idx_all[:0], val_all[:0]
        offset = 0
        for count in received:
            part = slice(offset, offset + count)
            idx, val = kernels.merge_sum(idx, val, idx_all[part], val_all[part])
            offset += count
        empty = torch.empty(0, dtype=self.dtype)
        vb = val.element_size()
        if self.switch and idx.numel() * (4 + vb) >= (stop - start) * vb:
            dense = kernels.densify((idx - start).long(), val, stop - start)
            return wire.pack([idx[:0], empty, dense])
        return wire.pack([idx, val, empty])

    def _decode(self, gathered: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.dtype)
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
