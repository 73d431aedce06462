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
"""

from __future__ import annotations

from pathlib import Path

from commlayer import algorithms
from commlayer.algorithms.schedule import Schedule, Step, Transfer
from commlayer.algorithms.topology import Topology

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


def write(
    all_schedules: list[Schedule],
    directory: Path,
    element_size: int = 4,
    gamma_s_per_byte: float = 0.0,
    copy_s_per_byte: float = 0.0,
    aggregate: bool = True,
) -> int:
    """One trace per rank into ``directory``; returns the number of messages in all."""
    directory.mkdir(parents=True, exist_ok=True)
    messages = 0
    for rank, schedule in enumerate(all_schedules):
        lines = [f"commlayer-sim-trace {VERSION}", str(len(schedule))]
        for step in schedule:
            line = step_line(step, element_size, gamma_s_per_byte, copy_s_per_byte, aggregate)
            messages += int(line.split(" ", 1)[0])
            lines.append(line)
        (directory / f"rank{rank}.trace").write_text("\n".join(lines) + "\n")
    return messages
