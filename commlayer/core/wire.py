"""Payloads on the wire: one self-delimiting byte record per rank, and sparse entries as rows.

Non-summable compressors (QSGD, top-k, signs) allgather their payload tensors. They travel as
one uint8 record per rank, so a tensor costs one allgather, however many payload tensors:

    int64 header [record bytes, numel of payload 0, ..., numel of payload m-1]
    payload 0 bytes, zero-padded to 8, ..., payload m-1 bytes, zero-padded to 8

Padding to 8 keeps every part aligned for any dtype view. The records of all ranks arrive
concatenated; :func:`split` walks them and checks each header against the buffer, so a peer's
wrong length is an error naming that rank instead of a misread of everyone after it.

A record lives on its payload's device (a CUDA gradient's record is built on the GPU and handed
to the collective there); only the header is made on the CPU, where its numbers are, and copied
in; ``split`` reads the headers back to the host (``tolist``: control data, 8 bytes a part).

Sparse entries (an index and its value) travel as rows (``pack_rows``): one uint8 row per
entry, its index bytes then its value bytes, so that a collective moving whole rows (an
allgather concatenating every rank's, an alltoall sending each peer a slice) keeps every index
with its value in one tensor and one operation. ``ops.sparse_allreduce_async`` (COO tensors:
int64 index tuples, value slices) and the sparse reduction of top-k payloads
(comm/sparse_reduction.py: int32 flat indices, scalar values) both use them, which is why the
format is the core's: the API layer's two users import it from below, not from each other.
"""

from __future__ import annotations

import math

import torch

from commlayer.common.errors import PayloadError

_ALIGN = 8


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def pack(payload: list[torch.Tensor]) -> torch.Tensor:
    """This rank's record: header and payload bytes, as one uint8 tensor."""
    sizes = [t.numel() * t.element_size() for t in payload]
    header_bytes = 8 * (1 + len(payload))
    total = header_bytes + sum(_padded(s) for s in sizes)
    device = payload[0].device if payload else torch.device("cpu")
    record = torch.zeros(total, dtype=torch.uint8, device=device)
    header = torch.tensor([total, *(t.numel() for t in payload)], dtype=torch.int64)
    # non_blocking: CUDA stages these few pageable bytes at once and returns, where a blocking
    # copy would first wait for all the device work queued before it (the compression).
    record[:header_bytes].copy_(header.view(torch.uint8), non_blocking=True)
    offset = header_bytes
    for tensor, size in zip(payload, sizes):
        record[offset : offset + size] = tensor.contiguous().reshape(-1).view(torch.uint8)
        offset += _padded(size)
    return record


def split(gathered: torch.Tensor, dtypes: list[torch.dtype]) -> list[list[torch.Tensor]]:
    """Each rank's payload tensors (1-D, viewing ``gathered``), in rank order."""
    records: list[list[torch.Tensor]] = []
    element_bytes = [torch.empty((), dtype=d).element_size() for d in dtypes]
    header_bytes = 8 * (1 + len(dtypes))
    offset, end = 0, gathered.numel()
    while offset < end:
        source = len(records)
        if end - offset < header_bytes:
            raise PayloadError(f"from rank {source}: {end - offset} bytes, shorter than a header")
        header = gathered[offset : offset + header_bytes].view(torch.int64).tolist()
        total, numels = header[0], header[1:]
        sizes = [n * b for n, b in zip(numels, element_bytes)]
        if min(numels, default=0) < 0 or total != header_bytes + sum(map(_padded, sizes)):
            raise PayloadError(f"from rank {source}: record header {header} is inconsistent")
        if offset + total > end:
            raise PayloadError(
                f"from rank {source}: record of {total} bytes overruns the {end - offset} left"
            )
        parts: list[torch.Tensor] = []
        position = offset + header_bytes
        for dtype, size in zip(dtypes, sizes):
            parts.append(gathered[position : position + size].view(dtype))
            position += _padded(size)
        records.append(parts)
        offset += total
    return records


def pack_rows(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Entries as a (nnz, index bytes + value bytes) uint8 tensor: row i holds ``indices[i]``
    (nnz indices, or nnz tuples of them) then ``values[i]`` (a scalar or a slice)."""
    nnz = values.shape[0]
    return torch.cat([_byte_rows(indices, nnz), _byte_rows(values, nnz)], dim=1)


def split_rows(
    rows: torch.Tensor,
    index_dtype: torch.dtype,
    index_shape: tuple[int, ...],
    value_dtype: torch.dtype,
    value_shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows``' inverse: (indices of shape (nnz, *index_shape), values of shape
    (nnz, *value_shape)), copies out of ``rows``."""
    nnz = rows.shape[0]
    split = index_dtype.itemsize * math.prod(index_shape)
    indices = rows[:, :split].contiguous().view(index_dtype).reshape(nnz, *index_shape)
    values = rows[:, split:].contiguous().view(value_dtype).reshape(nnz, *value_shape)
    return indices, values


def _byte_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` (first dimension ``rows``) as a (rows, bytes per row) uint8 tensor."""
    width = tensor.element_size() * math.prod(tensor.shape[1:])
    return tensor.contiguous().reshape(-1).view(torch.uint8).reshape(rows, width)
