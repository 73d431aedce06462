"""The exchange plan of one epoch: which samples each rank sends, to whom, in which chunk.

Every rank computes the same plan from (seed, epoch, shard sizes) without a message:

1. Rank r sends ``round(Q * size_r)`` of its samples, chosen by a generator seeded with
   (seed, epoch, r): only r needs to know *which* samples, every rank knows *how many*. Where
   the store gives its samples in age groups (pack files: a group per pack, oldest first), the
   oldest groups are sent first, the samples of each group in a random order: whole packs
   leave and are unlinked without a copy (packs.py); one group is the random choice of the
   research.
2. The senders' slots, in rank order, are dealt to receivers by one permutation drawn from
   (seed, epoch): the destination list holds rank r exactly as often as r sends, so every
   shard keeps its size across epochs (uneven shards stay uneven, none grows past
   ``(1 + Q) * size_r`` while an exchange is in flight). A slot dealt to its own sender stays
   where it is (at Q = 1 that is 1/M of the samples, as under a global shuffle).
3. Each rank's slots are split into ``chunks`` consecutive parts; chunk k of every rank moves in
   one alltoall, so the exchange runs as ``chunks`` collectives spread over the epoch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """One rank's part of one epoch's exchange."""

    epoch: int
    # (sample id, destination rank) per chunk, this rank's sends only; self-sends left out.
    sends: tuple[tuple[tuple[int, int], ...], ...]
    # samples this rank receives in all, and from each sender (self excluded).
    receives_from: tuple[int, ...]

    @property
    def sent_ids(self) -> list[int]:
        return [sample for chunk in self.sends for sample, _ in chunk]


def send_counts(fraction: float, shard_sizes: Sequence[int]) -> list[int]:
    """How many samples each rank puts into the exchange."""
    return [round(fraction * n) for n in shard_sizes]


def destinations(seed: int, epoch: int, counts: Sequence[int]) -> list[int]:
    """The receiver of every slot, slots in rank order (rank 0's first)."""
    deal = [rank for rank, n in enumerate(counts) for _ in range(n)]
    random.Random(f"commlayer.data.deal:{seed}:{epoch}").shuffle(deal)
    return deal


def local_order(seed: int, epoch: int, rank: int, ids: Sequence[int]) -> list[int]:
    """This rank's visiting order of its samples in ``epoch`` (a local shuffle)."""
    order = sorted(ids)
    random.Random(f"commlayer.data.order:{seed}:{epoch}:{rank}").shuffle(order)
    return order


def make_plan(
    seed: int,
    epoch: int,
    fraction: float,
    rank: int,
    ids: Sequence[int],
    shard_sizes: Sequence[int],
    chunks: int,
    groups: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """This rank's sends and receive counts for ``epoch`` (see the module docstring);
    ``groups``: ``ids`` by age, oldest first (None: one group)."""
    counts = send_counts(fraction, shard_sizes)
    deal = destinations(seed, epoch, counts)
    start = sum(counts[:rank])
    pick = random.Random(f"commlayer.data.pick:{seed}:{epoch}:{rank}")
    chosen: list[int] = []
    for group in [ids] if groups is None else groups:
        if len(chosen) >= counts[rank]:
            break
        order = sorted(group)
        pick.shuffle(order)
        chosen += order
    mine = list(zip(chosen[: counts[rank]], deal[start : start + counts[rank]]))
    n = len(mine)
    sends = tuple(
        tuple(pair for pair in mine[k * n // chunks : (k + 1) * n // chunks] if pair[1] != rank)
        for k in range(chunks)
    )
    receives = [0] * len(shard_sizes)
    offset = 0
    for sender, count in enumerate(counts):
        if sender != rank:
            receives[sender] = deal[offset : offset + count].count(rank)
        offset += count
    return Plan(epoch, sends, tuple(receives))
