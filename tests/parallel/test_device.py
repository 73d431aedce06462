"""Device tensors through the collectives and DistributedOptimizer (issue 25): every collective
on CUDA tensors, and the same cases on CPU tensors forced through the staging seam
(commlayer/core/device.py), which is how CI, without a GPU, checks the seam's logic: host
stand-ins, copies in and out, results written into the caller's tensors or made on the
device, alltoall's splits on the CPU.

The CUDA cases skip with the reason where torch sees no GPU (the same on every rank of a job on
one machine). Several ranks share one GPU here: staging goes through host memory, which needs
no GPU of a rank's own.

Collectives first, asserts last (a rank failing an assert must not leave the others waiting).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from collective_reference import seed_of, small_ints
from direct_cpu import force_direct

import commlayer as cl
from commlayer.core import device

DEVICES = ["staged-cpu", "cuda"]


@pytest.fixture(params=DEVICES)
def dev(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The device tensors are made on: "cpu" with CPU tensors staged like CUDA ones, or "cuda".
    Counts the host stand-ins made, to prove the seam ran."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: torch.cuda.is_available() is False")
        torch.cuda.set_device(cl.local_rank() % torch.cuda.device_count())
        yield "cuda"
        return
    monkeypatch.setattr(device, "STAGE_CPU", True)
    yield "cpu"


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    real = device._host_buffer

    def counting(like: torch.Tensor) -> torch.Tensor:
        made.append(like.numel())
        return real(like)

    monkeypatch.setattr(device, "_host_buffer", counting)
    return made


def _staged(dev: str) -> bool:
    """Whether this job's CUDA float tensors are staged (else the backend takes them directly:
    a CUDA-aware MPI, the torch backend's NCCL group; device.path decides)."""
    from commlayer.core import runtime

    if dev != "cuda":
        return True
    backend = runtime.engine().backend(0)
    return device.path(backend, torch.device("cuda", 0), torch.float32) is None


def _inputs(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list:
    return [small_ints(seed_of(name), r, shape, dtype) for r in range(cl.size())]


def test_allreduce_forms(dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _counted(monkeypatch)
    xs = _inputs("dev.allreduce", (5, 3))
    mine = xs[cl.rank()].to(dev)
    out = cl.allreduce(mine, op=cl.Sum, name="dev.allreduce")
    inplace = mine.clone()
    same = cl.allreduce_(inplace, op=cl.Sum, name="dev.allreduce_")
    avg = cl.synchronize(cl.allreduce_async(mine, name="dev.allreduce.avg"))
    scaled = cl.allreduce(mine, op=cl.Sum, prescale_factor=2.0, postscale_factor=0.5,
                          name="dev.allreduce.scaled")  # fmt: skip
    expected = torch.stack(xs).sum(0)
    assert out.device.type == dev and avg.device.type == dev
    assert torch.equal(out.cpu(), expected)
    assert same is inplace and torch.equal(inplace.cpu(), expected)
    assert torch.equal(mine.cpu(), xs[cl.rank()])  # out-of-place: input untouched
    assert torch.allclose(avg.cpu(), expected / cl.size())
    assert torch.equal(scaled.cpu(), expected)
    assert bool(made) is _staged(dev), "staged without host stand-ins, or direct with some"


def test_grouped_allreduce(dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _counted(monkeypatch)
    shapes = [(7,), (2, 3), (1,), (1000,)]
    per_rank = [_inputs(f"dev.grouped.{i}", s) for i, s in enumerate(shapes)]
    mine = [xs[cl.rank()].to(dev) for xs in per_rank]
    outs = cl.grouped_allreduce(mine, op=cl.Sum, name="dev.grouped")
    works = [t.clone() for t in mine]
    same = cl.grouped_allreduce_(works, op=cl.Max, name="dev.grouped_")
    for xs, out, work, result in zip(per_rank, outs, works, same):
        assert out.device.type == dev and result is work
        assert torch.equal(out.cpu(), torch.stack(xs).sum(0))
        assert torch.equal(work.cpu(), torch.stack(xs).max(0).values)
    assert len(made) >= 2 * len(shapes) if _staged(dev) else not made


def test_allgather_broadcast_alltoall_reducescatter(dev: str) -> None:
    size, me = cl.size(), cl.rank()
    rows = [1 + r % 3 for r in range(size)]  # dim 0 differs per rank
    gathered_in = [
        small_ints(seed_of("dev.gather"), r, (rows[r], 4), torch.float32) for r in range(size)
    ]
    gathered = cl.allgather(gathered_in[me].to(dev), name="dev.allgather")
    roots = _inputs("dev.bcast", (6,), torch.int64)
    root = size - 1
    bcast = cl.broadcast(roots[me].to(dev), root, name="dev.bcast")
    inplace = roots[me].to(dev)
    bcast_same = cl.broadcast_(inplace, root, name="dev.bcast_")
    splits = [(me + q) % 2 + 1 for q in range(size)]
    sent = small_ints(seed_of("dev.a2a"), me, (sum(splits), 2), torch.float32)
    rows_in, received = cl.alltoall(sent.to(dev), splits=splits, name="dev.alltoall")
    scatter_in = _inputs("dev.rs", (2 * size + 1, 3))
    scattered = cl.reducescatter(scatter_in[me].to(dev), op=cl.Sum, name="dev.reducescatter")
    # expected
    assert gathered.device.type == dev and torch.equal(gathered.cpu(), torch.cat(gathered_in))
    assert bcast.device.type == dev and torch.equal(bcast.cpu(), roots[root])
    assert bcast_same is inplace and torch.equal(inplace.cpu(), roots[root])
    assert rows_in.device.type == dev
    assert received.device.type == "cpu"  # as Horovod's received splits
    want = [(q + me) % 2 + 1 for q in range(size)]
    assert received.tolist() == want
    assert rows_in.shape == (sum(want), 2)
    total = torch.stack(scatter_in).sum(0)
    counts = [(2 * size + 1) // size + (1 if r < (2 * size + 1) % size else 0) for r in range(size)]
    start = sum(counts[:me])
    assert scattered.device.type == dev
    assert torch.equal(scattered.cpu(), total[start : start + counts[me]])


def test_optimizer_step_matches_cpu(dev: str) -> None:
    """DistributedOptimizer on a model on ``dev``: the averaged gradients and the parameters
    after two steps equal the same job's CPU model (same inputs, same start)."""
    results = {}
    for where in ("cpu", dev):
        model = _train_two_steps(where, where, 100)
        results[where] = [p.detach().cpu() for p in model.parameters()]
        assert all(p.device.type == where for p in model.parameters())
    for a, b in zip(results["cpu"], results[dev]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _train_two_steps(where: str, prefix: str, seed: int) -> torch.nn.Module:
    """A small model on ``where`` after two DistributedOptimizer steps on inputs of this
    rank's seed (``seed`` + rank), its parameters named with ``prefix``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(
        where
    )
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
    )
    g = torch.Generator().manual_seed(seed + cl.rank())
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(where)), y.to(where)).backward()
        opt.step()
    return model


def test_other_devices_refused() -> None:
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"rank \d+: allreduce: tensor is on meta; collectives"):
        cl.allreduce(meta, name="dev.meta")


# -- the direct path (device.py, **Direct**), with CPU tensors forced through it ---------------
# Where a backend takes a device's tensors as they are (a CUDA-aware MPI, the torch backend's
# NCCL group), the engine gets the caller's own tensors, makes its buffers on their device and
# waits on the producer's event (host-side for MPI, as a stream wait for NCCL) before the
# collective; the future completes without waiting for the engine's device work (its marks
# order the readers: test_stream_order.py). On the CPU the same code runs with
# ``device.DIRECT_CPU`` set and fake events that log what was done to them; under the torch
# backend the data travels over a second gloo group standing for the NCCL one.


class _FakeEvent:
    """Stands for a CUDA event on the CPU: logs what the engine does with it."""

    made = 0

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log
        _FakeEvent.made += 1
        self.serial = _FakeEvent.made  # (ids of collected events are reused)
        self.role = ""  # "mark-": a future's mark (device.marks), not a producer's event

    def query(self) -> bool:
        self.log.append((self.role + "query", self.serial))
        return True

    def wait(self, stream: object = None) -> None:
        self.log.append((self.role + "wait", self.serial))

    def synchronize(self) -> None:
        self.log.append((self.role + "synchronize", self.serial))


def _tag_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The events of futures' marks log as "mark-...": once a CUDA device is marked (on a GPU
    machine, after any test that used it), a reader's stream waits on them (``device.follow``,
    a stream wait on either route, test_stream_order.py's subject), which is not the wait for
    the producer that the route asks for."""
    marks = device.marks

    def tagged() -> Any:
        found = marks()
        for _, _, event in found or ():
            if isinstance(event, _FakeEvent):
                event.role = "mark-"
        return found

    monkeypatch.setattr(device, "marks", tagged)


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list, list]]:
    """(the wait the route asks for, the event log, the data calls' groups under torch):
    "stream" under the torch backend (as NCCL), "host" under MPI (as a CUDA-aware MPI)."""
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(device, "_event", lambda stream: _FakeEvent(log))
    _tag_marks(monkeypatch)
    route, groups = force_direct(monkeypatch)
    made = _counted(monkeypatch)
    yield route.wait, log, groups
    assert not made, f"the direct path made host stand-ins: {made}"


def test_direct_allreduce_forms(direct: tuple[str, list, list]) -> None:
    wait, log, groups = direct
    xs = _inputs("direct.allreduce", (5, 3))
    mine = xs[cl.rank()].clone()
    out = cl.allreduce(mine, op=cl.Sum, name="direct.allreduce")
    inplace = mine.clone()
    same = cl.allreduce_(inplace, op=cl.Sum, name="direct.allreduce_")
    shapes = [(7,), (2, 3), (1,), (1000,)]
    per_rank = [_inputs(f"direct.grouped.{i}", s) for i, s in enumerate(shapes)]
    grouped = cl.grouped_allreduce([xs[cl.rank()] for xs in per_rank], op=cl.Max,
                                   name="direct.grouped")  # fmt: skip
    avg = cl.allreduce(mine, name="direct.avg")
    expected = torch.stack(xs).sum(0)
    assert torch.equal(out, expected) and same is inplace and torch.equal(inplace, expected)
    assert torch.equal(mine, xs[cl.rank()])
    assert torch.allclose(avg, expected / cl.size())
    for xs, result in zip(per_rank, grouped):
        assert torch.equal(result, torch.stack(xs).max(0).values)
    _assert_event_protocol(wait, log, operations=4)
    if groups:  # torch backend: the data over the data group, the negotiation over gloo's
        data, calls = groups[0], groups[1:]
        if cl.size() > 1:
            assert data in calls, "no allreduce went over the data group"
            backend = runtime_backend()
            # on one machine the negotiation goes through the shared-memory window
            windowed = backend.window_capable and backend._shm is not None
            assert windowed or backend.group in calls, (
                "the negotiation went neither through the window nor over the control group"
            )


def runtime_backend() -> Any:
    from commlayer.core import runtime

    return runtime.engine()._global.backend


def _assert_event_protocol(wait: str, log: list[tuple[str, int]], operations: int) -> None:
    """Every operation's producer event was waited for as its route asks (polled host-side for
    MPI, a stream wait for NCCL), and no event was synchronized: the futures complete at once,
    ordered by their marks (issue 35: ``Direct.done`` synchronized one per operation)."""
    waited = [e for what, e in log if what == ("query" if wait == "host" else "wait")]
    other = [e for what, e in log if what == ("wait" if wait == "host" else "query")]
    synchronized = [e for what, e in log if what.endswith("synchronize")]
    assert len(set(waited)) >= operations, log
    assert not other, f"the {wait} route waited the other way: {log}"
    assert not synchronized, f"the engine waited for the device host-side: {log}"


def test_direct_other_collectives(direct: tuple[str, list, list]) -> None:
    wait, log, _ = direct
    size, me = cl.size(), cl.rank()
    rows = [1 + r % 3 for r in range(size)]
    gathered_in = [
        small_ints(seed_of("direct.gather"), r, (rows[r], 4), torch.float32) for r in range(size)
    ]
    gathered = cl.allgather(gathered_in[me], name="direct.allgather")
    roots = _inputs("direct.bcast", (6,), torch.int64)
    bcast = cl.broadcast(roots[me], size - 1, name="direct.bcast")
    splits = [(me + q) % 2 + 1 for q in range(size)]
    sent = small_ints(seed_of("direct.a2a"), me, (sum(splits), 2), torch.float32)
    rows_in, received = cl.alltoall(sent, splits=splits, name="direct.alltoall")
    scatter_in = _inputs("direct.rs", (2 * size + 1, 3))
    scattered = cl.reducescatter(scatter_in[me], op=cl.Sum, name="direct.reducescatter")
    assert torch.equal(gathered, torch.cat(gathered_in))
    assert torch.equal(bcast, roots[size - 1])
    assert received.tolist() == [(q + me) % 2 + 1 for q in range(size)]
    assert rows_in.shape == (sum(received.tolist()), 2)
    total = torch.stack(scatter_in).sum(0)
    counts = [(2 * size + 1) // size + (1 if r < (2 * size + 1) % size else 0) for r in range(size)]
    assert torch.equal(scattered, total[sum(counts[:me]) : sum(counts[: me + 1])])
    _assert_event_protocol(wait, log, operations=4)


def test_direct_optimizer_step_matches_plain(direct: tuple[str, list, list]) -> None:
    """DistributedOptimizer through the direct path: the parameters after two steps equal those
    of the same model trained with DIRECT_CPU off, in the same job."""
    results = []
    for forced in (False, True):
        route = device.DIRECT_CPU
        if not forced:
            device.DIRECT_CPU = None
        try:
            model = _train_two_steps("cpu", f"direct{forced}", 200)
        finally:
            device.DIRECT_CPU = route
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_direct_channel_mismatch_fails_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operation some ranks send over a channel (NCCL) and others not (staged, over gloo)
    would never meet: the negotiation refuses it on every rank, naming the channel."""
    if cl.size() == 1:
        pytest.skip("needs 2 ranks")
    if cl.rank() == 0:
        monkeypatch.setattr(device, "DIRECT_CPU", device.Path("host", "test-channel"))
    with pytest.raises(cl.TensorMismatchError, match="data channel differs across ranks"):
        cl.allreduce(torch.ones(3), name="direct.mismatch")
