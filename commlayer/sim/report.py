"""Simulation results as a Markdown table, JSON lines, and a plot against ranks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from commlayer.sim.simulate import Result


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.3f}"


HEADER = (
    "| algorithm | platform | ranks | size | simulated ms | bus GB/s | model ms | model/sim "
    "| messages | wall s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def markdown_row(r: Result) -> str:
    ratio = "-" if r.model_s is None else f"{r.model_s / r.simulated_s:.3f}"
    return (
        f"| {r.label}{' (pairwise)' if r.pairwise else ''} | {r.platform} | {r.ranks} | "
        f"{_size(r.size_bytes)} | "
        f"{_ms(r.simulated_s)} | {r.busbw_Bps / 1e9:.2f} | {_ms(r.model_s)} | {ratio} | "
        f"{r.messages} | {r.wall_s:.1f} |"
    )


def markdown(results: Sequence[Result]) -> str:
    return "\n".join([HEADER, *map(markdown_row, results)]) + "\n"


def json_line(r: Result) -> str:
    return json.dumps(r.as_dict(), sort_keys=True)


def plot(
    results: Sequence[Result],
    path: Path,
    title: str = "",
    kind: Callable[[Result], str] = lambda r: r.platform.split(":")[0],
) -> None:
    """Simulated time against ranks (log-log), one panel per size, one line per algorithm
    and platform (``kind``: a result's platform name in the legend, by default the spec's
    kind). Needs matplotlib (pip install '.[bench]')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.size_bytes for r in results})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.8), squeeze=False)
    # colour by algorithm, line style by platform: a dozen lines stay readable
    names = sorted({r.label.split("=")[0] for r in results})
    kinds = sorted({kind(r) for r in results})
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
    dashes = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 4)))
    styles = {k: dashes[i % len(dashes)] for i, k in enumerate(kinds)}
    for ax, size in zip(axes[0], sizes):
        lines: dict[tuple[str, str], list[Result]] = {}
        for r in results:
            if r.size_bytes == size:
                # "auto=shd" and "auto=ring" are one line: auto's picks across ranks
                key = (r.label.split("=")[0], kind(r))
                lines.setdefault(key, []).append(r)
        for (algorithm, platform), rows in sorted(lines.items()):
            rows.sort(key=lambda r: r.ranks)
            ax.plot(
                [r.ranks for r in rows],
                [r.simulated_s * 1e3 for r in rows],
                marker="o",
                color=colours[algorithm],
                linestyle=styles[platform],
                label=f"{algorithm} on {platform}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        if ax is axes[0][0]:  # one label: the panels' own would overlap their neighbours
            ax.set_ylabel("simulated allreduce time (ms)")
        ax.set_title(f"{_size(size)}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.subplots_adjust(bottom=0.12 + 0.045 * -(-len(labels) // 5))
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
