"""Tensor fusion: pack ready allreduce tensors of one dtype and op into reusable flat buffers.

Many small gradients waste latency and one huge buffer delays the start, so ready tensors are
packed in the order all ranks agreed on into buckets of at most ``fusion_threshold_bytes``. A
tensor alone in its bucket is reduced where it lies (no copy), and so is a bucket of large
tensors that the shared-memory window reduces (``pieces``: the window copies in and out
anyway). Where a bucket would be packed, an operation of one large tensor (``ALONE_NUMEL``
elements or more: a planned bucket of DistributedOptimizer, which owns its memory,
comm/bucketer.py; a DDP bucket) is reduced alone where it lies instead (runners/allreduce.py):
it is one buffer already, and packing it with others would copy every byte in and out to
save one collective's latency. Scaling (prescale, postscale and Average's 1/n) is folded
into the pack and unpack copies, so it costs no extra pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from commlayer.common.reduce_ops import scale_into


@dataclasses.dataclass
class Entry:
    """One tensor of a bucket: where it comes from, where the result goes, how to scale."""

    source: torch.Tensor | None  # None: this rank joined and contributes zeros
    output: torch.Tensor | None
    numel: int
    prescale: float = 1.0
    postscale: float = 1.0
    owner: Any = None  # engine bookkeeping (which operation this entry belongs to)
    # A small grouped allreduce travels as one entry: ``source``/``output`` are then None and
    # this holds (sources, outputs, numel of each); pack is one torch.cat and unpack one
    # split_with_sizes_copy, instead of a Python step per tensor.
    group: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None
    # An operation's one large tensor (``ALONE_NUMEL``): not packed with others, decided from
    # the negotiated response alone, so that every rank (a joined one too) decides the same.
    alone: bool = False


def plan_buckets(
    entries: Iterable[Entry], element_size: int, threshold_bytes: int
) -> Iterator[list[Entry]]:
    """Group entries, in order, into buckets of at most threshold_bytes (one entry may exceed)."""
    bucket: list[Entry] = []
    used = 0
    for entry in entries:
        size = entry.numel * element_size
        if bucket and used + size > threshold_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(entry)
        used += size
    if bucket:
        yield bucket


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """tensor *= factor in place; integer tensors are scaled in float64 and truncated."""
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        scale_into(tensor, factor, tensor)
    else:
        tensor.copy_(tensor.double().mul_(factor).trunc_())


def _flat(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as 1-D (a view costs ~1 us each, so only when one is not 1-D already)."""
    if all(t.dim() == 1 for t in tensors):
        return tensors
    return [t.reshape(-1) for t in tensors]


def pack(bucket: list[Entry], buf: torch.Tensor) -> None:
    """Copy (and prescale) each entry's source into consecutive slices of buf."""
    if all(e.source is not None and e.prescale == 1.0 for e in bucket):
        torch.cat([e.source.reshape(-1) for e in bucket], out=buf)  # type: ignore[union-attr]
        return
    offset = 0
    for entry in bucket:
        piece = buf[offset : offset + entry.numel]
        if entry.group is not None:
            torch.cat(_flat(entry.group[0]), out=piece)
            scale_(piece, entry.prescale)
        elif entry.source is None:
            piece.zero_()
        elif entry.prescale != 1.0 and entry.source.is_floating_point():
            torch.mul(entry.source.reshape(-1), entry.prescale, out=piece)
        else:
            piece.copy_(entry.source.reshape(-1))
            scale_(piece, entry.prescale)
        offset += entry.numel


ONE_PASS_NUMEL = 1 << 16  # mean elements per tensor from which a step per tensor pays off
ALONE_NUMEL = ONE_PASS_NUMEL  # elements from which an operation's one tensor is not packed


def per_tensor(total_numel: int, count: int) -> bool:
    """Whether ``count`` tensors of ``total_numel`` elements together are large enough (a mean
    of ``ONE_PASS_NUMEL``) that a Python step per tensor costs less than the pass over the data
    it saves: the window reads them where they lie, unpack scales straight into them, and the
    engine keeps such a group's tensors as entries of their own."""
    return total_numel >= ONE_PASS_NUMEL * count


def pieces(
    bucket: list[Entry], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]] | None:
    """The bucket as (sources, outputs, postscales), 1-D, for a collective that reads and writes
    the tensors where they lie instead of a packed buffer. None where it must be packed: a
    joined rank's zeros, a group, a prescale, an integer dtype (scaled in float64 by
    ``scale_``), or small tensors (there a Python step per tensor costs more than the pass over
    the data it saves)."""
    if not dtype.is_floating_point or not per_tensor(sum(e.numel for e in bucket), len(bucket)):
        return None
    sources, outputs = [], []
    for e in bucket:
        if e.source is None or e.output is None or e.group is not None or e.prescale != 1.0:
            return None
        sources.append(e.source.reshape(-1))
        outputs.append(e.output.view(-1))
    return sources, outputs, [e.postscale for e in bucket]


def unpack(bucket: list[Entry], buf: torch.Tensor) -> None:
    """Copy (and postscale) consecutive slices of buf into each entry's output."""
    pieces = buf.split([e.numel for e in bucket])
    scales = {e.postscale for e in bucket}
    if len(scales) == 1 and buf.is_floating_point():
        factor = scales.pop()
        if (
            factor != 1.0
            and per_tensor(buf.numel(), len(bucket))
            and all(e.output is not None and e.group is None for e in bucket)
        ):
            # Large tensors: scale straight into the outputs, one pass over the data instead of
            # a scale of the buffer and a copy (40 x 2.4 MB: 5.0 vs 6.7 ms); a small tensor's
            # own op (~4 us) costs more than the pass it saves.
            for entry, piece in zip(bucket, pieces):
                scale_into(piece, factor, entry.output.view(-1))  # type: ignore[union-attr]
            return
        if factor != 1.0:
            scale_into(buf, factor, buf)
        outs = [
            (e.output.view(-1), piece) for e, piece in zip(bucket, pieces) if e.output is not None
        ]
        if outs:
            torch._foreach_copy_([o for o, _ in outs], [p for _, p in outs])
        for entry, piece in zip(bucket, pieces):
            if entry.group is not None:
                _unpack_group(entry, piece, scaled=True)
        return
    for entry, piece in zip(bucket, pieces):
        if entry.group is not None:
            _unpack_group(entry, piece)
        elif entry.output is not None:
            out = entry.output.view(-1)
            out.copy_(piece)
            scale_(out, entry.postscale)


def _unpack_group(entry: Entry, piece: torch.Tensor, scaled: bool = False) -> None:
    assert entry.group is not None
    _, outputs, numels = entry.group
    if not scaled:
        scale_(piece, entry.postscale)
    torch.split_with_sizes_copy(piece, numels, out=_flat(outputs))
