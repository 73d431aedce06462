"""hvd.elastic (issue #7) on a fixed world: State commit/restore/sync, reset callbacks, host
updates, and run() retrying from the last commit after a HorovodInternalError.

Errors are raised by the training function itself on every rank (as Horovod's elastic tests
do), so every rank takes the same path; collectives first, asserts last.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import commlayer as hvd
from commlayer import elastic


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.full((4, 3), float(step + 1))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_object_state_commit_restore_sync() -> None:
    state = elastic.ObjectState(epoch=hvd.rank(), seen=[hvd.rank()])
    state.sync()  # rank 0's values everywhere
    synced = (state.epoch, list(state.seen))
    state.epoch = 5
    state.seen.append(7)
    state.commit()
    state.epoch = 9
    state.seen.append(8)
    state.restore()
    assert synced == (0, [0])
    assert (state.epoch, state.seen) == (5, [0, 7])


def test_torch_state_restores_model_optimizer_and_scheduler() -> None:
    model, optimizer = _model(hvd.rank())  # different on every rank until sync
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = elastic.TorchState(model, optimizer, scheduler=scheduler, batch=0)
    state.sync()
    synced = hvd.allgather_object(_params(model))
    _train_step(model, optimizer, 0)
    scheduler.step()
    state.batch = 1
    state.commit()
    committed = _params(model), optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    _train_step(model, optimizer, 1)
    scheduler.step()
    state.batch = 2
    state.restore()

    assert all(torch.equal(a, b) for other in synced for a, b in zip(other, synced[0]))
    assert all(torch.equal(a, b) for a, b in zip(_params(model), committed[0]))
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], committed[1])
    assert state.batch == 1 and scheduler.last_epoch == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert state.model is model and state.optimizer is optimizer


def _elastic_training(fail_at: set[int]) -> tuple[list[torch.Tensor], list[str]]:
    """Train 6 steps under run(), committing every 2; raise HorovodInternalError once at each
    step of ``fail_at``. Returns the final parameters and the events seen."""
    model, optimizer = _model(0)
    dist_opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = elastic.TorchState(model, dist_opt, step=0)
    events: list[str] = []
    state.register_reset_callbacks([lambda: events.append("reset")])

    @elastic.run
    def train(state: elastic.TorchState) -> int:
        events.append(f"start@{state.step}")
        while state.step < 6:
            _train_step(state.model, state.optimizer, state.step)
            state.step += 1
            if state.step in fail_at:
                fail_at.discard(state.step)
                raise hvd.HorovodInternalError(f"simulated failure at step {state.step}")
            if state.step % 2 == 0:
                state.commit()
        return state.step

    steps = train(state)
    events.append(f"done@{steps}")
    return _params(model), events


def test_run_retries_from_the_last_commit() -> None:
    clean, clean_events = _elastic_training(set())
    retried, events = _elastic_training({3, 5})
    assert clean_events == ["start@0", "done@6"]
    # Failed after steps 3 and 5: rolled back to the commits at 2 and 4, then went on.
    assert events == ["start@0", "reset", "start@2", "reset", "start@4", "done@6"]
    assert all(torch.equal(a, b) for a, b in zip(retried, clean))


def test_run_gives_up_after_the_reset_limit_and_on_shutdown_errors() -> None:
    calls: list[str] = []

    def always_fails(state: elastic.State, error: type[Exception]) -> None:
        calls.append(error.__name__)
        raise error(f"rank {hvd.rank()}: simulated")

    state = elastic.ObjectState(x=1)
    with pytest.raises(hvd.HorovodInternalError, match="simulated"):
        elastic.run(always_fails, reset_limit=2)(state, hvd.HorovodInternalError)
    with pytest.raises(hvd.ShutdownError, match="simulated"):
        elastic.run(always_fails)(state, hvd.ShutdownError)  # the world is not intact
    with pytest.raises(ValueError, match="reset_limit"):
        elastic.run(always_fails, reset_limit=-1)
    with pytest.raises(ValueError, match="State as its first argument"):
        elastic.run(always_fails)(object(), hvd.HorovodInternalError)
    assert calls == ["CommlayerError"] * 3 + ["ShutdownError"]


def test_host_update_on_one_rank_interrupts_every_rank() -> None:
    state = elastic.ObjectState(batch=0)
    events: list[str] = []
    state.register_reset_callbacks([lambda: events.append("reset")])

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        events.append("start")
        state.batch += 1
        if state.batch == 1 and hvd.rank() == hvd.size() - 1:
            state.on_hosts_updated(timestamp=1.0, removed_only=True)
        state.commit()  # raises HostsUpdatedInterrupt on every rank the first time

    train(state)
    interrupt = hvd.HostsUpdatedInterrupt(skip_sync=True)
    assert events == ["start", "reset", "start"]
    assert state.batch == 2 and interrupt.skip_sync and isinstance(interrupt, RuntimeError)


def test_elastic_sampler_resumes_after_restore() -> None:
    data = list(range(10 * hvd.size() + 3))
    sampler = elastic.ElasticSampler(data, shuffle=True, seed=1)
    state = elastic.TorchState(sampler=sampler)
    first_epoch = hvd.allgather_object(list(sampler))
    sampler.record_batch(0, 2)
    state.commit()
    sampler.record_batch(1, 2)  # not committed: forgotten by restore
    state.restore()
    rest = hvd.allgather_object(list(sampler))
    sampler.set_epoch(1)
    next_epoch = list(sampler)

    order = list(data)
    random.Random(1).shuffle(order)  # the sampler's order for seed 1, epoch 0
    per_rank = -(-len(data) // hvd.size())
    assert {i for part in first_epoch for i in part} == set(data)
    assert all(len(part) == per_rank for part in first_epoch)
    assert sampler.processed_num == 0 and state.sampler is sampler
    assert sorted({i for part in rest for i in part}) == sorted(order[2 * hvd.size() :])
    assert len(next_epoch) == len(first_epoch[hvd.rank()])
