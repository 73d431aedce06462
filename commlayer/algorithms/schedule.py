"""Schedules: what one rank does to allreduce a flat buffer, as data.

An algorithm is a function ``(rank, size, numel, topology) -> list[Step]``. A step posts all its
sends and receives at once; sends read the buffer as it was before the step, receives land in
scratch memory and are applied to the buffer (reduced into it, or copied over it) in their
listed order, each once it and those before it arrived and no send of the step still reads its
range: so the executor reduces the first piece of a chunked step while the next ones are still
on the wire. The same list is run by the executor (executor.py), costed without any
communication (costmodel/model.py), checked by the tests without any (tests/unit/schedule_check.py),
and can be exported as per-rank traces for a simulator. No algorithm is written twice.

Ranges are in elements of the flat buffer. Empty ranges are never listed, so buffers smaller
than the rank count work: both ends of a transfer compute the same ranges and skip the same
empty ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transfer:
    """buf[start:stop] to or from ``peer``."""

    peer: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Step:
    """One round: post ``sends`` and ``recvs``, wait for all, then apply every receive:
    reduced into its range when ``reduce``, copied over it otherwise."""

    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()
    reduce: bool = True

    @property
    def early(self) -> bool:
        """Receives may be applied while the step's sends are still in flight: no send range
        overlaps a receive range (the sends' span is disjoint from the receives')."""
        if not self.sends or not self.recvs:
            return True
        send_lo, send_hi = min(t.start for t in self.sends), max(t.stop for t in self.sends)
        recv_lo, recv_hi = min(t.start for t in self.recvs), max(t.stop for t in self.recvs)
        return send_hi <= recv_lo or recv_hi <= send_lo


Schedule = list[Step]


def blocks(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering [0, numel), sizes differing by at most one (the
    first ones larger)."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def step(
    sends: Sequence[tuple[int, int, int]] = (),
    recvs: Sequence[tuple[int, int, int]] = (),
    reduce: bool = True,
) -> Step | None:
    """A Step from (peer, start, stop) triples with empty ranges dropped; None if nothing
    is left (callers skip it: every rank drops the same empty transfers)."""
    s = tuple(Transfer(p, a, b) for p, a, b in sends if b > a)
    r = tuple(Transfer(p, a, b) for p, a, b in recvs if b > a)
    return Step(s, r, reduce) if s or r else None


def compact(steps: Sequence[Step | None]) -> Schedule:
    return [s for s in steps if s is not None]


def relabel(schedule: Schedule, peers: Sequence[int], offset: int = 0) -> Schedule:
    """A sub-schedule moved into place: peer i becomes ``peers[i]`` and ranges shift by
    ``offset`` (a schedule built for a group of ranks, on one block of the buffer)."""
    return [
        Step(
            tuple(Transfer(peers[t.peer], t.start + offset, t.stop + offset) for t in s.sends),
            tuple(Transfer(peers[t.peer], t.start + offset, t.stop + offset) for t in s.recvs),
            s.reduce,
        )
        for s in schedule
    ]


# Ring steps cut a block of more than this many elements into pieces of at most this many
# (4 MiB of float32), one message each: the executor reduces a piece while the next is in flight.
RING_CHUNK_ELEMENTS = 1 << 20


def pieces(peer: int, start: int, stop: int, chunk: int) -> list[tuple[int, int, int]]:
    """[start, stop) to or from ``peer`` as ceil(len / chunk) near-equal (peer, start, stop)
    pieces; both ends of a transfer cut it the same way."""
    count = max(1, -(-(stop - start) // chunk))
    return [(peer, start + a, start + b) for a, b in blocks(stop - start, count)]


def ring_phases(
    index: int,
    members: Sequence[int],
    ranges: Sequence[tuple[int, int]],
) -> tuple[Schedule, Schedule]:
    """(reduce-scatter, allgather) of a ring over ``members`` (this rank is members[index]) on
    one range per member; after the reduce-scatter this rank holds range (index + 1) mod g.
    Blocks longer than RING_CHUNK_ELEMENTS (read at each call) travel in pieces."""
    chunk = RING_CHUNK_ELEMENTS
    g = len(members)
    right, left = members[(index + 1) % g], members[(index - 1) % g]
    scatter: list[Step | None] = []
    gather: list[Step | None] = []
    for s in range(g - 1):
        for out, into, reduce in (
            (ranges[(index - s) % g], ranges[(index - s - 1) % g], True),
            (ranges[(index + 1 - s) % g], ranges[(index - s) % g], False),
        ):
            sends, recvs = pieces(right, *out, chunk), pieces(left, *into, chunk)
            (scatter if reduce else gather).append(step(sends, recvs, reduce))
    return compact(scatter), compact(gather)


def halving_doubling(v: int, p2: int, numel: int, masks: Sequence[int]) -> Schedule:
    """Reduce-scatter by recursive halving over the bits ``masks`` (in that order), then
    allgather by recursive doubling over them in reverse, among p2 = 2^k ranks on p2 blocks.
    Partners of a step hold the same range (they differ only in bits not yet used), so any
    order of the bits is correct; the order decides which partner carries the big halves."""
    b = blocks(numel, p2)

    def span(lo: int, hi: int) -> tuple[int, int]:
        return b[lo][0], b[hi - 1][1]

    steps = []
    lo, hi = 0, p2
    for mask in masks:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        steps.append(step(sends=[(v ^ mask, *span(*give))], recvs=[(v ^ mask, *span(*keep))]))
        lo, hi = keep
    for mask in reversed(masks):
        width = hi - lo
        other = (lo - width, lo) if v & mask else (hi, hi + width)
        steps.append(
            step(sends=[(v ^ mask, *span(lo, hi))], recvs=[(v ^ mask, *span(*other))], reduce=False)
        )
        lo, hi = min(lo, other[0]), max(hi, other[1])
    return compact(steps)


# -- non-powers of two: fold the extra ranks in, and back out ------------------------------------
def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@dataclass(frozen=True, slots=True)
class Fold:
    """The usual reduction to a power of two p2 <= size: with rem = size - p2, each even rank
    r < 2*rem hands its buffer to r + 1 first and gets the result back last; the others take
    virtual ranks 0..p2-1 (odd r < 2*rem: r // 2; r >= 2*rem: r - rem)."""

    size: int
    p2: int
    rem: int

    @classmethod
    def of(cls, size: int) -> Fold:
        p2 = largest_power_of_two(size)
        return cls(size, p2, size - p2)

    def virtual(self, rank: int) -> int | None:
        if rank < 2 * self.rem:
            return rank // 2 if rank % 2 else None
        return rank - self.rem

    def real(self, virtual: int) -> int:
        return 2 * virtual + 1 if virtual < self.rem else virtual + self.rem

    def wrap(self, rank: int, numel: int, core: Callable[[int], Schedule]) -> Schedule:
        """Fold-in step, ``core(virtual rank)`` (peers given as virtual ranks, mapped here),
        fold-out step."""
        if rank < 2 * self.rem and rank % 2 == 0:
            return compact(
                [
                    step(sends=[(rank + 1, 0, numel)]),
                    step(recvs=[(rank + 1, 0, numel)], reduce=False),
                ]
            )
        v = self.virtual(rank)
        assert v is not None
        body = relabel(core(v), [self.real(u) for u in range(self.p2)])
        if rank < 2 * self.rem:
            return compact(
                [step(recvs=[(rank - 1, 0, numel)])] + body + [step(sends=[(rank - 1, 0, numel)])]
            )
        return body
