"""Compression once per host (issue 51) on one process: the host layout and who leads, the
spec's ``hierarchy=``, auto's costing of the per-host path against fake links, and the
communicator's stages over transports that complete at once and record what they were given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from commlayer import compression
from commlayer.comm import hierarchy
from commlayer.comm.communicator import Communicator
from commlayer.comm.hierarchy import HostLayout, HostLevels
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import AutoCompressor, ErrorFeedback
from commlayer.compression.auto import Hosts, Link, decide, decide_level, host_time, plan, split
from commlayer.core.future import Future

MLP_LAYER = [torch.zeros(768, 768), torch.zeros(768)]
CPU = {"fp16": 0.0006, "bf16": 0.0006, "powersgd:rank=4": 0.004, "topk:ratio=0.01": 0.003}


# -- layout and leaders --------------------------------------------------------------------------
def test_layout_groups_ranks_by_host_and_says_where_it_pays() -> None:
    two_by_two = HostLayout.of(range(4), (0, 0, 1, 1))
    assert two_by_two.hosts == ((0, 1), (2, 3)) and two_by_two.pays()
    assert two_by_two.host_sets() == [(0, 1), (2, 3)]
    assert two_by_two.leader_sets() == [(0, 2), (1, 3)]
    assert two_by_two.where(3) == (1, 1)
    interleaved = HostLayout.of(range(4), (0, 1, 0, 1))
    assert interleaved.hosts == ((0, 2), (1, 3)) and interleaved.leader_sets() == [(0, 1), (2, 3)]
    uneven = HostLayout.of([0, 1, 2], (0, 0, 1, 1))  # a process set of ranks 0-2
    assert uneven.leaders == 1 and uneven.host_sets() == [(0, 1)] and uneven.pays()
    assert not HostLayout.of(range(3), (0, 1, 2)).pays()  # a rank a host: flat already
    assert not HostLayout.of(range(4), (0, 0, 0, 0)).pays()  # one host: nothing crosses


def test_leaders_rotate_by_bytes_and_every_rank_agrees() -> None:
    layout = HostLayout.of(range(6), (0, 0, 0, 1, 1, 1))
    levels = [HostLevels(layout, rank, None, None) for rank in range(6)]
    buckets = [("a", 100), ("b", 10), ("c", 10), ("d", 50), ("e", 5)]
    for mine in levels:
        mine.assign(buckets)
    chosen = [[mine.leader(name) for name, _ in buckets] for mine in levels]
    assert all(c == chosen[0] for c in chosen)
    assert chosen[0] == [0, 1, 2, 1, 2]  # the least loaded index, the lowest on a tie
    assert [mine.local_index for mine in levels] == [0, 1, 2, 0, 1, 2]
    unplanned = {mine.leader("grad.x") for mine in levels}  # by a hash: alike, in range
    assert len(unplanned) == 1 and unplanned.pop() in range(3)


# -- settings ------------------------------------------------------------------------------------
def test_spec_hierarchy_is_kept_on_the_compressor_and_checked() -> None:
    made = compression.create("topk:ratio=0.01,hierarchy=host")
    assert isinstance(made, ErrorFeedback) and made.hierarchy == "host"
    assert compression.create("qsgd:hierarchy=flat").hierarchy == "flat"  # type: ignore[attr-defined]
    assert compression.check_spec("fp16:hierarchy=auto") == "fp16:hierarchy=auto"
    with pytest.raises(ValueError, match=r"hierarchy='rack' .* allowed auto, flat, host"):
        compression.create("topk:hierarchy=rack")


def test_mode_follows_the_spec_then_the_setting() -> None:
    topk = compression.create("topk")
    assert hierarchy.mode(topk, "host", whole_job=True) == "host"
    assert hierarchy.mode(topk, "auto", whole_job=True) == "auto"
    assert hierarchy.mode(topk, "auto", whole_job=False) == "flat"  # another set: no sets made
    assert hierarchy.mode(topk, "host", whole_job=False) == "host"
    assert hierarchy.mode(compression.create("topk:hierarchy=flat"), "host", True) == "flat"
    assert hierarchy.mode(compression.create("none"), "host", True) == "flat"  # nothing to do
    assert hierarchy.mode(AutoCompressor(), "host", True) == "host"  # may pick a compressor


# -- auto ----------------------------------------------------------------------------------------
def _link(gbit_per_s: float, ranks: int, alpha_s: float = 50e-6) -> Link:
    per_byte = 8 / (gbit_per_s * 1e9) * 2 * (ranks - 1) / ranks
    return Link(alpha_s, per_byte, ranks, "fake")


def _hosts(inside_gbit: float, across_gbit: float, hosts: int = 2, local: int = 4) -> Hosts:
    return Hosts(_link(inside_gbit, local), _link(across_gbit, hosts), local)


def test_a_gathered_payload_pays_per_host_where_the_hosts_link_is_slow() -> None:
    """8 ranks on 2 hosts, 1 Gbit/s between them, shared memory inside: top-k's allgather of 8
    payloads against 2 of them; every compressing candidate is costed both ways."""
    job = _link(1, 8)
    hosts = _hosts(200, 1)
    got = decide(MLP_LAYER, job, CPU, lossy=True, hosts=hosts, host_cpu_s=CPU)
    assert got.choice.endswith("@host") and split(got.choice)[1], got
    assert got.predicted_s["topk:ratio=0.01@host"] < got.predicted_s["topk:ratio=0.01"]
    assert {"fp16@host", "bf16@host", "powersgd:rank=4@host"} <= set(got.predicted_s)
    only_flat = decide(MLP_LAYER, job, CPU, lossy=True)
    assert not any(c.endswith("@host") for c in only_flat.predicted_s)
    host_only = decide(MLP_LAYER, job, CPU, True, hosts=hosts, host_cpu_s=CPU, flat=False)
    assert set(host_only.predicted_s) == {"none", *(c + "@host" for c in CPU)}


def test_per_host_costs_two_passes_inside_and_a_share_of_the_cpu() -> None:
    hosts = _hosts(10, 1)
    nbytes = sum(t.numel() * 4 for t in MLP_LAYER)
    got = host_time("topk:ratio=0.01", MLP_LAYER, hosts, 0.004)
    want = 2 * hosts.intra.allreduce_s(nbytes) + 0.004 / 4
    assert got == pytest.approx(want + compression.auto.payload_time(
        "topk:ratio=0.01", MLP_LAYER, hosts.across))  # fmt: skip


def test_a_compressor_given_outright_is_weighed_flat_against_per_host() -> None:
    topk = compression.create("topk:ratio=0.01")
    slow = decide_level("topk", topk, MLP_LAYER, _link(1, 8), _hosts(200, 1), 0.003, 0.003)
    assert slow.choice == "topk@host" and slow.kind == "compression hierarchy"
    # inside the host as slow as between hosts: two more passes of the bucket do not pay
    same = decide_level("topk", topk, MLP_LAYER, _link(1, 8), _hosts(1, 1), 0.003, 0.003)
    assert same.choice == "topk", same.predicted_s


def test_plan_with_hosts_measures_the_leader_as_a_rank_of_as_many_ranks_as_hosts() -> None:
    asked: list[int] = []

    def measure(spec: Any, tensors: Sequence[torch.Tensor], ranks: int) -> float:
        asked.append(ranks)
        return CPU[spec]

    chooser = AutoCompressor(lossy=1)
    labels = plan(chooser, [MLP_LAYER], _link(1, 8), 8, measure, _hosts(200, 1, hosts=2))
    assert sorted(set(asked)) == [2, 8]
    assert labels[0].endswith("@host") and chooser.decisions[0]["choice"] == labels[0]


# -- the communicator's stages -------------------------------------------------------------------
class _Recorder:
    """A transport that completes at once: an allreduce doubles its tensors (as if a peer
    held the same), an allgather returns the record twice, a broadcast leaves the tensors as
    they are; every call is logged."""

    chains_rounds = True

    def __init__(self, log: list[str], label: str, size: int = 2) -> None:
        self.rank, self.size, self.log, self.label = 0, size, log, label

    def allreduce_(self, tensors: list[torch.Tensor], name: str, op: ReduceOp, prescale: float,
                   postscale: float) -> Future:  # fmt: skip
        self.log.append(f"{self.label} allreduce {name}")
        for t in tensors:
            t.mul_(prescale * postscale * self.size)
        return self._done(tensors)

    def allgather_bytes(self, record: torch.Tensor, name: str) -> Future:
        self.log.append(f"{self.label} allgather {name}")
        return self._done(record.repeat(self.size))

    def broadcast_(self, tensors: list[torch.Tensor], root: int, name: str) -> Future:
        self.log.append(f"{self.label} broadcast {name} from {root}")
        return self._done(tensors)

    def sparse(self, *args: Any) -> None:
        return None

    @staticmethod
    def _done(value: Any) -> Future:
        future = Future("recorded")
        future.set_result(value)
        return future


class _Counting(compression.ErrorFeedback):
    """Top-k with error feedback that counts its compressions."""

    def __init__(self) -> None:
        super().__init__(compression.TopKCompressor(ratio=0.5))
        self.calls = 0

    def compress(self, tensor: torch.Tensor, name: str = "") -> Any:
        self.calls += 1
        return super().compress(tensor, name)


def _levels(rank: int, log: list[str]) -> HostLevels:
    layout = HostLayout.of(range(4), (0, 0, 1, 1))
    index = layout.where(rank)[1]
    return HostLevels(layout, rank, _Recorder(log, "host"), _Recorder(log, f"leaders{index}"))


def test_the_leader_compresses_once_and_shares_the_result() -> None:
    log: list[str] = []
    compressor = _Counting()
    leader = _levels(0, log)
    leader.assign([("b", 16)])  # index 0 leads "b"
    tensor = torch.arange(4.0)
    comm = Communicator(_Recorder(log, "job", size=4), ReduceOp.Average, levels=leader)
    comm.reduce([tensor], compressor, "b", per_host=True).wait()  # type: ignore[arg-type]
    assert log == ["host allreduce b.host", "leaders0 allgather b", "host broadcast b.share from 0"]
    assert compressor.calls == 1
    # host sum 2 x, top-2 of it (4, 6 at 2, 3), gathered twice, / 4 ranks
    assert torch.equal(tensor, torch.tensor([0.0, 0.0, 2.0, 3.0]))

    log.clear()
    other = _levels(1, log)
    other.assign([("b", 16)])
    mine = torch.arange(4.0)
    compressor.residuals["b"] = torch.ones(4)  # kept from when it led "b"
    comm = Communicator(_Recorder(log, "job", size=4), ReduceOp.Average, levels=other)
    comm.reduce([mine], compressor, "b", per_host=True).wait()  # type: ignore[arg-type]
    assert log == ["host allreduce b.host", "host broadcast b.share from 0"]
    assert compressor.calls == 1  # it compressed nothing: the leader's result comes to it
    # what it summed is its tensor and the residual it kept, folded in rather than kept
    assert torch.equal(mine, 2 * (torch.arange(4.0) + 1)) and "b" not in compressor.residuals


def test_a_stage_that_fails_fails_the_future() -> None:
    class Broken(_Recorder):
        def allgather_bytes(self, record: torch.Tensor, name: str) -> Future:
            raise RuntimeError("link down")

    log: list[str] = []
    layout = HostLayout.of(range(4), (0, 0, 1, 1))
    levels = HostLevels(layout, 0, _Recorder(log, "host"), Broken(log, "leaders0"))
    levels.assign([("b", 16)])
    comm = Communicator(_Recorder(log, "job", size=4), ReduceOp.Average, levels=levels)
    future = comm.reduce([torch.ones(4)], compression.create("topk:ratio=0.5"), "b", per_host=True)
    with pytest.raises(RuntimeError, match="link down"):
        future.wait()
    assert log == ["host allreduce b.host"]  # no share started after the failure


def test_average_over_the_job_where_the_leaders_stand_for_it() -> None:
    comm = Communicator(_Recorder([], "leaders", size=2), ReduceOp.Average, average_over=8)
    assert comm.scaling(torch.float16) == (ReduceOp.Sum, 1 / 8, 1.0)
    assert comm.scaling(torch.float32) == (ReduceOp.Sum, 1.0, 1 / 8)
    assert Communicator(_Recorder([], "job", size=8)).scaling(torch.float32) == (
        ReduceOp.Average, 1.0, 1.0)  # fmt: skip
