"""Schedules checked and counted without communication (tests only): ``simulate`` runs every
rank's schedule of commlayer/algorithms/schedule.py on copies of the inputs as MPI would,
``traffic`` counts what one rank sends and receives."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commlayer.algorithms.schedule import Schedule, Transfer
from commlayer.common.reduce_ops import ReduceOp, reduce_into


def simulate(
    schedules: Sequence[Schedule], inputs: Sequence[torch.Tensor], op: ReduceOp
) -> list[torch.Tensor]:
    """Run every rank's schedule on copies of ``inputs`` (one flat tensor per rank) as MPI
    would, and return the buffers: the k-th send from a to b matches the k-th receive of b from
    a, and a step completes once each of its sends and receives has been matched by the peer's
    posting. Raises ValueError naming the rank when a length differs, ranks deadlock, or a
    message is left unreceived."""
    size = len(schedules)
    bufs = [t.clone().reshape(-1) for t in inputs]
    sent: dict[tuple[int, int], list[torch.Tensor]] = {}  # (src, dst) -> payloads in order
    received: dict[tuple[int, int], int] = {}  # (src, dst) -> receives posted by dst
    at = [0] * size  # current step of each rank
    posted: list[list[tuple[tuple[int, int], int, Transfer, bool]] | None] = [None] * size
    while True:
        progress = False
        for rank in range(size):
            if at[rank] >= len(schedules[rank]):
                continue
            st = schedules[rank][at[rank]]
            if posted[rank] is None:  # post every transfer of the step
                mine = []
                for t in st.sends:
                    _check_peer(rank, at[rank], t, size)
                    queue = sent.setdefault((rank, t.peer), [])
                    queue.append(bufs[rank][t.start : t.stop].clone())
                    mine.append(((rank, t.peer), len(queue) - 1, t, True))
                for t in st.recvs:
                    _check_peer(rank, at[rank], t, size)
                    key = (t.peer, rank)
                    received[key] = received.get(key, 0) + 1
                    mine.append((key, received[key] - 1, t, False))
                posted[rank] = mine
                progress = True
            waiting = posted[rank]
            assert waiting is not None
            if not all(
                index < (received.get(key, 0) if is_send else len(sent.get(key, [])))
                for key, index, _, is_send in waiting
            ):
                continue
            for key, index, t, is_send in waiting:
                if is_send:
                    continue
                data = sent[key][index]
                if data.numel() != t.numel:
                    raise ValueError(
                        f"rank {rank}: step {at[rank]} receives {t.numel} elements from rank "
                        f"{t.peer}, which sends {data.numel()}"
                    )
                target = bufs[rank][t.start : t.stop]
                if st.reduce:
                    reduce_into(target, data, op)
                else:
                    target.copy_(data)
            at[rank] += 1
            posted[rank] = None
            progress = True
        if all(at[r] >= len(schedules[r]) for r in range(size)):
            break
        if not progress:
            stuck = [f"rank {r} at step {at[r]}" for r in range(size) if at[r] < len(schedules[r])]
            raise ValueError("deadlock: a transfer is never matched; " + ", ".join(stuck))
    for (src, dst), queue in sent.items():
        if len(queue) != received.get((src, dst), 0):
            raise ValueError(
                f"rank {src}: sends {len(queue)} messages to rank {dst}, which "
                f"receives {received.get((src, dst), 0)}"
            )
    return bufs


def _check_peer(rank: int, index: int, t: Transfer, size: int) -> None:
    if not 0 <= t.peer < size or t.peer == rank:
        raise ValueError(f"rank {rank}: step {index} has peer {t.peer} (size {size})")


def traffic(schedule: Schedule) -> tuple[int, int]:
    """(elements sent, elements received) by one rank over its schedule."""
    return (
        sum(t.numel for s in schedule for t in s.sends),
        sum(t.numel for s in schedule for t in s.recvs),
    )
