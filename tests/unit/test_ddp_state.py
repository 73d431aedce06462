"""The DDP hook's CommState owns its communicator for the job (issue 49, item 5): made at the
first bucket, kept across buckets and steps, made again only where what it was made from
changes (the process group, the compressor, the hierarchy, an elastic new world), with the
compressor's residuals kept. No torch.distributed here: the state's transport is a Loopback
(comm/communicator.py) over a stand-in group, and the whole path is forced (one rank would
otherwise return the bucket as it is). tests/parallel/test_ddp_hook.py runs the same under DDP
over gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from commlayer import elastic
from commlayer.comm.communicator import Communicator, Loopback
from commlayer.common import config
from commlayer.compression import create
from commlayer.integrations import ddp


class _Bucket:
    """What the hook reads of a GradBucket."""

    def __init__(self, buffer: torch.Tensor, index: int, last: bool) -> None:
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return [self._buffer]


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Communicator, Any]]:
    """Every communicator a state makes, with the group its transport was made for."""
    found: list[tuple[Communicator, Any]] = []
    groups: list[Any] = []
    real = ddp.Communicator

    def transport(group: Any) -> Loopback:
        groups.append(group)
        return Loopback(2)

    def counting(*args: Any, **kwargs: Any) -> Communicator:
        communicator = real(*args, **kwargs)
        found.append((communicator, groups[-1]))
        return communicator

    monkeypatch.setattr(ddp, "GroupTransport", transport)
    monkeypatch.setattr(ddp, "Communicator", counting)
    return found


def _state(compression: str = "topk:ratio=0.5") -> ddp.CommState:
    with config.override(force_full_path=1):
        state = ddp.CommState(process_group=object(), compression=compression, dense_iters=1)
    return state


def _steps(state: ddp.CommState, steps: int, buckets: int = 3) -> None:
    """``steps`` steps of ``buckets`` buckets each through the hook, each waited for."""
    g = torch.Generator().manual_seed(state.iteration)
    for _ in range(steps):
        for index in range(buckets):
            bucket = _Bucket(torch.randn(8, generator=g), index, index == buckets - 1)
            ddp.hook(state, bucket).wait()  # type: ignore[arg-type]


def test_the_communicator_is_made_once_for_many_steps(made: list[Any]) -> None:
    state = _state()
    assert made == []  # made at the first bucket, not with the state
    _steps(state, 10)
    assert state.iteration == 10
    assert len(made) == 1, made  # 30 buckets, dense and compressed, one communicator
    assert state.communicator() is made[0][0]
    assert made[0][1] is state.process_group  # over the state's group


def test_made_again_where_the_process_group_compressor_or_hierarchy_changes(
    made: list[Any],
) -> None:
    state = _state()
    _steps(state, 2)
    residuals = state.state_dict()["compressor"]["residuals"]
    assert residuals and len(made) == 1
    state.process_group = object()  # a new process group
    _steps(state, 2)
    assert len(made) == 2 and made[1][1] is state.process_group
    # the compressor is the state's, not the communicator's: its residuals go on
    assert state.state_dict()["compressor"]["residuals"].keys() == residuals.keys()
    state.compressor = create("fp16")
    _steps(state, 2)
    assert len(made) == 3
    state.hierarchy = "auto" if state.hierarchy != "auto" else "flat"  # flat, either way
    _steps(state, 2)
    assert len(made) == 4
    _steps(state, 3)
    assert len(made) == 4


def test_an_elastic_new_world_makes_every_states_communicator_again(made: list[Any]) -> None:
    """commlayer.elastic calls ddp.new_world (registered at import) on a re-formation, as it
    calls the DistributedOptimizers' new_world."""
    assert ddp.new_world in elastic._new_world_callbacks
    first, second = _state(), _state()
    _steps(first, 1)
    _steps(second, 1)
    assert len(made) == 2
    ddp.new_world()
    assert first.levels is None and first._communicator is None
    _steps(first, 2)
    _steps(second, 2)
    assert len(made) == 4


def test_the_re_formation_runs_the_new_world_callbacks_after_the_optimizers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """elastic._reform_once: the optimizers' new_world, then every on_new_world callback."""
    from commlayer import optimizer

    calls: list[str] = []
    monkeypatch.setattr(elastic.runtime, "added_process_sets", lambda: [])
    monkeypatch.setattr(elastic.runtime, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(elastic.runtime, "restart", lambda: calls.append("restart"))
    monkeypatch.setattr(elastic.rendezvous, "join", lambda state: calls.append("join"))
    monkeypatch.setattr(elastic, "_add_again", lambda added: None)
    monkeypatch.setattr(elastic, "_restore_lost", lambda state: calls.append("restore"))
    monkeypatch.setattr(optimizer, "new_world", lambda: calls.append("optimizers"))
    monkeypatch.setattr(elastic, "_new_world_callbacks", [])
    elastic.on_new_world(lambda: calls.append("callback"))
    elastic.on_new_world(elastic._new_world_callbacks[0])  # registered once
    elastic._reform_once(None)  # type: ignore[arg-type]
    assert calls == ["shutdown", "restart", "join", "optimizers", "callback", "restore"]


def test_state_dict_round_trip_keeps_residuals(made: list[Any]) -> None:
    state = _state()
    _steps(state, 3)
    saved = state.state_dict()
    fresh = _state()
    fresh.load_state_dict(saved)
    assert fresh.iteration == 3
    for key, residual in saved["compressor"]["residuals"].items():
        assert torch.equal(fresh.state_dict()["compressor"]["residuals"][key], residual)
