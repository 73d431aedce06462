"""Planned buckets in a shared-memory window (COMMLAYER_WINDOW_BUCKETS; comm/bucketer.py's
``house_in_window``, backends/shm.py's BucketWindow): the same results as buckets in process
memory, bit for bit, over many steps, ``zero_grad`` both ways, bucket sizes, a process set, a
rank that joined, and a new plan (what an elastic re-formation does).

Bit for bit at 2 ranks, where every algorithm adds the same two numbers (and the window
scales as the others do); at 3 and 4 ranks to a few ulps: the path in process memory adds in
an order that depends on what reached the engine together (a fused bucket's chunks), where the
window reduces each part alone, each element on the rank, and in the order, that the regular
window allreduce (``shm``) reduces a part alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from launch import under_torchrun
from restart import reinit
from torch import nn

import commlayer as cl
from commlayer.backends import shm
from commlayer.common import config
from commlayer.core import runtime, submit

F32 = torch.float32
WIDTH = 96
ROWS = 4
STEPS = 8


def _exact() -> bool:
    return cl.size() <= 2


def _model(seed: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 3, generator=g)


def _optimizer(model: nn.Module, bucket_bytes: int, **kwargs: object) -> torch.optim.Optimizer:
    """Wrapped; whether its buckets go in a window is decided at its plan (``_step``)."""
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        **kwargs,  # type: ignore[arg-type]
    )
    opt._commlayer.bucketer.bucket_bytes = bucket_bytes  # type: ignore[attr-defined]
    return opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, window: bool) -> None:
    x, y = _batch(step, cl.rank())
    F.mse_loss(model(x), y).backward()
    with config.override(window_buckets=window):  # read when the plan is made (first step)
        opt.step()


def _train_pair(
    plain: nn.Module,
    plain_opt: torch.optim.Optimizer,
    housed: nn.Module,
    housed_opt: torch.optim.Optimizer,
    steps: range,
    align_at: int | None,
) -> None:
    """Both models through ``steps`` (buckets in process memory, and in the window), zeroing
    after each; the housed one aligned to the plain one after step ``align_at`` (unplanned)."""
    for step in steps:
        _step(plain, plain_opt, step, False)
        _step(housed, housed_opt, step, True)
        plain_opt.zero_grad()
        housed_opt.zero_grad()
        if step == align_at:
            _align(plain, plain_opt, housed, housed_opt)


def _window_of(opt: torch.optim.Optimizer) -> shm.BucketWindow | None:
    return opt._commlayer.window  # type: ignore[attr-defined,no-any-return]


def _in_window(opt: torch.optim.Optimizer) -> list[bool]:
    window = _window_of(opt)
    views = opt._commlayer.bucketer.view_of  # type: ignore[attr-defined]
    return [window is not None and window.offset_of(v) is not None for v in views.values()]


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if _exact():
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def _align(
    plain: nn.Module, plain_opt: torch.optim.Optimizer, housed: nn.Module, housed_opt: object
) -> None:
    """The housed model and optimizer state set to the plain ones' (after the unplanned first
    step, whose bits depend on what reached the engine together: at 3 ranks and more the
    order in which a fused element is added changes with it)."""
    with torch.no_grad():
        for p, q in zip(plain.parameters(), housed.parameters()):
            q.copy_(p)
    for p, q in zip(plain.parameters(), housed.parameters()):
        mine = plain_opt.state.get(p)
        if mine and "momentum_buffer" in mine:
            housed_opt.state[q]["momentum_buffer"] = mine["momentum_buffer"].clone()  # type: ignore[attr-defined]


def _on_one_machine() -> bool:
    return submit.topology().nodes == 1


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "grads_kept"])
@pytest.mark.parametrize("bucket_bytes", [1 << 30, 4 * WIDTH * WIDTH], ids=["one", "several"])
def test_window_buckets_match_process_memory_bit_for_bit(
    set_to_none: bool, bucket_bytes: int
) -> None:
    plain, housed = _model(), _model()
    plain_opt = _optimizer(plain, bucket_bytes)
    housed_opt = _optimizer(housed, bucket_bytes)
    for step in range(STEPS):
        _step(plain, plain_opt, step, False)
        _step(housed, housed_opt, step, True)
        if step >= 1:  # planned: the reduced gradients are the same too
            for p, q in zip(plain.parameters(), housed.parameters()):
                assert p.grad is not None and q.grad is not None
                if _exact():
                    assert torch.equal(p.grad, q.grad)
        plain_opt.zero_grad(set_to_none=set_to_none)
        housed_opt.zero_grad(set_to_none=set_to_none)
        if step == 0:  # unplanned: what the engine fused depends on timing (ordering, at 3+)
            _align(plain, plain_opt, housed, housed_opt)
        _assert_same(plain, housed)
    gathered = cl.allgather(torch.cat([p.detach().reshape(-1) for p in housed.parameters()])[None])
    assert all(torch.equal(gathered[0], row) for row in gathered)  # the same bits on every rank
    housed_in = _in_window(housed_opt)
    assert _window_of(plain_opt) is None
    if cl.size() > 1 and _on_one_machine():
        assert housed_in and all(housed_in), housed_in
        window = _window_of(housed_opt)
        parts = sum(len(b.parts) for b in housed_opt._commlayer.bucketer.buckets)  # type: ignore[attr-defined]
        assert window is not None and window.seq == 2 * parts * (STEPS - 1)  # reduced there
        # every element of a planned step's buckets written into the size - 1 other buckets
        # (all ranks together; the plain optimizer's regular window, if used, adds to it)
        housed_bytes = sum(p.numel() * 4 for p in housed.parameters())
        mine = float(cl.communication_stats()["window_copied_bytes"])
        total = float(cl.allreduce(torch.tensor([mine], dtype=torch.float64), op=cl.Sum))
        assert total >= (cl.size() - 1) * (STEPS - 1) * housed_bytes, (total, housed_bytes)
    else:
        assert _window_of(housed_opt) is None  # one rank (the identity) or several machines


def test_a_new_plan_releases_the_window_and_makes_another() -> None:
    """What an elastic re-formation does to an optimizer (``_Reducer.new_world``): the
    gradients that viewed the window become copies, and the next plan makes a new window."""
    plain, housed = _model(5), _model(5)
    plain_opt = _optimizer(plain, 4 * WIDTH * WIDTH)
    housed_opt = _optimizer(housed, 4 * WIDTH * WIDTH)
    for step in range(3):
        _step(plain, plain_opt, step, False)
        _step(housed, housed_opt, step, True)
        if step == 0:
            _align(plain, plain_opt, housed, housed_opt)
    first = _window_of(housed_opt)
    kept = [p.grad.clone() for p in housed.parameters()]  # type: ignore[union-attr]
    plain_opt._commlayer.new_world()  # type: ignore[attr-defined]
    housed_opt._commlayer.new_world()  # type: ignore[attr-defined]
    released = _window_of(housed_opt) is None and (
        first is None or all(first.offset_of(p.grad) is None for p in housed.parameters())  # type: ignore[arg-type]
    )
    still = [torch.equal(k, p.grad) for k, p in zip(kept, housed.parameters())]
    for opt in (plain_opt, housed_opt):
        opt.zero_grad()
    _train_pair(plain, plain_opt, housed, housed_opt, range(3, 7), 3)  # 3: unplanned again

    assert released
    assert all(still)  # the copies hold what the window held
    second = _window_of(housed_opt)
    if first is not None:
        assert second is not None and second is not first
        assert first.token not in shm._LIVE  # no longer announced
    _assert_same(plain, housed)


def test_process_set_of_all_but_rank_0() -> None:
    ranks = list(range(1, cl.size())) or [0]
    ps = cl.add_process_set(ranks)
    results: list[bool] = []
    try:
        if cl.rank() in ranks:
            plain, housed = _model(9), _model(9)
            plain_opt = _optimizer(plain, 4 * WIDTH * WIDTH, process_set=ps)
            housed_opt = _optimizer(housed, 4 * WIDTH * WIDTH, process_set=ps)
            _train_pair(plain, plain_opt, housed, housed_opt, range(5), 0)
            _assert_same(plain, housed)
            results = _in_window(housed_opt)
            window = _window_of(housed_opt)
            if window is not None:
                window.close()  # before the set goes: its ranks alone share it
    finally:
        cl.remove_process_set(ps)
    if cl.rank() in ranks and len(ranks) > 1 and _on_one_machine():
        assert results and all(results)


def test_a_rank_that_joined_takes_the_regular_way() -> None:
    """Rank 0 runs one step fewer and joins: the others' last step reduces its window buckets
    the regular way (the joined rank adds zeros, which are not in its window), with the same
    results as buckets in process memory."""
    plain, housed = _model(11), _model(11)
    plain_opt = _optimizer(plain, 4 * WIDTH * WIDTH)
    housed_opt = _optimizer(housed, 4 * WIDTH * WIDTH)
    steps = 4 if cl.rank() == 0 and cl.size() > 1 else 5
    _train_pair(plain, plain_opt, housed, housed_opt, range(steps), 0)
    cl.join()
    _assert_same(plain, housed)
    # and the window works again once nobody has joined
    _train_pair(plain, plain_opt, housed, housed_opt, range(5, 7), None)
    _assert_same(plain, housed)


def test_across_pretend_nodes_a_window_per_node() -> None:
    """Ranks posed on several nodes (COMMLAYER_TOPOLOGY, as the cluster's hosts are nodes):
    under MPI a window per node, each rank's slices of a part allreduced between nodes before
    they are handed on (algorithms/hierarchical.py's local legs on the buckets' memory), with
    the results of the regular hierarchical allreduce on buckets in process memory (bit for bit
    where each element is a sum of two sums of two: 2 x 1 and 2 x 2 ranks; with one rank a
    node, 2 x 1 and 3 x 1, no window: nothing to share). Under torchrun
    (no two-level window) one window over the machine, as before (at 4 ranks it adds in
    another order than hierarchical's schedule: to a few ulps)."""
    size = cl.size()
    if size == 1:
        pytest.skip("one rank: no nodes to pretend")
    local = 2 if size == 4 else 1
    nodes = size // local
    reinit(allreduce_algorithm="hierarchical", topology=f"nodes={nodes},local={local}")
    exact = size == 2 or (size == 4 and not under_torchrun())  # torchrun: one flat window
    try:
        plain, housed = _model(13), _model(13)
        plain_opt = _optimizer(plain, 4 * WIDTH * WIDTH)
        housed_opt = _optimizer(housed, 4 * WIDTH * WIDTH)
        for step in range(STEPS):
            _step(plain, plain_opt, step, False)
            _step(housed, housed_opt, step, True)
            if step >= 1 and exact:
                for p, q in zip(plain.parameters(), housed.parameters()):
                    assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
            plain_opt.zero_grad()
            housed_opt.zero_grad()
            if step == 0:
                _align(plain, plain_opt, housed, housed_opt)
            if exact:
                for p, q in zip(plain.parameters(), housed.parameters()):
                    assert torch.equal(p, q)
            else:
                _assert_same(plain, housed)
        rows = cl.allgather(torch.cat([p.detach().reshape(-1) for p in housed.parameters()])[None])
        window = _window_of(housed_opt)
        housed_in = _in_window(housed_opt)
        parts = sum(len(b.parts) for b in housed_opt._commlayer.bucketer.buckets)  # type: ignore[attr-defined]
        levels = list(getattr(runtime.engine()._global.backend, "_levels", {}))
        if window is not None:
            seq, window_size, across = window.seq, window.size, window.across is not None
            window.close()  # before the restart: its ranks alone share it
    finally:
        reinit()
    assert all(torch.equal(rows[0], row) for row in rows)
    if local == 1 and not under_torchrun():  # one rank a node: no local leg, no window
        assert window is None and not any(housed_in), housed_in
        return
    assert window is not None and housed_in and all(housed_in), housed_in
    assert seq == 2 * parts * (STEPS - 1)  # every planned step's parts reduced in the window
    if under_torchrun():
        assert (window_size, across) == (size, False)
    else:
        assert (window_size, across) == (local, True)
        assert tuple(r // local for r in range(size)) in levels  # hierarchical's communicators
