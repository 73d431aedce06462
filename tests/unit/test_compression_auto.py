"""compression="auto" (issue 39): the decision against fake link numbers, the spec, the plan."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from commlayer import compression
from commlayer.comm.communicator import Communicator, Loopback, measure_cpu
from commlayer.compression import auto
from commlayer.compression.auto import AutoCompressor, Link, choose, decide, plan

MLP_LAYER = [torch.zeros(768, 768), torch.zeros(768)]  # 2.36 MB: one of train.py's buckets
# CPU seconds of each candidate on that bucket, of the order compress_cost.py measures
CPU = {"fp16": 0.0006, "bf16": 0.0006, "powersgd:rank=4": 0.004, "topk:ratio=0.01": 0.003}


def _link(gbit_per_s: float, ranks: int = 4, alpha_s: float = 50e-6) -> Link:
    """An allreduce over a link of this rate: 2 (n - 1) / n bytes through it per byte."""
    per_byte = 8 / (gbit_per_s * 1e9) * 2 * (ranks - 1) / ranks
    return Link(alpha_s, per_byte, ranks, "fake")


def test_slow_link_compresses_with_a_cast_and_lossy_only_when_allowed() -> None:
    slow = _link(0.1)  # 100 Mbit/s: 2.36 MB take ~0.28 s
    lossless = decide(MLP_LAYER, slow, CPU, lossy=False)
    assert lossless.choice == "fp16"
    assert set(lossless.predicted_s) == {"none", "fp16", "bf16"}  # no lossy candidate costed
    lossy = decide(MLP_LAYER, slow, CPU, lossy=True)
    assert lossy.choice in ("powersgd:rank=4", "topk:ratio=0.01")
    assert lossy.predicted_s[lossy.choice] < 0.1 * lossy.predicted_s["none"]


def test_fast_link_sends_uncompressed() -> None:
    fast = _link(400.0)  # the link moves 2.36 MB faster than any candidate's CPU work
    for lossy in (False, True):
        assert decide(MLP_LAYER, fast, CPU, lossy=lossy).choice == "none"


def test_where_compression_stops_paying_the_decision_follows() -> None:
    """From slow to fast: a lossy compressor, then a cast, then none, never back."""
    order = {"none": 0, "fp16": 1, "bf16": 1, "powersgd:rank=4": 2, "topk:ratio=0.01": 2}
    picks = [decide(MLP_LAYER, _link(g), CPU, lossy=True).choice for g in (0.1, 1, 10, 100, 1000)]
    ranks = [order[p] for p in picks]
    assert ranks == sorted(ranks, reverse=True), picks
    assert picks[0] != "none" and picks[-1] == "none", picks


def test_margin_keeps_what_is_only_a_little_faster() -> None:
    assert choose({"none": 1.0, "fp16": 0.9, "bf16": 0.95}, lossy=False) == "none"
    assert choose({"none": 1.0, "fp16": 0.8, "bf16": 0.95}, lossy=False) == "fp16"
    # a lossy candidate must beat the cast it would replace, not only none
    got = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "topk:ratio=0.01": 0.45}
    assert choose(got, lossy=True) == "fp16"
    assert choose(got, lossy=True, margin=0.95) == "topk:ratio=0.01"
    assert choose(got, lossy=False, margin=0.95) == "fp16"


def test_gathered_payload_costs_more_with_more_ranks() -> None:
    """top-k's allgather grows with the ranks where an allreduce does not."""
    two = auto.payload_time("topk:ratio=0.01", MLP_LAYER, _link(1, ranks=2))
    sixteen = auto.payload_time("topk:ratio=0.01", MLP_LAYER, _link(1, ranks=16))
    assert sixteen > 4 * two
    cast = auto.payload_time("fp16", MLP_LAYER, _link(1))
    assert cast == pytest.approx(_link(1).allreduce_s(768 * 769 * 2))


def test_link_fit_recovers_alpha_and_beta() -> None:
    link = Link.fit([(16 << 10, 1e-4 + 2e-9 * (16 << 10)), (2 << 20, 1e-4 + 2e-9 * (2 << 20))], 2)
    assert link.alpha_s == pytest.approx(1e-4) and link.beta_s_per_byte == pytest.approx(2e-9)
    flat = Link.fit([(10, 1.0), (20, 0.5)], 2)  # noise: never a negative cost per byte
    assert flat.beta_s_per_byte == 0.0 and flat.allreduce_s(1e9) > 0


def test_auto_spec_parses_and_refuses_bad_parameters() -> None:
    made = compression.create("auto:lossy=1,margin=0.5")
    assert isinstance(made, AutoCompressor) and made.lossy and made.margin == 0.5
    assert compression.check_spec(" auto ") == "auto"
    assert not compression.create("auto").lossy
    for bad, message in [
        ("auto:lossy=2", "lossy must be 0 or 1"),
        ("auto:link=guess", "link must be one of"),
        ("auto:margin=0", "margin must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            compression.create(bad)


def test_policy_keeps_small_tensors_uncompressed_only_when_lossy() -> None:
    small = torch.zeros(10)
    assert compression.Policy("auto").choose("b", small).name == "auto"
    assert compression.Policy("auto:lossy=1").choose("b", small).name == "none"


def test_undecided_auto_sends_tensors_as_they_are() -> None:
    t = torch.arange(6.0)
    future = Communicator(Loopback(2)).reduce([t], AutoCompressor(), "x")
    assert future.wait()[0] is t and torch.equal(t, torch.arange(6.0))


def test_plan_decides_once_per_bucket_class_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    measured: list[str] = []

    def measure(spec: str, tensors: Sequence[torch.Tensor], ranks: int) -> float:
        measured.append(spec)
        return CPU[spec]

    chooser = AutoCompressor(lossy=1)
    buckets = [MLP_LAYER, MLP_LAYER, [torch.zeros(1000, 768)]]
    with caplog.at_level(logging.INFO, logger="commlayer"):
        specs = plan(chooser, buckets, _link(0.1), 4, measure)
    assert specs[0] == specs[1] and specs[0] != "none"
    assert len(chooser.decisions) == 2 and len(measured) == 2 * len(CPU)  # two classes
    assert sum("compression auto:" in r.getMessage() for r in caplog.records) == 2
    assert chooser.decisions[0]["choice"] == specs[0]
    # the chosen compressor is one per spec, with error feedback, and its state is saved
    first = chooser.compressor(specs[0], rank=0)
    assert first is chooser.compressor(specs[0], rank=0)
    assert isinstance(first, compression.ErrorFeedback)


def test_measure_cpu_times_the_real_path() -> None:
    seconds = measure_cpu("topk:ratio=0.01", [torch.randn(64, 64)], ranks=2, repeats=1)
    assert 0 < seconds < 5


def test_link_from_a_calibration_follows_the_cost_model() -> None:
    """auto:link=calibration: t(B) is the cost model's fastest algorithm plus the op latency."""
    from commlayer.costmodel import Calibration, compressed

    def cal(beta: float) -> Calibration:
        return Calibration(2, 1, 20e-6, beta, 1e-10, 1e-10, {}, op_latency_s=1e-4)

    slow, fast = compressed.link(cal(8e-8)), compressed.link(cal(8e-12))
    assert slow.allreduce_s(4 << 20) > 100 * fast.allreduce_s(4 << 20) > 0
    assert fast.allreduce_s(4) >= 1e-4  # the engine's latency per call
    assert decide(MLP_LAYER, slow, CPU, lossy=True).choice != "none"
    assert decide(MLP_LAYER, fast, CPU, lossy=True).choice == "none"
