"""The plot of `commlayer simulate --plot`: at one rank count a bar per algorithm on a linear
axis, ``auto`` among them and told apart; over several rank counts ``auto`` drawn over the
line it equals, with its pick beside each point."""

from __future__ import annotations

import pytest

from commlayer.sim import report
from commlayer.sim.simulate import Result

MIB = 1 << 20


def _result(algorithm: str, ranks: int, size: int, ms: float) -> Result:
    return Result(algorithm, "fat-tree:gpus-per-node=4", ranks, size, ms / 1e3, None, 0, 0.0)


# as `commlayer simulate --platform fat-tree:gpus-per-node=4 --ranks 64` gave them
ONE_COUNT = [
    _result("ring", 64, MIB, 0.291),
    _result("rabenseifner", 64, MIB, 0.640),
    _result("shd", 64, MIB, 0.197),
    _result("hierarchical", 64, MIB, 0.220),
    _result("auto=shd", 64, MIB, 0.197),
    _result("ring", 64, 32 * MIB, 5.41),
    _result("shd", 64, 32 * MIB, 6.05),
    _result("auto=ring", 64, 32 * MIB, 5.41),
]


def test_one_rank_count_draws_one_bar_per_algorithm_auto_included() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = report.figure(ONE_COUNT)
    small, large = fig.axes
    assert small.get_xscale() == "linear" and small.get_xlim()[0] == 0
    bars = {c.get_label(): c.patches for c in small.containers}
    names = ["hierarchical", "rabenseifner", "ring", "shd", "auto"]
    assert list(bars) == [f"{n} on fat-tree" for n in names]  # one artist each, auto last
    assert all(len(patches) == 1 for patches in bars.values())
    widths = {k.split()[0]: p[0].get_width() for k, p in bars.items()}
    assert widths["auto"] == pytest.approx(0.197) and widths["shd"] == pytest.approx(0.197)
    # auto equals shd but has a row of its own, and a look of its own
    rows = {k.split()[0]: p[0].get_y() for k, p in bars.items()}
    assert len(set(rows.values())) == len(names)
    assert bars["auto on fat-tree"][0].get_hatch() and not bars["shd on fat-tree"][0].get_hatch()
    assert [t.get_text() for t in small.get_yticklabels()] == names
    said = [t.get_text() for t in small.texts]
    assert "0.197 ms (picked shd)" in said and "0.64 ms" in said
    assert "5.41 ms (picked ring)" in [t.get_text() for t in large.texts]
    assert [c.get_label().split()[0] for c in large.containers] == ["ring", "shd", "auto"]
    assert small.get_title() == "1 MiB, 64 ranks"
    plt.close(fig)


def test_several_rank_counts_draw_auto_over_the_line_it_equals() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    results = [
        _result(name, ranks, MIB, ms)
        for ranks, times in ((16, (0.18, 0.16, 0.16)), (64, (0.29, 0.197, 0.197)))
        for name, ms in zip(("ring", "shd", "auto=shd"), times)
    ]
    fig = report.figure(results)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    auto = lines["auto on fat-tree (its pick beside each point)"]
    shd = lines["shd on fat-tree"]
    assert list(auto.get_ydata()) == pytest.approx(list(shd.get_ydata()))
    # drawn above every line, as markers unlike theirs, without a line hiding the one it equals
    assert auto.get_zorder() > max(ln.get_zorder() for ln in ax.get_lines() if ln is not auto)
    assert auto.get_marker() != shd.get_marker() and auto.get_linestyle() == "None"
    assert [t.get_text() for t in ax.texts] == ["shd", "shd"]
    plt.close(fig)


def _compressed(spec: str, per_host: bool, ranks: int, ms: float, mb: float) -> Result:
    label = f"{spec} {'per host' if per_host else 'flat'}"
    return Result(
        label, "torus:4x4,gpus-per-node=4", ranks, 64 * MIB, ms / 1e3, ms / 1e3, 0, 0.0,
        compression=spec, per_host=per_host, cross_bytes=int(mb * 1e6),
    )  # fmt: skip


COMPRESSED = [
    _compressed(spec, per_host, ranks, ms * ranks / 64, mb * ranks / 64)
    for spec, ms, mb in (("topk:ratio=0.01", 25.0, 322.0), ("qsgd:levels=7", 164.0, 2045.0))
    for per_host in (False, True)
    for ranks in (64, 256)
]


def test_compressed_rows_get_their_own_table_and_plot() -> None:
    text = report.markdown([*ONE_COUNT[:1], *COMPRESSED])
    dense, packed = text.split("\n\n")
    assert dense.startswith(report.HEADER) and "| ring |" in dense
    assert packed.startswith(report.COMPRESSED_HEADER)
    row = "| topk:ratio=0.01 | per host | torus:4x4,gpus-per-node=4 | 64 | 64 MiB | 322.0 |"
    assert row in packed
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = report.compressed_figure(COMPRESSED)
    time_axis, bytes_axis = fig.axes[0], fig.axes[1]
    lines = {line.get_label(): line for line in time_axis.get_lines()}
    assert set(lines) == {f"{s} {h}" for s in ("topk:ratio=0.01", "qsgd:levels=7")
                          for h in ("flat", "per host")}  # fmt: skip
    assert lines["qsgd:levels=7 flat"].get_linestyle() == "--"
    assert lines["qsgd:levels=7 per host"].get_linestyle() == "-"
    mb = {line.get_label(): list(line.get_ydata()) for line in bytes_axis.get_lines()}
    assert mb["topk:ratio=0.01 flat"] == [322.0, 1288.0]  # against ranks 64, 256
    plt.close(fig)
