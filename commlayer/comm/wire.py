"""Gathered payloads on the wire: one self-delimiting byte record per rank.

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
"""

from __future__ import annotations

import torch

from commlayer.core.errors import PayloadError

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
