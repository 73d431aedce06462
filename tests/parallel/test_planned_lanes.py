"""Planned lanes (COMMLAYER_PLANNED_SKIP_NEGOTIATION, core/planned.py) under DistributedOptimizer:
training matches the negotiated path, the planned buckets cost no negotiation cycle, a rank
at another step fails every rank naming it, and a join with uneven steps completes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as cl
from commlayer.common import config

F64 = torch.float64
ROWS = 4
STEPS = 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 2)).to(F64)  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + cl.rank())
    return torch.randn(ROWS, 6, generator=g, dtype=F64), torch.randn(
        ROWS, 2, generator=g, dtype=F64
    )


def _train(skip: bool, steps: int = STEPS) -> tuple[nn.Module, list[int]]:
    """Train ``steps`` steps; the engine cycles each step took."""
    with config.override(
        planned_skip_negotiation=skip, window_buckets=False, min_bucket_bytes=1024
    ):
        model = _model()
        opt = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        cycles = []
        for step in range(steps):
            before = cl.communication_stats()["cycles"]
            opt.zero_grad()
            x, y = _batch(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
            cycles.append(int(cl.communication_stats()["cycles"] - before))
    return model, cycles


def test_lanes_train_as_the_negotiated_path_without_cycles() -> None:
    lanes, lane_cycles = _train(skip=True)
    negotiated, cycles = _train(skip=False)
    for a, b in zip(lanes.parameters(), negotiated.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    # after the plan (step 0 records, step 1 plans): the negotiated path needs a cycle a
    # step at least; the lanes none but an idle heartbeat now and then
    assert min(cycles[2:]) >= 1, cycles
    assert sum(lane_cycles[2:]) < sum(cycles[2:]), (lane_cycles, cycles)
    assert sum(lane_cycles[2:]) <= 2, (lane_cycles, cycles)


def test_a_rank_at_another_step_fails_every_rank_naming_it() -> None:
    if cl.size() < 2:
        pytest.skip("a disagreement needs two ranks")
    with config.override(
        planned_skip_negotiation=True, window_buckets=False, min_bucket_bytes=1 << 30
    ):
        model = _model()
        opt = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        for step in range(2):  # the plan (at the first step's end): one bucket
            opt.zero_grad()
            F.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
            opt.step()
        reducer = opt._commlayer  # type: ignore[attr-defined]
        assert reducer.lane is not None and reducer.lane_steps == [1]  # sent once
        last = cl.size() - 1
        if cl.rank() == last:
            reducer.lane_steps[0] += 1  # as if it had sent one step more
        opt.zero_grad()
        F.mse_loss(model(_batch(2)[0]), _batch(2)[1]).backward()
        with pytest.raises(cl.TensorMismatchError) as info:
            opt.step()
        message = str(info.value)
        others = list(range(last))
        assert f"rank(s) {others} at lane epoch" in message and "step 1, part 0" in message
        assert f"rank(s) [{last}] at lane epoch" in message and "step 2, part 0" in message
        if cl.rank() == last:
            reducer.lane_steps[0] -= 1
        opt.zero_grad()  # the lane is still in step: training goes on
        F.mse_loss(model(_batch(3)[0]), _batch(3)[1]).backward()
        opt.step()


def test_uneven_steps_then_join() -> None:
    """Rank r trains 3 + r steps, then joins: a joined rank's lane posts zeros until the lane
    is frozen, and what follows is negotiated; every rank ends."""
    with config.override(
        planned_skip_negotiation=True, window_buckets=False, min_bucket_bytes=1024
    ):
        model = _model()
        opt = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        for step in range(3 + cl.rank()):
            opt.zero_grad()
            F.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
            opt.step()
        assert cl.join() == cl.size() - 1
    # the ranks still reduce together afterwards
    total = cl.allreduce(torch.ones(1), op=cl.Sum, name="lanes.after_join")
    assert total.item() == cl.size()
