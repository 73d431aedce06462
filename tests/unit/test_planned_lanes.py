"""Planned lanes (core/planned.py): a plan's buckets reduced in plan order without negotiation,
each reduction checking through its tail that every rank sent the same step and part."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from commlayer.common.errors import CommlayerError, StallError, TensorMismatchError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.core import planned
from commlayer.core.engine import Engine, Operation
from commlayer.core.negotiation import ALLREDUCE, REGISTER, Announce, Registration
from tests.unit.engine_harness import WAIT_S, allreduce, run_engines, wait

F32 = torch.float32


# -- the tail (pure) -------------------------------------------------------------------------------
def _reduced(slots: list[tuple[int, ...] | None], dtype: torch.dtype = F32) -> torch.Tensor:
    """The tail every rank reads after a Sum: each rank's slot in its place (None: zeros)."""
    size = len(slots)
    total = torch.zeros(planned.tail_numel(size), dtype=dtype)
    for rank, slot in enumerate(slots):
        mine = torch.zeros_like(total)
        if slot is not None:
            planned.write_tail(mine, rank, slot)
        total += mine
    return total


def test_every_rank_reads_every_ranks_codes_and_agreement_passes() -> None:
    slot = planned.codes(5, 7, 2, F32)
    assert slot == (1, 5, 7, 3)
    read = planned.read_tail(_reduced([slot, slot, None]), 3)
    assert read == [slot, slot, None]  # a joined rank's zeros: absent, not a disagreement
    assert planned.disagreement("b", read) is None


def test_a_rank_a_step_behind_is_named_with_each_ranks_step() -> None:
    ahead, behind = planned.codes(1, 8, 0, F32), planned.codes(1, 7, 0, F32)
    read = planned.read_tail(_reduced([ahead, behind, ahead]), 3)
    problem = planned.disagreement("grad.bucket[a..b]", read)
    assert problem is not None
    assert "rank(s) [0, 2] at lane epoch 1, step 8, part 0" in problem
    assert "rank(s) [1] at lane epoch 1, step 7, part 0" in problem


def test_a_part_not_sent_as_planned_names_its_rank() -> None:
    sent, not_sent = planned.codes(1, 3, 1, F32), planned.codes(1, -1, 1, F32)
    read = planned.read_tail(_reduced([sent, not_sent]), 2)
    problem = planned.disagreement("b", read)
    assert problem is not None and "rank(s) [1] could not send it as planned" in problem
    assert "rank 1: a gradient's shape or device changed" in problem


def test_a_part_not_sent_as_planned_names_the_dtype_its_rank_has_now() -> None:
    changed = planned.codes(1, planned.changed_code(torch.float32), 1, F32)
    read = planned.read_tail(_reduced([planned.codes(1, 3, 1, F32), changed, changed]), 3)
    problem = planned.disagreement("b", read, torch.float64)
    assert problem is not None and "rank(s) [1, 2] could not send it as planned" in problem
    assert "rank 1: its gradients are float32 now; the plan's are float64" in problem
    assert "rank 2: its gradients are float32 now" in problem


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_codes_are_exact_in_every_floating_dtype(dtype: torch.dtype) -> None:
    """Codes are taken modulo what the dtype holds exactly: a large step still reads back."""
    m = planned.modulus(dtype)
    slot = planned.codes(m + 3, 10 * m + 5, 1000, dtype)
    read = planned.read_tail(_reduced([slot] * 4, dtype), 4)
    assert read == [slot] * 4
    assert all(v < m for v in slot)


# -- lanes in the engine (thread ranks) ------------------------------------------------------------
def _open(engine: Engine, parts: list[tuple[int, str]]) -> int:
    spec = planned.LaneSpec(tuple(parts))
    announce = Announce("lane", REGISTER, "uint8", (), registration=Registration(lane=spec))
    return int(wait(engine.submit(Operation(announce, [], []))))


def _part(
    name: str, lane: int, index: int, step: int, grads: torch.Tensor, size: int, op: ReduceOp
) -> Operation:
    flat = torch.cat([grads, torch.zeros(planned.tail_numel(size))])
    announce = Announce(name, ALLREDUCE, "float32", ((flat.numel(),),), int(op))
    return Operation(
        announce, [flat], [flat], finish=lambda outs: outs[0], planned=(lane, index, step)
    )


@pytest.mark.parametrize("algorithm", ["native", "ring", "auto"])
def test_planned_parts_run_in_plan_order_without_negotiation(algorithm: str) -> None:
    """Rank 1 submits part 1 before part 0 (its backward order differs): it is posted after
    part 0, so every rank's lane matches; three steps cost no cycle beyond the heartbeats.
    The backend's own allreduces stay in flight together, a schedule's run alone."""
    steps = 3

    def fn(engine: Engine) -> tuple[list[torch.Tensor], int]:
        size = engine.size
        lane = _open(engine, [(3, "float32"), (2, "float32")])
        cycles = engine.stats.cycles
        results = []
        for step in range(steps):
            v = float(engine.rank + 1 + 10 * step)
            a = _part("a", lane, 0, step, torch.full((3,), v), size, ReduceOp.Average)
            b = _part("b", lane, 1, step, torch.full((2,), -v), size, ReduceOp.Sum)
            order = [b, a] if engine.rank == 1 else [a, b]
            engine.submit_all(order)
            results += [wait(a.handle)[:3].clone(), wait(b.handle)[:2].clone()]
        assert engine._lanes.lanes[lane].posted == 2 * steps  # all on the lane
        return results, engine.stats.cycles - cycles

    outcomes = run_engines(2, fn, allreduce_algorithm=algorithm)
    for results, cycles in outcomes:
        for step in range(steps):
            mean = (1 + 2 + 20 * step) / 2
            assert torch.equal(results[2 * step], torch.full((3,), mean))
            assert torch.equal(results[2 * step + 1], torch.full((2,), -(3.0 + 20 * step)))
        # heartbeats only (25 ms each at these settings); negotiated, 6 operations take >= 3
        assert cycles <= 2, cycles


def test_a_rank_at_another_step_fails_every_rank_naming_the_ranks() -> None:
    def fn(engine: Engine) -> str:
        lane = _open(engine, [(4, "float32")])
        step = 5 if engine.rank == 2 else 4
        op = _part("x", lane, 0, step, torch.ones(4), engine.size, ReduceOp.Sum)
        engine.submit(op)
        with pytest.raises(TensorMismatchError) as info:
            wait(op.handle)
        # the lane stays in step: the next reduction works
        ok = _part("y", lane, 0, 6, torch.ones(4), engine.size, ReduceOp.Sum)
        engine.submit(ok)
        assert torch.equal(wait(ok.handle)[:4], torch.full((4,), 3.0))
        return str(info.value)

    for rank, message in enumerate(run_engines(3, fn)):
        assert message.startswith(f"rank {rank}: planned bucket 'x'"), message
        assert "rank(s) [0, 1] at lane epoch 1, step 4" in message
        assert "rank(s) [2] at lane epoch 1, step 5" in message


def test_a_lane_waiting_on_a_peer_does_not_block_the_negotiation() -> None:
    """Rank 0 posts its planned part, then runs a negotiated allreduce and waits for it;
    rank 1 first waits for that negotiated allreduce, and only then submits its planned
    part. An engine blocked on either communicator would deadlock here."""
    negotiated = threading.Event()

    def fn(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
        lane = _open(engine, [(2, "float32")])
        part = _part("p", lane, 0, 0, torch.full((2,), 1.0 + engine.rank), 2, ReduceOp.Sum)
        if engine.rank == 0:
            engine.submit(part)
            other = wait(engine.submit(allreduce("n", torch.ones(2))))
            negotiated.set()
        else:
            other = wait(engine.submit(allreduce("n", torch.ones(2))))
            assert negotiated.wait(WAIT_S)
            engine.submit(part)
        return other, wait(part.handle)[:2].clone()

    for other, mine in run_engines(2, fn):
        assert torch.equal(other, torch.full((2,), 2.0))
        assert torch.equal(mine, torch.full((2,), 3.0))


@pytest.mark.parametrize("join_mode", ["horovod", "active"])
def test_a_join_freezes_the_lane_and_the_joined_rank_posts_zeros(join_mode: str) -> None:
    """Rank 2 joins after one step; ranks 0 and 1 have posted the next step's part already or
    post it later: the joined rank matches it with zeros (Average by join mode), and what
    follows is negotiated; after every rank joined, planned parts keep working, negotiated."""
    first_step = threading.Barrier(3)

    def fn(engine: Engine) -> dict[str, Any]:
        lane = _open(engine, [(2, "float32")])
        size = engine.size
        out: dict[str, Any] = {}
        op = _part("s0", lane, 0, 0, torch.full((2,), 1.0), size, ReduceOp.Average)
        engine.submit(op)
        out["s0"] = wait(op.handle)[:2].clone()
        first_step.wait(WAIT_S)
        if engine.rank != 2:
            for step in (1, 2):
                op = _part(f"s{step}", lane, 0, step, torch.full((2,), 3.0), size, ReduceOp.Average)
                engine.submit(op)
                out[f"s{step}"] = wait(op.handle)[:2].clone()
        out["last"] = wait(engine.join())
        # the lane was frozen at the join; once every rank joined, new lanes may open
        out["frozen"] = engine._lanes.lanes[lane].limit is not None and not engine._lanes.frozen
        fresh = _open(engine, [(2, "float32")])
        op = _part("fresh", fresh, 0, 0, torch.ones(2), size, ReduceOp.Sum)
        engine.submit(op)
        out["fresh"] = wait(op.handle)[:2].clone()
        out["fresh_on_lane"] = engine._lanes.lanes[fresh].posted == 1
        op = _part("after", lane, 0, 3, torch.full((2,), 1.0), size, ReduceOp.Sum)
        engine.submit(op)
        out["after"] = wait(op.handle)[:2].clone()
        return out

    outcomes = run_engines(3, fn, join_mode=join_mode)
    divisor = 3 if join_mode == "horovod" else 2
    for rank, out in enumerate(outcomes):
        assert torch.equal(out["s0"], torch.ones(2))
        assert torch.equal(out["after"], torch.full((2,), 3.0))
        assert out["frozen"]
        assert torch.equal(out["fresh"], torch.full((2,), 3.0)) and out["fresh_on_lane"]
        if rank != 2:
            for step in (1, 2):
                assert torch.equal(out[f"s{step}"], torch.full((2,), 6.0 / divisor)), out


def test_the_engine_stopping_fails_the_parts_on_the_lane() -> None:
    def fn(engine: Engine) -> BaseException | None:
        lane = _open(engine, [(2, "float32")])
        if engine.rank == 1:
            engine.shutdown(timeout_s=WAIT_S)
            return None
        op = _part("p", lane, 0, 0, torch.ones(2), 2, ReduceOp.Sum)
        engine.submit(op)
        with pytest.raises(CommlayerError) as info:
            wait(op.handle)
        return info.value

    errors = run_engines(2, fn)
    assert "shut down" in str(errors[0]), errors[0]


def test_a_lane_of_a_process_set_beside_the_global_negotiation() -> None:
    """A lane on the set {0, 2}: rank 1, outside it, runs global operations meanwhile."""

    def fn(engine: Engine) -> list[torch.Tensor]:
        set_id, _ = engine.register_process_set([0, 2])
        engine.start()
        out = []
        if engine.rank != 1:
            spec = planned.LaneSpec(((2, "float32"),))
            announce = Announce("lane", REGISTER, "uint8", (), registration=Registration(lane=spec))
            lane = int(wait(engine.submit(Operation(announce, [], [], set_id))))
            for step in range(3):
                op = _part(f"p{step}", lane, 0, step, torch.ones(2) * step, 2, ReduceOp.Sum)
                op.process_set_id = set_id
                engine.submit(op)
                out.append(wait(op.handle)[:2].clone())
        out.append(wait(engine.submit(allreduce("global", torch.ones(2)))))
        return out

    outcomes = run_engines(3, fn, start=False)
    for rank, out in enumerate(outcomes):
        assert torch.equal(out[-1], torch.full((2,), 3.0))
        if rank != 1:
            assert [t.tolist() for t in out[:-1]] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]


def test_a_part_no_peer_posts_stalls_and_stops_every_rank() -> None:
    def fn(engine: Engine) -> str:
        lane = _open(engine, [(2, "float32")])
        if engine.rank == 0:
            op = _part("lonely", lane, 0, 0, torch.ones(2), 2, ReduceOp.Sum)
            engine.submit(op)
            with pytest.raises(StallError) as info:
                wait(op.handle)
            return str(info.value)
        deadline = time.monotonic() + WAIT_S
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.running
        return ""

    errors = run_engines(2, fn, stall_check_time_s=0.05, stall_shutdown_time_s=0.3)
    assert "planned bucket 'lonely'" in errors[0] and "stalled" in errors[0], errors[0]


def test_a_joined_rank_matches_what_the_others_posted_before_it_joined() -> None:
    """Ranks 0 and 1 post step 1's part before rank 2 joins (it never sends step 1): at the
    freeze rank 2 posts zeros at that position, so their reduction completes."""
    posted = threading.Barrier(3)

    def fn(engine: Engine) -> torch.Tensor | None:
        lane = _open(engine, [(2, "float32")])
        op = _part("s0", lane, 0, 0, torch.ones(2), 3, ReduceOp.Sum)
        engine.submit(op)
        wait(op.handle)
        if engine.rank == 2:
            posted.wait(WAIT_S)
            wait(engine.join())
            return None
        op = _part("s1", lane, 0, 1, torch.full((2,), 2.0), 3, ReduceOp.Sum)
        engine.submit(op)
        deadline = time.monotonic() + WAIT_S
        while engine._lanes.lanes[lane].posted < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        posted.wait(WAIT_S)
        result = wait(op.handle)[:2].clone()
        wait(engine.join())
        return result

    outcomes = run_engines(3, fn)
    assert torch.equal(outcomes[0], torch.full((2,), 4.0))
    assert torch.equal(outcomes[1], torch.full((2,), 4.0))


def test_owned_memory_keeps_a_tail_for_host_memory_of_a_floating_dtype() -> None:
    from commlayer.comm.bucketer import owned_memory
    from commlayer.compression import create

    weights = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    flat, views, tail = owned_memory(weights, create("none"), tail=8)
    assert flat is not None and flat.numel() == 6 + 4 + 8 and tail == 8
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,)]
    assert views[1].data_ptr() + 4 * 4 == flat[10:].data_ptr()  # the tail after the gradients
    counts = [torch.ones(3, dtype=torch.int64)]  # integers: Average's scaling is not exact
    _, _, none = owned_memory(counts, create("none"), tail=8)  # type: ignore[arg-type]
    assert none == 0


def test_a_lane_idle_for_long_is_not_a_stall_when_it_is_used_again() -> None:
    """The stall clock of a lane starts when a part is posted into an empty flight, not at the
    last completion: a pause between steps (an evaluation) is no stall."""

    def fn(engine: Engine) -> list[torch.Tensor]:
        lane = _open(engine, [(2, "float32")])
        out = []
        for step in range(2):
            if step and engine.rank == 1:
                time.sleep(0.3)  # rank 0's part waits for this one's, within the limit
            op = _part(f"s{step}", lane, 0, step, torch.ones(2), 2, ReduceOp.Sum)
            engine.submit(op)
            out.append(wait(op.handle)[:2].clone())
            time.sleep(1.2)  # idle: longer than the stall limit and the check's period
        return out

    for out in run_engines(2, fn, stall_check_time_s=0.1, stall_shutdown_time_s=0.6):
        assert [t.tolist() for t in out] == [[2.0, 2.0], [2.0, 2.0]]


def test_a_tail_no_rank_wrote_is_a_disagreement() -> None:
    tail = _reduced([planned.codes(1, 0, 0, F32), planned.codes(1, 0, 0, F32)])
    tail[planned.TAIL] = 2.0  # as if two ranks wrote rank 1's slot
    problem = planned.disagreement("b", planned.read_tail(tail, 2))
    assert problem is not None and "rank(s) [1] are not what any rank writes" in problem
    tail[planned.TAIL] = 0.5
    problem = planned.disagreement("b", planned.read_tail(tail, 2))
    assert problem is not None and "rank(s) [1]" in problem
