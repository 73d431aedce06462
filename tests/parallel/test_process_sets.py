"""Process sets (issue #2): collectives on a subset of ranks registered with add_process_set,
a ValueError on ranks outside it, remove_process_set, and sets used concurrently.

The sets are built from size() (even ranks, odd ranks), so every test runs at any size: at 1
rank the even set is {0} and there is no odd set. Inputs are indexed by rank within the set.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from collective_reference import assert_reduced, block_rows, seed_of, small_ints

import commlayer as cl


def _set_inputs(name: str, ps: cl.ProcessSet, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Seeded input of each member of ``ps``, indexed by rank within the set."""
    return [small_ints(seed_of(name), member, shape, torch.float64) for member in ps.ranks]


def _collectives(ps: cl.ProcessSet) -> dict[str, Any]:
    """Run one of each collective on ``ps`` (a member calls this); name -> result."""
    me, n = ps.rank(), ps.size()
    flat = _set_inputs("ps.flat", ps, (5,))
    rows = _set_inputs("ps.rows", ps, (n + 1, 2))
    return {
        "allreduce": cl.allreduce(flat[me], op=cl.Sum, name="ps.allreduce", process_set=ps),
        "grouped": cl.grouped_allreduce(
            [flat[me], rows[me]], op=cl.Max, name="ps.grouped", process_set=ps
        ),
        "allgather": cl.allgather(rows[me], name="ps.allgather", process_set=ps),
        "broadcast": [  # root_rank is a global rank, as in Horovod
            cl.broadcast(flat[me], root, name=f"ps.broadcast.{root}", process_set=ps)
            for root in ps.ranks
        ],
        "alltoall": cl.alltoall(rows[me][:n], name="ps.alltoall", process_set=ps),
        "reducescatter": cl.reducescatter(
            rows[me], op=cl.Sum, name="ps.reducescatter", process_set=ps
        ),
        "barrier": cl.barrier(process_set=ps),
    }


def _check_collectives(ps: cl.ProcessSet, me: int, results: dict[str, Any]) -> None:
    """``me``: this rank's rank in the set (``ps`` may be removed by now)."""
    n = len(ps.ranks)
    flat = _set_inputs("ps.flat", ps, (5,))
    rows = _set_inputs("ps.rows", ps, (n + 1, 2))
    assert_reduced(results["allreduce"], flat, cl.Sum)
    assert_reduced(results["grouped"][0], flat, cl.Max)
    assert_reduced(results["grouped"][1], rows, cl.Max)
    assert torch.equal(results["allgather"], torch.cat(rows))
    for position, result in enumerate(results["broadcast"]):
        root = ps.ranks[position]
        assert torch.equal(result, flat[position]), f"rank {cl.rank()}: global root {root}"
    assert torch.equal(results["alltoall"], torch.cat([t[me : me + 1] for t in rows]))
    block = block_rows(n + 1, n)
    start = sum(block[:me])
    assert torch.equal(results["reducescatter"], sum(rows)[start : start + block[me]])
    assert results["barrier"] is None


def _refusals(ps: cl.ProcessSet) -> dict[str, Exception | None]:
    """Call each collective on ``ps`` from a rank outside it: name -> the exception raised."""
    x = torch.ones(2, 2)
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: cl.allreduce(x, name="ps.out.allreduce", process_set=ps),
        "allreduce_async_": lambda: cl.allreduce_async_(x, name="ps.out.ar_", process_set=ps),
        "grouped": lambda: cl.grouped_allreduce([x], name="ps.out.grouped", process_set=ps),
        "allgather": lambda: cl.allgather(x, name="ps.out.allgather", process_set=ps),
        "broadcast": lambda: cl.broadcast(x, 0, name="ps.out.broadcast", process_set=ps),
        "alltoall": lambda: cl.alltoall(
            x, splits=[2] + [0] * (ps.size() - 1), name="ps.out.alltoall", process_set=ps
        ),
        "reducescatter": lambda: cl.reducescatter(x, name="ps.out.rs", process_set=ps),
        "barrier": lambda: cl.barrier(process_set=ps),
    }
    raised: dict[str, Exception | None] = {}
    for what, call in calls.items():
        try:
            call()
            raised[what] = None
        except Exception as exc:  # noqa: BLE001 - the test reports what was raised
            raised[what] = exc
    return raised


def test_collectives_on_the_even_ranks() -> None:
    ranks = list(range(0, cl.size(), 2))
    ps = cl.add_process_set(ranks)
    facts = (ps.ranks, ps.size(), ps.included(), ps.rank())
    results = _collectives(ps) if ps.included() else _refusals(ps)
    removed, removed_again = cl.remove_process_set(ps), cl.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        cl.allreduce(torch.ones(1), name="ps.removed", process_set=ps)

    me = ranks.index(cl.rank()) if cl.rank() in ranks else -1
    assert facts == (ranks, len(ranks), cl.rank() in ranks, me)
    assert removed is True and removed_again is False
    if cl.rank() in ranks:
        _check_collectives(ps, me, results)
    else:
        wrong = {k: repr(e) for k, e in results.items() if not isinstance(e, ValueError)}
        assert not wrong, f"rank {cl.rank()} outside {ranks}: no ValueError from {wrong}"
        assert all(f"rank {cl.rank()}" in str(e) for e in results.values()), results


def test_a_removed_set_can_be_added_again() -> None:
    ps = cl.ProcessSet(range(cl.size() - 1, -1, -2))  # the last rank and every other one
    results = []
    for attempt in range(2):
        cl.add_process_set(ps)
        if ps.included():
            x = small_ints(seed_of("ps.again"), cl.rank(), (4,), torch.int32)
            results.append(cl.allreduce(x, op=cl.Sum, name=f"ps.again.{attempt}", process_set=ps))
        cl.remove_process_set(ps)
    if ps.ranks.count(cl.rank()):
        every = [small_ints(seed_of("ps.again"), r, (4,), torch.int32) for r in ps.ranks]
        assert len(results) == 2
        for result in results:
            assert_reduced(result, every, cl.Sum)


def test_disjoint_sets_and_the_global_set_at_once() -> None:
    # One name in flight on three sets at once: names are scoped by process set.
    evens, odds = list(range(0, cl.size(), 2)), list(range(1, cl.size(), 2))
    sets = [cl.add_process_set(ranks) for ranks in (evens, odds) if ranks]
    mine = next(ps for ps in sets if ps.included())
    x = small_ints(seed_of("ps.concurrent"), cl.rank(), (6,), torch.int64)
    in_set = cl.allreduce_async(x, op=cl.Sum, name="ps.concurrent", process_set=mine)
    in_world = cl.allreduce_async(x, op=cl.Max, name="ps.concurrent")
    set_result, world_result = cl.synchronize(in_set), cl.synchronize(in_world)
    for ps in sets:
        cl.remove_process_set(ps)

    every = [small_ints(seed_of("ps.concurrent"), r, (6,), torch.int64) for r in range(cl.size())]
    assert_reduced(set_result, [every[r] for r in mine.ranks], cl.Sum)
    assert_reduced(world_result, every, cl.Max)


def test_global_process_set() -> None:
    ps = cl.global_process_set
    assert (ps.size(), ps.rank(), ps.included()) == (cl.size(), cl.rank(), True)
    assert ps.ranks == list(range(cl.size()))
    assert cl.remove_process_set(ps) is False  # the global set cannot be removed


@pytest.mark.parametrize(
    "ranks",
    [[], [0, 0], [-1], "size"],
    ids=["empty", "duplicate", "negative", "out_of_range"],
)
def test_bad_ranks_are_refused_before_any_communication(ranks: Any) -> None:
    if ranks == "size":
        ranks = [0, cl.size()]
    with pytest.raises(ValueError, match=r"ranks"):
        cl.add_process_set(ranks)


def test_unregistered_set_and_root_outside_the_set_are_refused() -> None:
    with pytest.raises(ValueError, match="not registered"):
        cl.allreduce(torch.ones(2), name="ps.unregistered", process_set=cl.ProcessSet([0]))
    last = cl.size() - 1
    ps = cl.add_process_set([last])
    try:
        if ps.included():
            # root_rank is global: 0 is the set's first position but not in the set (size > 1)
            for bad in [0, last + 1, -1] if last else [1, -1]:
                with pytest.raises(ValueError, match=r"root_rank must be an int .*got"):
                    cl.broadcast(torch.ones(2), bad, name="ps.bad_root", process_set=ps)
    finally:
        cl.remove_process_set(ps)


def test_broadcasts_on_a_set_take_the_root_as_a_global_rank() -> None:
    """The set of the last two ranks (at 3 ranks: [1, 2]) with root_rank = the first of them:
    every broadcast form returns that rank's data (issue 20: it used to be read as a position
    in the set, and at 3 ranks rank 2's data came back on both, silently)."""
    n = cl.size()
    ranks = list(range(max(n - 2, 0), n))
    ps = cl.add_process_set(ranks)
    root = ranks[0]
    me = cl.rank()
    out: dict[str, Any] = {}
    if ps.included():
        x = torch.full((3,), float(me))
        out["broadcast"] = cl.broadcast(x, root, name="ps.g.broadcast", process_set=ps)
        y = torch.full((2,), float(me))
        cl.broadcast_(y, root, name="ps.g.broadcast_", process_set=ps)
        out["broadcast_"] = y
        out["async"] = cl.synchronize(
            cl.broadcast_async(x, root, name="ps.g.async", process_set=ps)
        )
        out["object"] = cl.broadcast_object({"from": me}, root, process_set=ps)
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            model.weight.fill_(float(me))
            model.bias.fill_(float(me))
        cl.broadcast_parameters(model.state_dict(), root, process_set=ps)
        out["parameters"] = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 + me, momentum=0.5)
        cl.broadcast_optimizer_state(optimizer, root, process_set=ps)
        out["lr"] = optimizer.param_groups[0]["lr"]
    cl.remove_process_set(ps)

    if out:
        expected = float(root)
        assert torch.equal(out["broadcast"], torch.full((3,), expected)), out
        assert torch.equal(out["broadcast_"], torch.full((2,), expected)), out
        assert torch.equal(out["async"], torch.full((3,), expected)), out
        assert out["object"] == {"from": root}, out
        assert all(torch.equal(p, torch.full_like(p, expected)) for p in out["parameters"]), out
        assert out["lr"] == 0.1 + root, out


def test_unnamed_operations_on_a_set_leave_global_names_in_step() -> None:
    """The documented pattern (docs/reference/collectives.md) ``if ps.included():
    cl.allreduce(t, process_set=ps)`` with no name: only
    members advance a counter, so the next unnamed global operation must not depend on it."""
    ps = cl.add_process_set([0])
    try:
        if ps.included():
            on_set = cl.allreduce(torch.ones(2), op=cl.Sum, process_set=ps)
            assert torch.equal(on_set, torch.ones(2))
        everyone = cl.allreduce(torch.ones(2), op=cl.Sum)  # unnamed, on every rank
    finally:
        cl.remove_process_set(ps)
    assert torch.equal(everyone, torch.full((2,), float(cl.size())))
