"""join() with uneven data (issue #2): rank r runs r + 1 steps, then joins.

While ranks are joined the others' allreduces complete with the joined ranks contributing zeros;
join returns the rank that joined last, the same on every rank. By default (join_mode=horovod,
issue 20) Average divides by size() and allgather, broadcast, alltoall and reducescatter raise,
as in Horovod; with join_mode=active Average divides by the ranks that have not joined,
allgather and reducescatter run over them, and broadcast from a joined root and alltoall raise.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from collective_reference import assert_reduced, block_rows, seed_of, small_ints
from restart import reinit

import commlayer as cl


def _input(name: str, rank: int, shape: tuple[int, ...] = (3, 2)) -> torch.Tensor:
    return small_ints(seed_of(name), rank, shape, torch.float64)


def _attempt(call: Callable[[], torch.Tensor]) -> torch.Tensor | cl.CommlayerError:
    try:
        return call()
    except cl.CommlayerError as exc:
        return exc


@pytest.mark.parametrize("mode", ["horovod", "active"])
def test_uneven_steps_then_join(mode: str) -> None:
    # Step s runs on ranks s..size-1; ranks below s have joined (they never submit step s, so
    # its collectives can only run once they have). Rank size-1 runs the last step alone after
    # everyone else joined, so it joins last.
    if mode != "horovod":
        reinit(join_mode=mode)
    me, n = cl.rank(), cl.size()
    steps = []
    for step in range(me + 1):
        name = f"join.step.{step}"
        mine = _input(name, me)
        summed = cl.allreduce(mine, op=cl.Sum, name=f"{name}.sum")
        averaged = cl.allreduce(mine, op=cl.Average, name=f"{name}.average")
        grouped = cl.grouped_allreduce([mine, mine[0]], op=cl.Max, name=f"{name}.grouped")
        gathered = _attempt(
            lambda mine=mine, name=name: cl.allgather(mine[: me % 2 + 1], name=f"{name}.allgather")
        )
        scattered = _attempt(
            lambda mine=mine, name=name: cl.reducescatter(
                mine, op=cl.Average, name=f"{name}.reducescatter"
            )
        )
        steps.append((summed, averaged, grouped, gathered, scattered))
    last = cl.join()
    every_last = cl.allgather(torch.tensor([last]), name="join.step.last")
    if mode != "horovod":
        reinit()

    for step, (summed, averaged, grouped, gathered, scattered) in enumerate(steps):
        name = f"join.step.{step}"
        active = list(range(step, n))
        inputs = [_input(name, r) for r in active]
        zeros = [torch.zeros(3, 2, dtype=torch.float64)] * (n - len(active))
        assert_reduced(summed, inputs, cl.Sum)
        if mode == "active":
            assert_reduced(averaged, inputs, cl.Average)  # divides by len(active)
        else:
            assert_reduced(averaged, inputs + zeros, cl.Average)  # divides by size()
        # Max over active ranks and the joined ranks' zeros.
        assert_reduced(grouped[0], inputs + zeros, cl.Max)
        assert_reduced(grouped[1], [t[0] for t in inputs + zeros], cl.Max)
        if mode == "horovod" and len(active) < n:
            for refused in (gathered, scattered):
                assert isinstance(refused, cl.CommlayerError), (step, refused)
                assert "have joined (join_mode=horovod)" in str(refused), str(refused)
            continue
        assert isinstance(gathered, torch.Tensor) and isinstance(scattered, torch.Tensor)
        assert torch.equal(gathered, torch.cat([_input(name, r)[: r % 2 + 1] for r in active]))
        rows = block_rows(3, n)
        start = sum(rows[:me])
        expected = sum(inputs) / len(active)
        torch.testing.assert_close(scattered, expected[start : start + rows[me]])
    assert last == n - 1, f"rank {me}: join returned {last}, expected {n - 1}"
    assert every_last.tolist() == [n - 1] * n


@pytest.mark.parametrize("mode", ["horovod", "active"])
def test_broadcast_from_a_joined_root_and_alltoall_raise(mode: str) -> None:
    # Rank 0 joins at once; the others find it joined. Broadcast from a root that has not
    # joined raises too under join_mode=horovod, works under active.
    if mode != "horovod":
        reinit(join_mode=mode)
    me, n = cl.rank(), cl.size()
    errors: list[Exception] = []
    received = None
    if me == 0:
        last = cl.join()
    else:
        x = _input("join.bcast", me, (4,))
        for call in (
            lambda: cl.broadcast(x, 0, name="join.bcast.joined_root"),
            lambda: cl.alltoall(x[: 4 // n * n], name="join.alltoall"),
        ):
            try:
                call()
            except cl.CommlayerError as exc:
                errors.append(exc)
        received = _attempt(lambda: cl.broadcast(x, n - 1, name="join.bcast.active_root"))
        last = cl.join()
    every_last = cl.allgather(torch.tensor([last]), name="join.bcast.last")
    after = cl.allreduce(torch.ones(2), op=cl.Average, name="join.bcast.after")
    if mode != "horovod":
        reinit()

    assert torch.equal(after, torch.ones(2)), f"rank {me}: engine not back to normal after join"
    assert every_last.tolist() == [last] * n, f"join returned {every_last.tolist()}"
    assert 0 <= last < n and (n == 1 or last != 0), f"rank 0 joined first, yet last is {last}"
    if me != 0:
        assert len(errors) == 2, f"rank {me}: expected 2 errors, got {errors}"
        assert "joined" in str(errors[0]) and "joined" in str(errors[1])
        if mode == "horovod":
            assert isinstance(received, cl.CommlayerError), received
            assert "have joined (join_mode=horovod)" in str(received)
        else:
            assert isinstance(received, torch.Tensor)
            assert torch.equal(received, _input("join.bcast", n - 1, (4,)))


@pytest.mark.parametrize("mode", ["horovod", "active"])
def test_alltoall_no_peer_submits_fails_at_once_after_a_join(mode: str) -> None:
    # After a join the ranks' unnamed calls are numbered differently; here each active rank's
    # alltoall has a name no other rank submits. It must fail at once, in the negotiation,
    # not wait for peers that will never submit it (a stall until shutdown).
    if mode != "horovod":
        reinit(join_mode=mode)
    me, n = cl.rank(), cl.size()
    error = None
    if me != 0:
        x = _input("join.alltoall.own", me, (4,))
        error = _attempt(lambda: cl.alltoall(x[: 4 // n * n], name=f"join.alltoall.{me}"))
    last = cl.join()
    after = cl.allreduce(torch.ones(2), op=cl.Average, name="join.alltoall.after")
    if mode != "horovod":
        reinit()

    assert torch.equal(after, torch.ones(2)), f"rank {me}: engine not back to normal after join"
    assert 0 <= last < n
    if me != 0:
        assert isinstance(error, cl.CommlayerError), f"rank {me}: {error!r}"
        assert f"have joined (join_mode={mode})" in str(error), str(error)


def test_join_twice_with_every_rank_joining_at_once() -> None:
    lasts = [cl.join(), cl.join()]
    gathered = cl.allgather(torch.tensor(lasts).view(1, -1), name="join.again")
    assert all(0 <= last < cl.size() for last in lasts)
    assert torch.equal(gathered, gathered[:1].expand_as(gathered)), gathered.tolist()


def test_large_and_small_tensors_while_ranks_have_joined() -> None:
    # Rank r runs r + 1 steps of a grouped allreduce of large and small tensors (large ones are
    # reduced where they lie over gloo, several in flight: runners/allreduce.py, 3.); a joined
    # rank contributes zeros of the same parts.
    me, n = cl.rank(), cl.size()
    sizes = (70_000, 5, 300_003, 3, 131_072)
    results = []
    for step in range(me + 1):
        name = f"join.mixed.{step}"
        mine = [
            small_ints(seed_of(f"{name}.{i}"), me, (k,), torch.float32) for i, k in enumerate(sizes)
        ]
        results.append(cl.grouped_allreduce(mine, op=cl.Average, name=name))
    cl.join()
    for step, reduced in enumerate(results):
        name = f"join.mixed.{step}"
        for i, (k, result) in enumerate(zip(sizes, reduced)):
            inputs = [
                small_ints(seed_of(f"{name}.{i}"), r, (k,), torch.float32) for r in range(step, n)
            ]
            zeros = [torch.zeros(k)] * step
            assert_reduced(result, inputs + zeros, cl.Average)
