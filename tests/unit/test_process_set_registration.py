"""Process-set registration is a message of its own (negotiation.Registration), negotiated like
a barrier on the global set: the ranks to add, or the id to remove, travel in the operation's
``registration``, not in its tensor shapes, and every rank must announce the same change."""

from __future__ import annotations

from typing import Any

import torch
from engine_harness import allreduce, run_engines, wait

from commlayer import ops
from commlayer.common.errors import CommlayerError
from commlayer.core import submit as core_submit
from commlayer.core.engine import Engine, Operation
from commlayer.core.future import Future
from commlayer.core.negotiation import REGISTER, Announce, Registration, build_response


def _change(name: str, registration: Registration) -> Operation:
    return Operation(Announce(name, REGISTER, "uint8", (), registration=registration), [], [])


def test_add_run_in_and_remove_a_set_through_the_message() -> None:
    def fn(engine: Engine) -> tuple[int, Any, bool, int]:
        set_id = wait(engine.submit(_change("add", Registration(ranks=(0, 2)))))
        summed = None
        if engine.rank in (0, 2):
            op = allreduce("in.set", torch.full((3,), float(engine.rank + 1)))
            op.process_set_id = set_id
            summed = wait(engine.submit(op))
        inside = engine.backend(set_id) is not None
        removed = wait(engine.submit(_change("remove", Registration(removed=set_id))))
        return set_id, summed, inside, removed

    results = run_engines(3, fn)
    assert len({set_id for set_id, _, _, _ in results}) == 1 and results[0][0] > 0
    for rank, (_, summed, inside, removed) in enumerate(results):
        assert inside == (rank in (0, 2)) and removed == -1
        if rank != 1:
            assert torch.equal(summed, torch.full((3,), 4.0))  # 1 + 3


def test_ranks_announcing_different_changes_fail_alike() -> None:
    def fn(engine: Engine) -> str:
        ranks = (0, 1) if engine.rank == 0 else (0, 2)
        try:
            wait(engine.submit(_change("add", Registration(ranks=ranks))))
        except CommlayerError as exc:
            return str(exc)
        return "registered"

    for message in run_engines(3, fn):
        assert "process set change differs across ranks" in message, message
        assert "rank 0: add process set of ranks [0, 1]" in message, message
        assert "rank 1: add process set of ranks [0, 2]" in message, message


def test_the_response_carries_the_registration_and_no_shapes() -> None:
    change = Registration(ranks=(1, 3))
    announced = {r: Announce("add", REGISTER, "uint8", (), registration=change) for r in range(4)}
    response = build_response("add", announced, 4)
    assert response.error is None and response.registration == change and response.shapes == ()
    assert repr(Registration(removed=5)) == "remove process set 5"


def test_ops_registers_and_removes_with_a_registration(monkeypatch: Any) -> None:
    """ops' registration functions are the core's, which submit one REGISTER request each."""
    sent: list[dict[str, Any]] = []

    def submit(request: core_submit.Request) -> Future:
        sent.append({"kind": request.kind, "registration": request.registration})
        done = Future()
        done.set_result(7)
        return done

    monkeypatch.setattr(core_submit, "submit", submit)
    assert ops.register_process_set is core_submit.register_process_set
    assert ops.register_process_set([0, 2]) == 7
    ops.unregister_process_set(7)
    assert sent == [
        {"kind": REGISTER, "registration": Registration(ranks=(0, 2))},
        {"kind": REGISTER, "registration": Registration(removed=7)},
    ]
