"""The cost model (issue #5): the alpha-beta-gamma sum over a schedule, interpolation of the
measured native algorithms, auto's choice, storage, the fit, and the ``commlayer`` command."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from commlayer import algorithms, cli, costmodel
from commlayer.backends.loopback import LoopbackBackend, run_ranks
from commlayer.common.topology import Topology
from commlayer.core.selection import Allreducer
from commlayer.core.startup import agreed_calibrations
from commlayer.costmodel import Calibration
from commlayer.launch import calibrate as measure

CAL = Calibration(
    size=4,
    nodes=1,
    alpha_s=10e-6,
    beta_s_per_byte=1e-9,
    gamma_s_per_byte=0.5e-9,
    copy_s_per_byte=0.25e-9,
    native={"native": [(1024, 5e-6), (1 << 20, 500e-6)], "shm": [(1024, 50e-6), (1 << 20, 200e-6)]},
    host="test",
    date="2026-11-23",
)


def test_ring_prediction_is_the_textbook_formula() -> None:
    p, n, e = 4, 4000, 4  # 1000 elements per block, 4000 bytes per block
    block = n // p * e
    expected = 2 * (p - 1) * (CAL.alpha_s + CAL.beta_s_per_byte * block)
    expected += (p - 1) * CAL.gamma_s_per_byte * block + (p - 1) * CAL.copy_s_per_byte * block
    assert costmodel.predict("ring", n, e, CAL) == pytest.approx(expected)


def test_chunked_ring_steps_add_an_alpha_per_piece_and_hide_local_work_by_the_overlap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        importlib.import_module("commlayer.algorithms.schedule"), "RING_CHUNK_ELEMENTS", 250
    )
    p, n, e = 4, 4000, 4  # 1000-element blocks in 4 pieces of 250
    block = n // p * e
    transfer = CAL.alpha_s + CAL.beta_s_per_byte * block + 3 * CAL.alpha_s
    local = (p - 1) * (CAL.gamma_s_per_byte + CAL.copy_s_per_byte) * block
    assert costmodel.predict("ring", n, e, CAL) == pytest.approx(2 * (p - 1) * transfer + local)
    half = dataclasses.replace(CAL, overlap=0.5)
    hidden = 0.5 * 3 / 4 * local  # local work per step is below the transfer time here
    assert CAL.gamma_s_per_byte * block * 3 / 4 < transfer
    assert costmodel.predict("ring", n, e, half) == pytest.approx(
        2 * (p - 1) * transfer + local - hidden
    )


def test_prediction_is_the_slowest_rank() -> None:
    cal = dataclasses.replace(CAL, size=3)  # rank 0 is folded in: 2 steps; rank 2: 1 + 2 + 1
    times = [
        costmodel.schedule_time(algorithms.schedule("recursive_doubling", r, 3, 100), 4, cal)
        for r in range(3)
    ]
    assert costmodel.predict("recursive_doubling", 100, 4, cal) == pytest.approx(max(times))
    assert len(set(times)) > 1


def test_native_curves_interpolate_log_log_and_extrapolate_at_constant_bandwidth() -> None:
    assert costmodel.predict("native", 256, 4, CAL) == pytest.approx(5e-6)  # 1 KiB: measured
    assert costmodel.predict("native", 1 << 18, 4, CAL) == pytest.approx(500e-6)
    middle = costmodel.predict("native", 1 << 13, 4, CAL)  # 32 KiB, halfway in log space
    assert middle == pytest.approx((5e-6 * 500e-6) ** 0.5)
    assert costmodel.predict("native", 1 << 20, 4, CAL) == pytest.approx(4 * 500e-6)
    assert costmodel.predict("native", 10, 4, CAL) == pytest.approx(5e-6)  # below: the smallest
    no_shm = dataclasses.replace(CAL, native={"native": CAL.native["native"]})
    assert costmodel.predict("shm", 1000, 4, no_shm) is None


def test_auto_picks_the_fastest_prediction_with_a_margin_for_schedules() -> None:
    for nbytes in (1024, 1 << 16, 1 << 20, 1 << 26):
        table = costmodel.table(nbytes, CAL)
        assert [t for _, t in table] == sorted(t for _, t in table)
        natives = [(n, t) for n, t in table if n in ("native", "shm")]
        pick = costmodel.choose(nbytes // 4, 4, 4, 1, CAL)
        if (
            table[0][0] in ("native", "shm")
            or table[0][1] * costmodel.SCHEDULE_MARGIN <= natives[0][1]
        ):
            assert pick == table[0][0]
        else:
            assert pick == natives[0][0]
    # A schedule predicted 2x faster than every native is taken; 1.1x faster is not.
    slow = dataclasses.replace(CAL, native={"native": [(1024, 1.0), (1 << 30, 2.0)]})
    assert costmodel.choose(1 << 20, 4, 4, 1, slow) not in ("native", "shm")
    ring = costmodel.predict("ring", 1 << 18, 4, CAL)
    assert ring is not None
    close = dataclasses.replace(CAL, native={"native": [(1 << 20, ring * 1.1)]})
    assert costmodel.table(1 << 20, close)[0][0] != "native"
    assert costmodel.choose(1 << 18, 4, 4, 1, close) == "native"
    assert costmodel.choose(256, 4, 4, 1, CAL) == "native"  # 5 us measured beats any schedule
    assert costmodel.choose(1 << 18, 4, 4, 1, CAL) == "shm"  # 200 us measured vs mpi's 500


def test_auto_without_a_matching_calibration_uses_the_rule_of_thumb() -> None:
    big, small = costmodel.HEURISTIC_SHM_BYTES // 4, 1000
    assert costmodel.choose(big, 4, 2, 1, None) == "shm"
    assert costmodel.choose(small, 4, 2, 1, None) == "native"
    assert costmodel.choose(big, 4, 2, 2, None) == "native"  # several nodes: MPI's own
    assert costmodel.choose(big, 4, 2, 1, CAL) == "shm"  # CAL is for 4 ranks, not 2
    assert costmodel.choose(big, 4, 1, 1, CAL) == "native"
    assert "shm" not in costmodel.candidates(single_node=False)


def test_allreducer_decides_once_per_size_class_the_same_on_every_rank() -> None:
    def main(backend: LoopbackBackend) -> list[str]:
        allreducer = Allreducer("auto", [dataclasses.replace(CAL, size=2)])
        return [allreducer.choose(backend, n, 4) for n in (100, 127, 1 << 20, (1 << 21) - 1)]

    first, second = run_ranks(2, main)
    assert first == second
    assert first[0] == first[1] and first[2] == first[3]
    assert "shm" not in first  # the loopback backend has no shared window: shm falls back


def test_save_load_round_trip_and_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    costmodel.save(CAL, path)
    costmodel.save(dataclasses.replace(CAL, size=2), path)
    assert costmodel.load(4, 1, path) == CAL
    assert sorted(c.size for c in costmodel.load_all(path)) == [2, 4]
    assert costmodel.load(8, 1, path) is None
    path.write_text("{not json")
    assert costmodel.load(4, 1, path) is None and costmodel.load_all(path) == []
    path.write_text(json.dumps({"size=4,nodes=1": {"size": 4}}))
    assert costmodel.load(4, 1, path) is None


def test_every_rank_uses_rank_0s_calibrations(caplog: pytest.LogCaptureFixture) -> None:
    # three ranks whose nodes read different files: rank 1 none, rank 2 another measurement
    own = [[CAL], [], [dataclasses.replace(CAL, alpha_s=CAL.alpha_s * 2)]]

    def main(backend: LoopbackBackend) -> list[Calibration]:
        return agreed_calibrations(backend, own[backend.rank])

    with caplog.at_level("WARNING", logger="commlayer"):
        results = run_ranks(3, main)
    assert results == [[CAL]] * 3
    assert "rank(s) [1, 2] read calibrations that differ from rank 0's" in caplog.text
    assert costmodel.from_bytes(costmodel.to_bytes([CAL, CAL])) == [CAL, CAL]


def test_fit_recovers_alpha_and_beta() -> None:
    points = [(n, 20e-6 + n * 0.25e-9) for n in (8.0, 4096.0, 65536.0, 1048576.0, 4194304.0)]
    alpha, beta = measure._fit(points)
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(0.25e-9, rel=1e-6)


def test_cli_prints_the_predicted_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cal.json"
    costmodel.save(CAL, path)
    assert cli.main(["algorithms", "--size", "64MiB", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "4 ranks on 1 node(s)" in out and "67,108,864 B:" in out
    for name in ("native", "shm", "ring", "rabenseifner", "recursive_doubling", "tree"):
        assert f"{name} " in out
    assert cli.main(["algorithms", "--file", str(path), "--ranks", "3"]) == 1
    assert "no calibration" in capsys.readouterr().err


def test_steps_are_costed_from_the_measured_exchange_curve() -> None:
    # MPI's protocol switch: the curve's per-byte cost changes between 4 KiB and 1 MiB.
    cal = dataclasses.replace(CAL, exchange=[(8, 20e-6), (4096, 30e-6), (1 << 20, 1000e-6)])
    assert costmodel.message_time(8, cal) == pytest.approx(20e-6)
    assert costmodel.message_time(1 << 20, cal) == pytest.approx(1000e-6)
    assert costmodel.message_time(2 << 20, cal) == pytest.approx(2000e-6)  # constant bandwidth
    mid = costmodel.message_time(1 << 16, cal)  # log-log between 4 KiB and 1 MiB
    assert 30e-6 < mid < 1000e-6 and mid != pytest.approx(CAL.alpha_s + CAL.beta_s_per_byte * 65536)
    p, n = 2, 1 << 18  # ring on 2 ranks: one reduce step and one copy step of n/2 elements
    half = n // 2 * 4
    expected = (
        2 * costmodel.message_time(half, cal) + (cal.gamma_s_per_byte + cal.copy_s_per_byte) * half
    )
    assert costmodel.predict("ring", n, 4, dataclasses.replace(cal, size=p)) == pytest.approx(
        expected
    )


# -- several nodes: the inter-node curve and the contention factor ------------------------------
def _line(alpha_s: float, beta_s_per_byte: float) -> list[tuple[int, float]]:
    return [(1 << k, alpha_s + beta_s_per_byte * (1 << k)) for k in range(3, 31)]


TWO_NODES = Topology((0, 0, 0, 0, 1, 1, 1, 1))
CAL_2X4 = dataclasses.replace(
    CAL,
    size=8,
    nodes=2,
    native={"native": [(1024, 1.0), (1 << 30, 2.0)]},  # slow: the model's pick is a schedule
    exchange=_line(10e-6, 1e-9),
    exchange_inter=_line(100e-6, 10e-9),  # the network: 10x the intra-node alpha and beta
)


def test_topology_aware_schedules_beat_flat_ones_when_crossing_nodes_is_slow() -> None:
    for nbytes in (1 << 20, 1 << 26):
        times = {
            name: costmodel.predict(name, nbytes // 4, 4, CAL_2X4, TWO_NODES)
            for name in ("ring", "rabenseifner", "hierarchical", "shd")
        }
        for fast in ("hierarchical", "shd"):
            for flat in ("ring", "rabenseifner"):
                assert times[fast] < times[flat], (nbytes, times)


def test_flows_sharing_a_node_link_cost_their_bytes_times_their_number() -> None:
    n = 1 << 20  # bytes; rabenseifner's first step: ranks 0-3 each swap n/2 with ranks 4-7
    sharing = costmodel._link_sharing("rabenseifner", n // 4, TWO_NODES, 0)
    assert sharing == ((4, 4), (1, 1), (1, 1), (1, 1), (1, 1), (4, 4))
    # ring: a node's last rank sends across and its first receives, one flow each way
    assert set(costmodel._link_sharing("ring", n // 4, TWO_NODES, 0)) == {(1, 1)}

    def t_in(nbytes: int) -> float:
        return 10e-6 + 1e-9 * nbytes

    def t_out(nbytes: int) -> float:
        return 100e-6 + 10e-9 * nbytes

    g, c = CAL.gamma_s_per_byte, CAL.copy_s_per_byte
    first = algorithms.schedule("rabenseifner", 0, 8, n // 4, TWO_NODES)[0]
    one_flow = costmodel.step_time(first, 4, CAL_2X4, TWO_NODES, 0)
    four_flows = costmodel.step_time(first, 4, CAL_2X4, TWO_NODES, 0, (4, 4))
    assert one_flow == pytest.approx(t_out(n // 2) + g * n / 2)
    assert four_flows == pytest.approx(t_out(4 * n // 2) + g * n / 2)
    expected = (
        t_out(2 * n) + g * n / 2 + t_in(n // 4) + g * n / 4 + t_in(n // 8) + g * n / 8  # halving
        + t_in(n // 8) + c * n / 8 + t_in(n // 4) + c * n / 4 + t_out(2 * n) + c * n / 2
    )  # fmt: skip
    assert costmodel.predict("rabenseifner", n // 4, 4, CAL_2X4, TWO_NODES) == pytest.approx(
        expected
    )


def test_without_an_inter_curve_the_one_curve_model_is_unchanged() -> None:
    one_curve = dataclasses.replace(CAL_2X4, exchange_inter=[])
    assert not one_curve.has_inter and CAL_2X4.has_inter
    numel = 1 << 18
    for name in ("ring", "rabenseifner", "hierarchical", "shd", "tree", "swing"):
        schedules = [algorithms.schedule(name, r, 8, numel, TWO_NODES) for r in range(8)]
        expected = max(costmodel.schedule_time(s, 4, one_curve) for s in schedules)
        predicted = costmodel.predict(name, numel, 4, one_curve, TWO_NODES)
        assert predicted == pytest.approx(expected)
    assert costmodel.predict("ring", numel, 4, one_curve, TWO_NODES) == pytest.approx(
        costmodel.predict("ring", numel, 4, one_curve)
    )


def test_auto_on_several_nodes_uses_the_model_only_with_an_inter_curve() -> None:
    numel = (1 << 24) // 4
    one_curve = dataclasses.replace(CAL_2X4, exchange_inter=[])
    assert costmodel.choose(numel, 4, 8, 2, one_curve, TWO_NODES) == "native"
    pick = costmodel.choose(numel, 4, 8, 2, CAL_2X4, TWO_NODES)
    assert pick == costmodel.table(1 << 24, CAL_2X4, 4, TWO_NODES)[0][0]
    assert pick in ("hierarchical", "shd", "torus2d")
    assert costmodel.choose(numel, 4, 8, 2, CAL_2X4) == pick  # node-major assumed, the same
    assert "shm" not in dict(costmodel.table(1 << 24, CAL_2X4))

    def main(backend: LoopbackBackend) -> str:
        return Allreducer("auto", [CAL_2X4], TWO_NODES).choose(backend, numel, 4)

    assert run_ranks(8, main) == [pick] * 8


def test_inter_curve_round_trips_and_files_without_it_still_load(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    costmodel.save(CAL_2X4, path)
    assert costmodel.load(8, 2, path) == CAL_2X4
    old = dataclasses.asdict(dataclasses.replace(CAL, exchange=_line(10e-6, 1e-9)))
    del old["exchange_inter"]
    path.write_text(json.dumps({"size=4,nodes=1": old}))
    loaded = costmodel.load(4, 1, path)
    assert loaded is not None and loaded.exchange_inter == [] and not loaded.has_inter
    assert loaded.exchange == _line(10e-6, 1e-9)


def _distinct_schedules(rows: list[tuple[str, float]]) -> list[str]:
    """Schedules fastest first, each predicted time once (the first name of a tie)."""
    seen: dict[float, str] = {}
    for name, seconds in rows:
        if name not in ("native", "shm"):
            seen.setdefault(seconds, name)
    return list(seen.values())


def test_tuning_candidates_are_the_pick_the_natives_and_the_two_best_schedules() -> None:
    numel = 1 << 18
    schedules = _distinct_schedules(costmodel.table(4 * numel, CAL))
    assert costmodel.ranked(numel, 4, 4, 1, CAL) == ["shm", "native", *schedules[:2]]
    assert costmodel.ranked(numel, 4, 4, 1, CAL, count=3) == ["shm", "native", schedules[0]]
    # A calibration that ranks the natives last (taken while they were slow) still has them
    # measured, after the pick.
    slow = dataclasses.replace(CAL, native={k: [(1024, 1.0), (1 << 20, 1.0)] for k in CAL.native})
    pick = costmodel.choose(numel, 4, 4, 1, slow)
    assert pick not in ("native", "shm")
    second = next(n for n in _distinct_schedules(costmodel.table(4 * numel, slow)) if n != pick)
    assert costmodel.ranked(numel, 4, 4, 1, slow) == [pick, "shm", "native", second]


def test_tuning_candidates_skip_a_schedule_tied_with_a_faster_one() -> None:
    """Predicted to the same time, two schedules take the same steps here (shd on one node is
    rabenseifner): tuning measures the next distinct one instead of the twin."""
    numel = 1 << 18
    rows = costmodel.table(4 * numel, CAL)
    times = dict(rows)
    assert times["shd"] == times["rabenseifner"]  # the twin this test is about
    candidates = costmodel.ranked(numel, 4, 4, 1, CAL)
    assert not {"shd", "rabenseifner"} <= set(candidates), candidates
    schedules = [n for n in candidates if n not in ("native", "shm")]
    assert len(schedules) == 2 and times[schedules[0]] != times[schedules[1]], candidates


def test_tuning_candidates_without_a_calibration_and_across_nodes() -> None:
    assert costmodel.ranked(1 << 20, 4, 2, 1, None) == ["shm", "native", "rabenseifner"]
    assert costmodel.ranked(16, 4, 2, 1, None) == ["native", "shm", "recursive_doubling"]
    assert costmodel.ranked(1 << 20, 4, 4, 2, None) == ["native", "rabenseifner"]  # no window
    assert costmodel.ranked(1 << 20, 4, 1, 1, None) == ["native"]  # one rank: nothing to measure
