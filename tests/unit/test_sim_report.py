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
