"""Schedules exported as per-rank traces for the SMPI replay program (ext/sim/replay.c).

Every rank's schedule comes from the registry (``algorithms.schedule``), the very list the
executor runs; a trace keeps of each step what the network sees: the peer and bytes of every
send and receive, their order, and that a step's transfers are posted together (they overlap)
while steps follow each other. Format (text, one file per rank, ``rank<N>.trace``)::

    commlayer-sim-trace 1
    STEPS
    NSEND NRECV COMPUTE_S PEER BYTES ... (sends, then receives)     one line per step

COMPUTE_S is the step's local work (reducing or copying what it received) at the given
``gamma_s_per_byte``/``copy_s_per_byte``; 0 by default: the simulation then times the network
alone.

Pieces of one step to one peer (the ring's chunks of ``RING_CHUNK_ELEMENTS``) travel as one
message with ``aggregate`` (default): the executor cuts them to overlap its reduction with the
transfer, which the replay does not model, and a 1024-rank ring at 1 GiB would otherwise post
hundreds of thousands of extra messages.

A sparse schedule (``write_sparse``) is written in the same format from the streams the sparse
cost model expects (``costmodel/sparse.py`` ``streams``: each rank holding nnz random
indices, ranges filling in as they merge, a stream turning dense where its policy says): the
peers and order are the schedule's, the bytes the expected (index, value) pairs.

A step that posts a stream to nearly every rank at once (DSAR's and SSAR's split, p - 1
streams per rank: 65,280 concurrent flows at 256 ranks, on which SimGrid's bandwidth-sharing
solver takes hours) can be replayed in pairwise-exchange rounds (``pairwise``): round d of a
step sends to rank r + d and receives from r - d (mod p), MPI libraries' order for a large
alltoall; p concurrent flows a round instead of p (p - 1), each pair's messages in the same
order, so the traces still match. That is an approximation of posting every stream at once
(what the executor does), with up to p - 2 more latencies a step; simulate.md gives both forms
where both run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from commlayer import algorithms
from commlayer.algorithms.schedule import Schedule, Step, Transfer
from commlayer.common.topology import Topology

VERSION = 1


def schedules(name: str, numel: int, topology: Topology) -> list[Schedule]:
    """Every rank's schedule of algorithm ``name`` for ``numel`` elements."""
    return [
        algorithms.schedule(name, r, topology.size, numel, topology) for r in range(topology.size)
    ]


def _merged(transfers: tuple[Transfer, ...], aggregate: bool) -> list[tuple[int, int]]:
    """(peer, elements) of a step's transfers in order; with ``aggregate`` those to one peer
    summed into one message (at the place of the first)."""
    if not aggregate:
        return [(t.peer, t.numel) for t in transfers]
    merged: dict[int, int] = {}
    for t in transfers:
        merged[t.peer] = merged.get(t.peer, 0) + t.numel
    return list(merged.items())


def step_line(
    step: Step,
    element_size: int,
    gamma_s_per_byte: float = 0.0,
    copy_s_per_byte: float = 0.0,
    aggregate: bool = True,
) -> str:
    sends = _merged(step.sends, aggregate)
    recvs = _merged(step.recvs, aggregate)
    received = sum(n for _, n in recvs) * element_size
    compute_s = received * (gamma_s_per_byte if step.reduce else copy_s_per_byte)
    pairs = " ".join(f"{peer} {n * element_size}" for peer, n in sends + recvs)
    return f"{len(sends)} {len(recvs)} {compute_s!r} {pairs}"


def stream_line(sends: Sequence[tuple[int, float]], recvs: Sequence[tuple[int, float]]) -> str:
    """A sparse step (``costmodel.sparse.streams``): (peer, expected bytes) of each stream, rounded
    to whole bytes the same way at both ends; merging costs nothing (COMPUTE_S 0)."""
    pairs = " ".join(f"{peer} {round(nbytes)}" for peer, nbytes in (*sends, *recvs))
    return f"{len(sends)} {len(recvs)} 0.0 {pairs}"


def _write(ranks: Iterable[list[str]], directory: Path) -> int:
    """One trace per rank (its step lines) into ``directory``; the number of messages."""
    directory.mkdir(parents=True, exist_ok=True)
    messages = 0
    for rank, lines in enumerate(ranks):
        messages += sum(int(line.split(" ", 1)[0]) for line in lines)
        text = "\n".join([f"commlayer-sim-trace {VERSION}", str(len(lines)), *lines])
        (directory / f"rank{rank}.trace").write_text(text + "\n")
    return messages


def write(
    all_schedules: list[Schedule],
    directory: Path,
    element_size: int = 4,
    gamma_s_per_byte: float = 0.0,
    copy_s_per_byte: float = 0.0,
    aggregate: bool = True,
) -> int:
    """One trace per rank into ``directory``; returns the number of messages in all."""
    return _write(
        (
            [
                step_line(st, element_size, gamma_s_per_byte, copy_s_per_byte, aggregate)
                for st in schedule
            ]  # fmt: skip
            for schedule in all_schedules
        ),
        directory,
    )


Streams = list[list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]]


def pairwise(streams: Streams, max_streams: int) -> tuple[Streams, bool]:
    """``streams`` with every step posting more than ``max_streams`` transfers (sends and
    receives of one rank) cut into pairwise-exchange rounds: round d holds the sends to
    r + d and the receives from r - d (mod p), in their order, d = 1 .. p - 1, empty rounds
    dropped. A step's rounds are cut alike at every rank (by the same offset), so the k-th
    message of a to b is still the k-th receive of b from a, and a rank at round d only waits
    for ranks at round d. Whether any step was cut comes back beside the streams."""
    size = len(streams)
    out: Streams = []
    cut = False
    for rank, steps in enumerate(streams):
        mine: list[tuple[list[tuple[int, float]], list[tuple[int, float]]]] = []
        for sends, recvs in steps:
            if len(sends) + len(recvs) <= max_streams:
                mine.append((sends, recvs))
                continue
            cut = True
            rounds: dict[int, tuple[list[tuple[int, float]], list[tuple[int, float]]]] = {}
            for peer, nbytes in sends:
                rounds.setdefault((peer - rank) % size, ([], []))[0].append((peer, nbytes))
            for peer, nbytes in recvs:
                rounds.setdefault((rank - peer) % size, ([], []))[1].append((peer, nbytes))
            mine.extend(rounds[d] for d in sorted(rounds))
        out.append(mine)
    return out, cut


def write_sparse(
    streams: list[list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]], directory: Path
) -> int:
    """Traces of a sparse schedule's streams (``costmodel.sparse.streams``); the message count."""
    return _write(([stream_line(s, r) for s, r in rank] for rank in streams), directory)
