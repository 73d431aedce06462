"""The oracle's rows for people: a table, the ranking, JSON lines, and the plot of each
epoch's shares."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commlayer.oracle.row import Row

_GIB = float(1 << 30)


def table(rows: Sequence[Row]) -> str:
    """One line per row: memory, compute, communication (hidden part), epoch, iteration, cost."""
    head = (
        f"{'strategy':<13} {'B':>8} {'p':>5} {'mem GiB':>8} {'fits':>4} {'comp s':>10} "
        f"{'comm s':>10} {'hidden s':>9} {'epoch s':>10} {'iter ms':>9} {'GPU-min':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.case or r.strategy:<13} {r.B:>8g} {r.p:>5} {r.mem_bytes / _GIB:>8.2f} "
            f"{'yes' if r.fits else 'NO':>4} {r.tcomp_s:>10.1f} {r.tcomm_s:>10.1f} "
            f"{r.hidden_s:>9.1f} {r.time_s:>10.1f} {r.iter_s * 1e3:>9.2f} "
            f"{r.cost_gpu_min:>8.0f}"
        )
    return "\n".join(lines)


def ranking(rows: Sequence[Row], count: int = 10) -> str:
    """The fastest rows that fit, per epoch; then each strategy's best and its cost."""
    fitting = sorted((r for r in rows if r.fits), key=lambda r: (r.time_s, r.p))
    if not fitting:
        return "ranking: no row fits in the GPU's memory"
    lines = [f"ranking (fits in memory, by time per epoch; {len(fitting)} of {len(rows)} rows):"]
    for i, r in enumerate(fitting[:count], 1):
        lines.append(
            f"{i:>3}. {r.case or r.strategy:<13} p={r.p:<5} B={r.B:<8g} "
            f"{r.time_s:10.1f} s/epoch  {r.cost_gpu_min:8.0f} GPU-min"
        )
    best: dict[str, Row] = {}
    for r in fitting:
        best.setdefault(r.strategy, r)
    lines.append(
        "best per strategy: "
        + ", ".join(f"{name} p={r.p} {r.time_s:.1f} s" for name, r in best.items())
    )
    cheapest = min(fitting, key=lambda r: (r.cost_gpu_min, r.time_s))
    lines.append(
        f"cheapest: {cheapest.case or cheapest.strategy} p={cheapest.p} B={cheapest.B:g}"
        f" {cheapest.cost_gpu_min:.0f} GPU-min ({cheapest.time_s:.1f} s/epoch)"
    )
    return "\n".join(lines)


def json_lines(rows: Sequence[Row]) -> str:
    return "\n".join(json.dumps(r.as_dict(), sort_keys=True) for r in rows)


GPU_MIN = (
    "GPU-min: the GPUs times the epoch rounded up to whole minutes, as ParaDL bills it "
    "(8 GPUs for 61 s cost 16 GPU-min)"
)


def figure(rows: Sequence[Row], title: str) -> Any:
    """Per strategy, one bar per GPU count, 100% tall: the shares of the epoch spent computing
    and on exposed communication, on a linear axis; the communication hidden behind backward
    is drawn hatched inside the compute share (it runs at the same time, so it adds nothing to
    the epoch); above each bar its epoch in seconds and its cost in GPU-min; rows over memory
    faded. Returns the matplotlib figure (the ``bench`` extra); :func:`plot` saves it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    names = list(dict.fromkeys(r.strategy for r in rows))
    cols = min(3, len(names)) or 1
    lines = math.ceil(len(names) / cols) or 1
    fig, axes = plt.subplots(
        lines, cols, figsize=(5.2 * cols, 3.9 * lines + 0.9), squeeze=False, sharey=True
    )
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        mine = [r for r in rows if r.strategy == name]
        xs = list(range(len(mine)))
        alpha = [1.0 if r.fits else 0.35 for r in mine]
        epoch = [r.time_s or 1.0 for r in mine]  # a zero epoch: shares of nothing, all 0
        comp = [100 * r.tcomp_s / t for r, t in zip(mine, epoch)]
        exposed = [100 * (r.tcomm_s - r.hidden_s) / t for r, t in zip(mine, epoch)]
        hidden = [100 * min(r.hidden_s, r.tcomp_s) / t for r, t in zip(mine, epoch)]
        ax.bar(xs, comp, color=[to_rgba("tab:blue", a) for a in alpha], label="compute")
        ax.bar(
            xs,
            exposed,
            bottom=comp,
            color=[to_rgba("tab:orange", a) for a in alpha],
            label="communication (exposed: adds to the epoch)",
        )
        ax.bar(
            xs,
            hidden,
            bottom=[c - h for c, h in zip(comp, hidden)],
            color="none",
            edgecolor=[to_rgba("tab:orange", a) for a in alpha],
            hatch="///",
            linewidth=0.8,
            label="communication hidden behind backward (inside the compute share)",
        )
        crowded = len(mine) > 5  # labels turned upright, one line each
        sep = " · " if crowded else "\n"
        for x, r in zip(xs, mine):
            ax.text(
                x,
                102,
                f"{r.time_s:,.0f} s{sep}{r.cost_gpu_min:,.0f} GPU-min",
                ha="center",
                va="bottom",
                fontsize=6 if crowded else 6.5,
                rotation=90 if crowded else 0,
            )
        labels = [f"{r.p}\nB={r.B:g}" if len(mine) < 9 else str(r.p) for r in mine]
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylim(0, 185)
        ax.set_yticks(range(0, 101, 25))
        ax.set_title(
            name + ("  (faded: over memory)" if not all(r.fits for r in mine) else ""), fontsize=9
        )
        ax.set_xlabel("GPUs", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("share of the epoch (%)")
    legend: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.suptitle(title + "\nabove each bar: seconds per epoch and its cost", fontsize=10)
    fig.legend(
        list(legend.values()),
        list(legend.keys()),
        loc="lower center",
        fontsize=7,
        ncol=3,
        bbox_to_anchor=(0.5, 0.025),
    )
    fig.text(0.5, 0.005, GPU_MIN, ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    return fig


def plot(rows: Sequence[Row], path: str | Path, title: str) -> Path:
    """:func:`figure` saved as a PNG at ``path``. Needs matplotlib (the ``bench`` extra)."""
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
