"""Simulation results as a Markdown table, JSON lines, and a plot (against ranks, or bars at
one rank count; compressed reductions: time and cross-host bytes against ranks)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


COMPRESSED_HEADER = (
    "| compressor | hierarchy | platform | ranks | size | cross-host MB | simulated ms | "
    "model ms | model/sim | messages | wall s |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def compressed_row(r: Result) -> str:
    """A compressed reduction's row (sim/compressed.py): cross-host MB is the most a node sent
    to the others."""
    ratio = "-" if r.model_s is None else f"{r.model_s / r.simulated_s:.3f}"
    return (
        f"| {r.compression} | {'per host' if r.per_host else 'flat'} | {r.platform} | "
        f"{r.ranks} | {_size(r.size_bytes)} | {(r.cross_bytes or 0) / 1e6:,.1f} | "
        f"{_ms(r.simulated_s)} | {_ms(r.model_s)} | {ratio} | {r.messages} | {r.wall_s:.1f} |"
    )


def markdown(results: Sequence[Result]) -> str:
    """The results as a table: a compressed reduction's columns for compressed rows."""
    dense = [r for r in results if r.compression is None]
    packed = [r for r in results if r.compression is not None]
    tables = []
    if dense or not packed:
        tables.append("\n".join([HEADER, *map(markdown_row, dense)]))
    if packed:
        tables.append("\n".join([COMPRESSED_HEADER, *map(compressed_row, packed)]))
    return "\n\n".join(tables) + "\n"


def json_line(r: Result) -> str:
    return json.dumps(r.as_dict(), sort_keys=True)


def _algorithm(r: Result) -> str:
    """The line or bar a result belongs to: ``auto=shd`` and ``auto=ring`` are both ``auto``."""
    return r.label.split("=")[0]


def _pick(r: Result) -> str:
    """What ``auto`` chose (``shd`` of ``auto=shd``); empty for any other algorithm."""
    return r.label.split("=", 1)[1] if "=" in r.label else ""


def figure(
    results: Sequence[Result],
    title: str = "",
    kind: Callable[[Result], str] = lambda r: r.platform.split(":")[0],
) -> Any:
    """One panel per size. Over several rank counts: simulated time against ranks (log-log),
    one line per algorithm and platform (``kind``: a result's platform name in the legend, by
    default the spec's kind), ``auto`` drawn last, as hollow diamonds without a line, its pick
    written beside each point (it lies on the line of the algorithm it picked). At one rank count: a
    bar per algorithm and platform on a linear axis, its time written at its end, ``auto``
    hatched with its pick written beside its time. Returns the matplotlib figure (the
    ``bench`` extra); :func:`plot` saves it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.size_bytes for r in results})
    one_count = len({r.ranks for r in results}) == 1
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.8), squeeze=False)
    # colour by algorithm, line style by platform: a dozen lines stay readable
    names = sorted({_algorithm(r) for r in results})
    kinds = sorted({kind(r) for r in results})
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
    dashes = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 4)))
    styles = {k: dashes[i % len(dashes)] for i, k in enumerate(kinds)}
    hatches = ("", "..", "xx", "\\\\", "oo", "--")
    for ax, size in zip(axes[0], sizes):
        groups: dict[tuple[str, str], list[Result]] = {}
        for r in results:
            if r.size_bytes == size:
                groups.setdefault((_algorithm(r), kind(r)), []).append(r)
        # auto last: drawn over the line of the algorithm it picked, not under it
        keys = sorted(groups, key=lambda k: (k[0] == "auto", k))
        if one_count:
            _bars(ax, [(k, groups[k][0]) for k in keys], colours, kinds, hatches)
            ax.set_title(f"{_size(size)}, {results[0].ranks} ranks")
            continue
        for algorithm, platform in keys:
            rows = sorted(groups[(algorithm, platform)], key=lambda r: r.ranks)
            xs = [r.ranks for r in rows]
            ys = [r.simulated_s * 1e3 for r in rows]
            auto = algorithm == "auto"
            ax.plot(
                xs,
                ys,
                marker="D" if auto else "o",
                markersize=10 if auto else 6,
                markerfacecolor="none" if auto else colours[algorithm],
                markeredgewidth=1.8 if auto else 1.0,
                color=colours[algorithm],
                linestyle="none" if auto else styles[platform],  # the picked line shows
                zorder=4 if auto else 2,
                label=f"{algorithm} on {platform}"
                + (" (its pick beside each point)" if auto else ""),
            )
            for x, y, r in zip(xs, ys, rows):
                if auto:
                    ax.annotate(
                        _pick(r), (x, y), xytext=(7, -3), textcoords="offset points",
                        fontsize=7, color=colours[algorithm],
                    )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        if ax is axes[0][0]:  # one label: the panels' own would overlap their neighbours
            ax.set_ylabel("simulated allreduce time (ms)")
        ax.set_title(f"{_size(size)}")
        ax.grid(True, which="both", alpha=0.3)
    if not one_count:  # the bars name themselves
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
        fig.subplots_adjust(bottom=0.12 + 0.045 * -(-len(labels) // 5))
    else:
        fig.tight_layout()
    if title:
        fig.suptitle(title)
    return fig


def _bars(
    ax: Any,
    rows: Sequence[tuple[tuple[str, str], Result]],
    colours: dict[str, str],
    kinds: Sequence[str],
    hatches: Sequence[str],
) -> None:
    """One horizontal bar per (algorithm, platform), first at the top, on a linear axis from
    zero, each with its time written at its end; ``auto``'s bar hatched, its pick written
    beside its time."""
    top = max((r.simulated_s * 1e3 for _, r in rows), default=1.0)
    ticks = []
    for y, ((algorithm, platform), r) in enumerate(rows):
        ms = r.simulated_s * 1e3
        auto = algorithm == "auto"
        name = algorithm
        ax.barh(
            -y,
            ms,
            color=colours[algorithm],
            hatch="///" if auto else hatches[kinds.index(platform) % len(hatches)],
            edgecolor="black" if auto else "white",
            alpha=0.55 if auto else 1.0,
            label=f"{name} on {platform}",
        )
        said = f"{ms:,.3g} ms" + (f" (picked {_pick(r)})" if auto else "")
        ax.text(ms + top * 0.02, -y, said, va="center", fontsize=8)
        ticks.append(name if len(kinds) == 1 else f"{name} on {platform}")
    ax.set_yticks([-y for y in range(len(rows))], ticks, fontsize=8)
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("simulated allreduce time (ms)")
    ax.grid(True, axis="x", alpha=0.3)


def compressed_figure(
    results: Sequence[Result],
    title: str = "",
    kind: Callable[[Result], str] = lambda r: r.platform.split(":")[0],
) -> Any:
    """Compressed reductions (sim/compressed.py), a column per platform kind and size: above,
    simulated time against ranks; below, the most MB a node sent to the others; a colour per
    compressor, solid once per host, dashed flat (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({(kind(r), r.size_bytes) for r in results})
    specs = sorted({str(r.compression) for r in results})
    colours = {spec: f"C{i % 10}" for i, spec in enumerate(specs)}
    fig, axes = plt.subplots(
        2, len(columns), figsize=(4.6 * len(columns), 8), squeeze=False, sharex="col"
    )
    for c, (platform, size) in enumerate(columns):
        here = [r for r in results if kind(r) == platform and r.size_bytes == size]
        for spec in specs:
            for per_host in (False, True):
                rows = sorted(
                    (r for r in here if r.compression == spec and bool(r.per_host) == per_host),
                    key=lambda r: r.ranks,
                )
                if not rows:
                    continue
                style = {
                    "color": colours[spec],
                    "linestyle": "-" if per_host else "--",
                    "marker": "o" if per_host else "s",
                    "markerfacecolor": colours[spec] if per_host else "none",
                    "label": f"{spec} {'per host' if per_host else 'flat'}",
                }
                xs = [r.ranks for r in rows]
                axes[0][c].plot(xs, [r.simulated_s * 1e3 for r in rows], **style)
                axes[1][c].plot(xs, [(r.cross_bytes or 0) / 1e6 for r in rows], **style)
        axes[0][c].set_title(f"{platform}, {_size(size)} bucket")
        axes[1][c].set_xlabel("ranks")
        for ax in (axes[0][c], axes[1][c]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("simulated time of one bucket (ms)")
    axes[1][0].set_ylabel("MB a node sends to the others")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.subplots_adjust(bottom=0.08 + 0.03 * -(-len(labels) // 6), hspace=0.12)
    if title:
        fig.suptitle(title)
    return fig


def plot(
    results: Sequence[Result],
    path: Path,
    title: str = "",
    kind: Callable[[Result], str] = lambda r: r.platform.split(":")[0],
) -> None:
    """:func:`figure` (:func:`compressed_figure` for compressed reductions) saved as a PNG at
    ``path``. Needs matplotlib (pip install '.[bench]')."""
    import matplotlib.pyplot as plt

    packed = all(r.compression is not None for r in results) and results
    fig = compressed_figure(results, title, kind) if packed else figure(results, title, kind)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
