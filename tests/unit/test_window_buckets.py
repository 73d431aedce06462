"""Buckets that live in a shared-memory window (backends/shm.py's BucketWindow, comm/bucketer.py's
``house_in_window``), in one process: every "rank" maps the same numpy segments, and their
requests are driven round-robin by ``test()``, as each rank's engine drives its own."""

from __future__ import annotations

import functools
import itertools
import threading

import numpy as np
import pytest
import torch
from engine_harness import WAIT_S, run_engines

from commlayer.backends import shm
from commlayer.backends.loopback import LoopbackBackend
from commlayer.comm import bucketer
from commlayer.common.errors import RankDiedError
from commlayer.common.reduce_ops import ReduceOp, reduce_into, scale_into
from commlayer.compression import create
from commlayer.core.engine import Engine


class _Memory:
    """``size`` ranks' segments, each rank's Window a view of all of them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.raw: list[np.ndarray] = []

    def window(self, segment: int) -> _Window:
        if not self.raw:
            self.raw = [np.zeros(segment, dtype=np.uint8) for _ in range(self.size)]
        return _Window(self.raw)


class _Window:
    def __init__(self, raw: list[np.ndarray]) -> None:
        self.segments = list(raw)
        self.closed = False

    def sync(self) -> None:
        pass

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        self.segments = []


def _windows(size: int, nbytes: int) -> list[shm.BucketWindow]:
    memory = _Memory(size)
    return [
        shm.BucketWindow(r, size, nbytes, memory.window, f"unit-{id(memory)}-{r}")
        for r in range(size)
    ]


def _drive(requests: list[object]) -> None:
    done = [False] * len(requests)
    for _ in range(100):
        for r, request in enumerate(requests):
            done[r] = done[r] or request.test()  # type: ignore[attr-defined]
        if all(done):
            return
    raise AssertionError(f"not done: {done}")


def _regular(inputs: list[torch.Tensor], op: ReduceOp, scale: float) -> list[torch.Tensor]:
    """What SharedMemoryAllreduce (the regular window) gives each rank for ``inputs``."""
    size = len(inputs)
    memory = _Memory(size)
    ranks = [
        shm.SharedMemoryAllreduce(r, size, shm.CHUNK_BYTES, memory.window) for r in range(size)
    ]
    outputs = [torch.empty_like(t) for t in inputs]
    requests = [
        ranks[r].iallreduce_pieces([inputs[r]], [outputs[r]], [scale], op) for r in range(size)
    ]
    _drive(requests)
    return outputs


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize(
    ("op", "dtype"),
    [
        (ReduceOp.Average, torch.float32),
        (ReduceOp.Sum, torch.float64),
        (ReduceOp.Max, torch.bfloat16),
    ],
)
def test_the_same_bits_as_the_regular_window_on_every_rank(
    size: int, op: ReduceOp, dtype: torch.dtype
) -> None:
    numel = (3 * shm.CHUNK_BYTES) // dtype.itemsize + 77  # several chunks and a ragged end
    offset = 192  # a part after another one
    windows = _windows(size, offset + numel * dtype.itemsize)
    gen = torch.Generator().manual_seed(size)
    inputs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(size)]
    parts = [w.memory[offset : offset + numel * dtype.itemsize].view(dtype) for w in windows]
    for part, given in zip(parts, inputs):
        part.copy_(given)  # what backward left in each rank's segment
    scale = 1.0 / size if op == ReduceOp.Average else 1.0

    copied = shm.copied_bytes()
    _drive([w.iallreduce(offset, numel, dtype, op, scale) for w in windows])
    in_window, copied = shm.copied_bytes() - copied, shm.copied_bytes()

    expected = _regular(inputs, op, scale)
    regular = shm.copied_bytes() - copied
    for r in range(size):
        assert torch.equal(parts[r], expected[r]), r
        assert torch.equal(parts[r], parts[0])
    # communication_stats' window_copied_bytes, all ranks together: each element written into
    # the size - 1 other buckets, against copied in by size - 1 ranks and out by all
    assert in_window == (size - 1) * numel * dtype.itemsize
    assert regular == (2 * size - 1) * numel * dtype.itemsize
    assert all(w.seq == 2 for w in windows)  # two flags a part: arrived, reduced and handed on


class _Across:
    """The leg between nodes of ``nodes`` ranks (one per node, the same index in each): the
    k-th allreduce posted by every one of them completes once all have posted it, each then
    holding the reduction in node order (the one order of two operands, for a ring of two)."""

    def __init__(self, nodes: int) -> None:
        self.posted: list[list[torch.Tensor]] = [[] for _ in range(nodes)]
        self.done: set[int] = set()

    def post(self, node: int, part: torch.Tensor, op: ReduceOp) -> _AcrossRequest:
        self.posted[node].append(part)
        return _AcrossRequest(self, len(self.posted[node]) - 1, op)


class _AcrossRequest:
    def __init__(self, across: _Across, k: int, op: ReduceOp) -> None:
        self.across, self.k, self.op = across, k, op

    def test(self) -> bool:
        across, k = self.across, self.k
        if k not in across.done and all(len(p) > k for p in across.posted):
            parts = [p[k] for p in across.posted]
            total = parts[0].clone()
            for part in parts[1:]:
                reduce_into(total, part, self.op)
            for part in parts:
                part.copy_(total)
            across.done.add(k)
        return k in across.done


def _two_level(nodes: int, local: int, nbytes: int, op: ReduceOp) -> list[shm.BucketWindow]:
    """Global rank r = node * local + i: a window per node, i's slices across by _Across(i)."""
    acrosses = [_Across(nodes) for _ in range(local)]
    windows = []
    for node in range(nodes):
        memory = _Memory(local)
        for i in range(local):
            across = functools.partial(_post, acrosses[i], node)
            windows.append(
                shm.BucketWindow(i, local, nbytes, memory.window, f"unit2-{id(memory)}-{i}", across)
            )
    return windows


def _post(across: _Across, node: int, part: torch.Tensor, op: ReduceOp) -> _AcrossRequest:
    return across.post(node, part, op)


def _regular_two_level(
    inputs: list[torch.Tensor], nodes: int, local: int, op: ReduceOp, scale: float
) -> list[torch.Tensor]:
    """What the regular hierarchical window (SharedMemoryAllreduce with ``inter``) gives."""
    acrosses = [_Across(nodes) for _ in range(local)]
    ranks = []
    for node in range(nodes):
        memory = _Memory(local)
        ranks += [
            (shm.SharedMemoryAllreduce(i, local, shm.CHUNK_BYTES, memory.window), node, i)
            for i in range(local)
        ]
    outputs = [torch.empty_like(t) for t in inputs]
    requests: list[object] = []
    if local == 1:  # alone on its node: the whole buffer across (MPIBackend's shortcut)
        for node in range(nodes):
            outputs[node].copy_(inputs[node])
            requests.append(acrosses[0].post(node, outputs[node], op))
        ranks = []
    for r, (window, node, i) in enumerate(ranks):
        inter = functools.partial(_post_op, acrosses[i], node, op)
        requests.append(window.iallreduce(inputs[r], outputs[r], op, inter))
    _drive(requests)
    for out in outputs:  # the runner's postscale (the regular window's at its copy-out)
        if scale != 1.0:
            scale_into(out, scale, out)
    return outputs


def _post_op(across: _Across, node: int, op: ReduceOp, part: torch.Tensor) -> _AcrossRequest:
    return across.post(node, part, op)


@pytest.mark.parametrize(("nodes", "local"), [(2, 1), (2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize(
    ("op", "dtype"), [(ReduceOp.Average, torch.float32), (ReduceOp.Sum, torch.float64)]
)
def test_across_nodes_the_same_bits_as_the_regular_hierarchical_window(
    nodes: int, local: int, op: ReduceOp, dtype: torch.dtype
) -> None:
    """A window per node, each slice allreduced between nodes before it is handed on: every
    rank of every node ends with the regular hierarchical window's bits, and only the slices
    (1/local of the part a rank) went across."""
    size = nodes * local
    numel = (3 * shm.CHUNK_BYTES) // dtype.itemsize + 77
    offset = 128
    windows = _two_level(nodes, local, offset + numel * dtype.itemsize, op)
    gen = torch.Generator().manual_seed(10 * nodes + local)
    inputs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(size)]
    parts = [w.memory[offset : offset + numel * dtype.itemsize].view(dtype) for w in windows]
    for part, given in zip(parts, inputs):
        part.copy_(given)
    scale = 1.0 / size if op == ReduceOp.Average else 1.0
    across_bytes: list[int] = []

    def measured(window: shm.BucketWindow) -> None:
        inner = window.across
        assert inner is not None

        def counted(part: torch.Tensor, op: ReduceOp) -> object:
            across_bytes.append(part.numel() * part.element_size())
            return inner(part, op)

        window.across = counted  # type: ignore[assignment]

    for w in windows:
        measured(w)
    copied = shm.copied_bytes()
    _drive([w.iallreduce(offset, numel, dtype, op, scale) for w in windows])
    assert shm.copied_bytes() - copied == nodes * (local - 1) * numel * dtype.itemsize

    expected = _regular_two_level(inputs, nodes, local, op, scale)
    for r in range(size):
        assert torch.equal(parts[r], expected[r]), r
        assert torch.equal(parts[r], parts[0]), r
    # each rank took its own slices across: the part's bytes, once per node
    assert sum(across_bytes) == nodes * numel * dtype.itemsize
    assert all(w.seq == 2 for w in windows)


def test_across_nodes_a_rank_hands_its_slice_on_only_once_it_crossed() -> None:
    """Node 1 has not arrived: node 0's ranks reduce their slices in their window, but none
    is written into the other segment, and no request completes, until the leg across is
    done (a peer reading a half-reduced slice would be silent corruption)."""
    windows = _two_level(2, 2, 4096, ReduceOp.Sum)
    for r, w in enumerate(windows):
        w.memory[:4096].view(torch.float32).fill_(r + 1)
    requests = [w.iallreduce(0, 1024, torch.float32, ReduceOp.Sum, 1.0) for w in windows]
    for _ in range(3):
        assert not requests[0].test() and not requests[1].test()
    a, b = (w.memory[:4096].view(torch.float32) for w in windows[:2])
    assert bool((a[:512] == 3).all()) and bool((a[512:] == 1).all())  # my slice, mine only
    assert bool((b[512:] == 3).all()) and bool((b[:512] == 2).all())
    _drive(requests)
    for w in windows:
        assert bool((w.memory[:4096].view(torch.float32) == 10).all())


def test_no_rank_completes_before_every_rank_is_done_with_its_segment() -> None:
    """A rank's request completes only once every rank handed its slice on: then no peer reads
    or writes its segment any more (backward may write the next step's gradients there)."""
    windows = _windows(3, 4096)
    requests = [w.iallreduce(0, 1024, torch.float32, ReduceOp.Sum, 1.0) for w in windows]
    assert not requests[0].test()  # arrived; the others have not
    assert not requests[1].test()
    assert not requests[0].test()
    assert not requests[2].test()  # every rank arrived: rank 2 reduced its slice, flag 2 up
    assert not requests[0].test()  # rank 0 reduced too; rank 1 has not
    assert not requests[2].test()
    assert requests[1].test()  # rank 1 reduces: every slice is everywhere
    assert requests[0].test() and requests[2].test()


def test_offsets_channels_and_close() -> None:
    (window, other) = _windows(2, 1000)
    assert window.nbytes == 1024  # whole cache lines
    inside = window.memory[128:256].view(torch.float32)
    assert window.offset_of(inside) == 128
    assert window.offset_of(torch.zeros(4)) is None
    assert window.offset_of(window.memory[1000:1024]) == 1000
    assert shm.window_channel(inside) == f"window:{window.token}:128"
    assert shm.window_of(shm.window_channel(inside)) == (window, 128)
    assert shm.window_channel(torch.zeros(4)) == ""
    with pytest.raises(ValueError, match="no part"):
        window.iallreduce(1020, 2, torch.float32, ReduceOp.Sum, 1.0)
    window.close()
    other.close()
    assert shm.window_channel(inside) == ""  # no longer announced
    assert shm.window_of(f"window:{window.token}:128") == (None, 128)
    assert not shm.live_windows()


def _params(
    *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in shapes]


def test_house_in_window_moves_the_owned_host_parts_in_plan_order() -> None:
    none, fp16 = create("none"), create("fp16")
    a, b, c = _params((3, 5), (7,), (2, 2))
    d = _params((5,), dtype=torch.float64)[0]
    compressed = _params((4,))[0]
    names = {p: f"grad.{i}" for i, p in enumerate([a, b, c, d, compressed])}
    compressor_of = {a: none, b: none, c: none, d: none, compressed: fp16}
    buckets = [
        bucketer.bucket([a, b, d], compressor_of, names, lambda _: False, own=True),
        bucketer.bucket([c, compressed], compressor_of, names, lambda _: False, own=True),
    ]
    asked: list[int] = []
    windows: list[shm.BucketWindow] = []

    def make(nbytes: int) -> shm.BucketWindow:
        asked.append(nbytes)
        windows.extend(_windows(2, nbytes))
        return windows[0]

    window = bucketer.house_in_window(buckets, make)
    try:
        flats = [part.flat for b in buckets for part in b.parts if part.flat is not None]
        offsets = [window.offset_of(flat) for flat in flats]
        # a+b float32 (22 x 4 B), then d float64 at 128, then c at 192; fp16's part owns nothing
        assert offsets == [0, 128, 192]
        assert asked == [192 + 16]
        part = buckets[0].parts[0]
        assert [tuple(v.shape) for v in part.views] == [(3, 5), (7,)]
        assert part.views[1].data_ptr() == part.flat.data_ptr() + 15 * 4  # type: ignore[union-attr]
        assert buckets[1].parts[1].flat is None  # compressed: the gradients stay where they are
        assert all(bool((flat == 0).all()) for flat in flats)
    finally:
        for w in windows:
            w.close()


def test_house_in_window_changes_nothing_where_no_window_is_made() -> None:
    a, b = _params((3,), (4,))
    names = {a: "grad.a", b: "grad.b"}
    none = create("none")
    buckets = [bucketer.bucket([a, b], {a: none, b: none}, names, lambda _: False, own=True)]
    flat = buckets[0].parts[0].flat
    assert bucketer.house_in_window(buckets, lambda nbytes: None) is None
    assert buckets[0].parts[0].flat is flat
    unowned = [bucketer.bucket([a, b], {a: none, b: none}, names, lambda _: False)]
    calls = itertools.count()
    assert bucketer.house_in_window(unowned, lambda n: next(calls)) is None
    assert next(calls) == 0  # nothing to house: no window asked for (no collective)


def test_the_engine_notices_a_peer_that_died_before_arriving() -> None:
    """The in-window allreduce's flag wait is the engine's wait on a request (``test()`` never
    blocks), so a peer that dies before it raises its flag is noticed by the pid check, as in
    any collective: RankDiedError naming it, not a hang."""
    backends: dict[int, LoopbackBackend] = {}
    windows = _windows(2, 4096)
    killed = threading.Event()

    def keep(backend: LoopbackBackend) -> LoopbackBackend:
        backends[backend.rank] = backend
        return backend

    def fn(engine: Engine) -> str | None:
        if engine.rank == 1:
            backends[1].world.kill(1)  # as if the process crashed before its backward ended
            killed.set()
            return None
        killed.wait(WAIT_S)
        request = windows[0].iallreduce(0, 1024, torch.float32, ReduceOp.Sum, 1.0)
        with pytest.raises(RankDiedError) as info:
            engine._wait(request)
        return str(info.value)

    errors = run_engines(2, fn, start=False, wrap=keep)
    assert "rank 0: rank(s) [1] exited" in str(errors[0])
    assert windows[0].seq == 1 and windows[1].seq == 0  # rank 0 arrived; rank 1 never did
