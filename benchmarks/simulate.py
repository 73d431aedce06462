"""The research's claim, simulated: SHD on a DLN against ring, halving-doubling (Rabenseifner)
and hierarchical on fat-tree, torus and dragonfly (issue 22).

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/simulate.py --ranks 64,256 \\
        --size 1MiB,32MiB,256MiB [--out benchmarks/results/simulate_claim] [--replot]

1. Every platform holds ``--ranks`` ranks, 4 GPUs per node (nodes = ranks / 4) on the same
   links (commlayer/sim/platforms.py defaults: 12.5 GB/s, 0.5 us per network link; NVLink-like
   50 GB/s inside a node): ``fat-tree`` (2 levels, 16 nodes per leaf, full bisection),
   ``torus`` (3D, shape per size below), ``dragonfly`` (shape below), ``dln`` (one switch per
   node). Only the network between the nodes differs.
2. Each (algorithm, platform, ranks, size) is one ``commlayer.sim.simulate`` run: the
   schedules the executor runs, replayed in SMPI, factors off. Results are appended as JSON
   lines to ``OUT.jsonl`` as they finish (a rerun skips what is there), then ``OUT.md`` gets
   the table, with per (ranks, size) SHD-on-DLN's time over each baseline's and the reduction
   ``1 - ratio`` (the research claims 50-90%), and ``OUT.png`` the times against ranks.
3. Ring and hierarchical build O(p^2) schedule steps in Python (2 (p - 1) steps per rank):
   they run up to ``--ring-max-ranks`` (default 256); above it those rows are left out, and
   the table says so.
4. ``--platforms`` picks the networks (default the four above): ``fat-tree-os2`` and
   ``fat-tree-os4`` are the fat tree with its leaves' uplinks oversubscribed 2:1 and 4:1
   (``oversub=``; at 64 ranks the 16 nodes hang off one leaf and there is no uplink), ``dln2d``
   the 2D DLN (one node per switch on an X x Y grid, X = 2^floor(log2(nodes)/2)). The
   baselines run on every network but the DLNs, SHD on all. Their table and plot:
   ``OUT.md``'s second summary and ``OUT_oversub.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from commlayer.sim import platforms, report  # noqa: E402
from commlayer.sim.simulate import Result, simulate  # noqa: E402

GPUS = 4
TORUS = {16: "4x4", 64: "4x4x4", 256: "8x8x4", 1024: "8x8x16"}  # nodes -> shape
DRAGONFLY = {  # nodes -> groups, chassis, routers, nodes per router (SimGrid: routers >= groups-1)
    16: (4, 1, 4, 1),
    64: (4, 1, 4, 4),
    256: (4, 4, 4, 4),
    1024: (8, 4, 8, 4),
}
BASELINES = ("ring", "rabenseifner", "hierarchical")
O_N2 = ("ring", "hierarchical")  # schedules of O(p^2) steps in all
KINDS = ("fat-tree", "torus", "dragonfly", "dln", "fat-tree-os2", "fat-tree-os4", "dln2d")
DEFAULT_KINDS = "fat-tree,torus,dragonfly,dln"
DLNS = ("dln", "dln2d")  # SHD's networks: no baselines run there


def specs(ranks: int) -> dict[str, str]:
    nodes = ranks // GPUS
    g, c, r, n = DRAGONFLY[nodes]
    x = 1 << (nodes.bit_length() - 1) // 2  # the 2D DLN's grid: x by nodes / x switches
    return {
        "fat-tree": f"fat-tree:nodes={nodes},gpus-per-node={GPUS}",
        "torus": f"torus:{TORUS[nodes]},gpus-per-node={GPUS}",
        "dragonfly": f"dragonfly:groups={g},chassis={c},routers={r},nodes={n},gpus-per-node={GPUS}",
        "dln": f"dln:{nodes},gpus-per-node={GPUS}",
        "fat-tree-os2": f"fat-tree:nodes={nodes},gpus-per-node={GPUS},oversub=2",
        "fat-tree-os4": f"fat-tree:nodes={nodes},gpus-per-node={GPUS},oversub=4",
        "dln2d": f"dln2d:{x}x{nodes // x},gpus-per-node={GPUS}",
    }


def runs(ranks: int, ring_max: int, kinds: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(algorithm, platform kind) pairs at ``ranks``: every baseline on each network of
    ``kinds`` (default: fat tree, torus, dragonfly, DLN) but the DLNs, SHD on all."""
    kinds = kinds or tuple(DEFAULT_KINDS.split(","))
    pairs = [(a, k) for k in kinds if k not in DLNS for a in BASELINES]
    pairs += [("shd", k) for k in kinds]
    return [(a, k) for a, k in pairs if a not in O_N2 or ranks <= ring_max]


def _lines(path: Path) -> list[dict[str, object]]:
    """The Result fields of each JSON line of ``path`` (derived and annotation keys such as
    busbw_Bps and model_s_before dropped)."""
    fields = {f.name for f in dataclasses.fields(Result)}
    return [
        {k: v for k, v in json.loads(line).items() if k in fields}
        for line in path.read_text().splitlines()
    ]


def load(path: Path) -> list[Result]:
    return [Result(**raw) for raw in _lines(path)] if path.exists() else []  # type: ignore[arg-type]


def merged(paths: list[Path]) -> list[Result]:
    """The runs of JSON-lines ``paths``; a line of a later file about the same run (algorithm,
    platform, ranks, density, replay; and size where it gives one) updates that run's fields:
    simulate_sparse_nodelink.jsonl's lines carry the newer model's ``model_s`` alone."""
    runs: dict[tuple[object, ...], dict[str, object]] = {}
    for path in paths:
        for raw in _lines(path):
            key = tuple(raw.get(k) for k in ("algorithm", "platform", "ranks", "density"))
            key += (raw.get("pairwise", False),)
            same = [k for k, run in runs.items() if k == key + (run["size_bytes"],)]
            at = same[0] if "size_bytes" not in raw and same else key + (raw.get("size_bytes"),)
            runs[at] = {**runs.get(at, {}), **raw}
    return [Result(**raw) for raw in runs.values()]  # type: ignore[arg-type]


def kind(r: Result) -> str:
    """The network of a result as ``specs`` names it (``fat-tree-os2``: oversub=2)."""
    name, _, fields = r.platform.partition(":")
    oversub = dict(f.partition("=")[::2] for f in fields.split(",")).get("oversub", "1")
    return f"{name}-os{oversub}" if name == "fat-tree" and oversub != "1" else name


def claim_table(results: list[Result]) -> str:
    """Per (ranks, size): SHD on DLN, the best baseline, and SHD-on-DLN over each baseline."""
    lines = [
        "| ranks | size | SHD on DLN ms | baseline | baseline ms | SHD-DLN / baseline "
        "| reduction |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]
    keys = sorted({(r.ranks, r.size_bytes) for r in results})
    for ranks, size in keys:
        here = [r for r in results if (r.ranks, r.size_bytes) == (ranks, size)]
        dln = [r for r in here if r.algorithm == "shd" and kind(r) == "dln"]
        if not dln:
            continue
        t = dln[0].simulated_s
        for r in sorted(here, key=lambda r: r.simulated_s):
            if kind(r) == "dln":
                continue
            lines.append(
                f"| {ranks} | {report._size(size)} | {t * 1e3:,.3f} | {r.algorithm} on {kind(r)} "
                f"| {r.simulated_s * 1e3:,.3f} | {t / r.simulated_s:.3f} "
                f"| {100 * (1 - t / r.simulated_s):+.0f}% |"
            )
    return "\n".join(lines) + "\n"


def _cell(rows: list[Result], t: float, named: bool = False) -> str:
    """The fastest of ``rows``: its time and SHD-on-DLN's reduction ``1 - t / time``."""
    if not rows:
        return "-"
    r = min(rows, key=lambda r: r.simulated_s)
    name = f"{r.algorithm} " if named else ""
    return f"{name}{r.simulated_s * 1e3:,.3f} ({100 * (1 - t / r.simulated_s):+.0f}%)"


def summary_table(results: list[Result]) -> str:
    """One row per (ranks, size): SHD on DLN, then each baseline on the fat tree and the best
    on the torus and on the dragonfly, with the reduction SHD-on-DLN gives over it."""
    lines = [
        "| ranks | size | SHD on DLN ms | ring FT | HD FT | hier. FT | SHD FT | best on torus "
        "| best on dragonfly |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks, size in sorted({(r.ranks, r.size_bytes) for r in results}):
        here = [r for r in results if (r.ranks, r.size_bytes) == (ranks, size)]
        dln = [r for r in here if r.algorithm == "shd" and kind(r) == "dln"]
        if not dln:
            continue
        t = dln[0].simulated_s
        ft = [r for r in here if kind(r) == "fat-tree"]
        cells = [
            _cell([r for r in ft if r.algorithm == a], t)
            for a in ("ring", "rabenseifner", "hierarchical", "shd")
        ]
        cells += [_cell([r for r in here if kind(r) == k], t, True) for k in ("torus", "dragonfly")]
        row = f"| {ranks} | {report._size(size)} | {t * 1e3:,.3f} | " + " | ".join(cells)
        lines.append(row + " |")
    return "\n".join(lines) + "\n"


def _cells(times: list[float | None], rows: list[Result], named: bool = False) -> str:
    """The fastest of ``rows``: its time and the reduction ``1 - t / time`` each of ``times``
    gives over it."""
    if not rows:
        return "-"
    r = min(rows, key=lambda r: r.simulated_s)
    ours = " / ".join("-" if t is None else f"{100 * (1 - t / r.simulated_s):+.0f}%" for t in times)
    name = f"{r.algorithm} " if named else ""
    return f"{name}{r.simulated_s * 1e3:,.3f} ({ours})"


def oversub_table(results: list[Result]) -> str:
    """Per (ranks, size) with a 2D DLN or oversubscribed fat tree run: SHD on the DLN and on the
    2D DLN, each baseline on the 2:1 fat tree, the best on the 4:1 one; in each cell the
    reductions SHD on DLN / SHD on 2D DLN give over it."""
    lines = [
        "| ranks | size | SHD on DLN ms | SHD on 2D DLN ms | ring FT 2:1 | HD FT 2:1 "
        "| hier. FT 2:1 | SHD FT 2:1 | best on FT 4:1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    extra = ("dln2d", "fat-tree-os2", "fat-tree-os4")
    for ranks, size in sorted({(r.ranks, r.size_bytes) for r in results if kind(r) in extra}):
        here = [r for r in results if (r.ranks, r.size_bytes) == (ranks, size)]
        dln = {k: [r for r in here if r.algorithm == "shd" and kind(r) == k] for k in DLNS}
        times = [d[0].simulated_s if d else None for d in dln.values()]

        os2 = [r for r in here if kind(r) == "fat-tree-os2"]
        cells = ["-" if t is None else f"{t * 1e3:,.3f}" for t in times]
        cells += [_cells(times, [r for r in os2 if r.algorithm == a]) for a in (*BASELINES, "shd")]
        cells.append(_cells(times, [r for r in here if kind(r) == "fat-tree-os4"], True))
        lines.append(f"| {ranks} | {report._size(size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


DENSE_COLOURS = {"hierarchical": "C5", "rabenseifner": "C6", "shd": "C7"}  # same in every panel
SPARSE = ("topo_sparse", "dsar", "ssar_split_allgather", "allgather")


def _as_posted_first(results: list[Result]) -> list[Result]:
    """Each sparse run once: every stream posted at once where that was simulated, else its
    pairwise rounds (``--max-streams``)."""
    posted = {(r.algorithm, r.ranks, r.density) for r in results if not r.pairwise}
    return [r for r in results if not r.pairwise or (r.algorithm, r.ranks, r.density) not in posted]


def sparse_table(results: list[Result]) -> str:
    """Per (ranks, density): each sparse algorithm's simulated time (model/sim beside it;
    ``p``: replayed in pairwise rounds, ``--max-streams``), topo_sparse's reduction against the
    best other sparse one and against the best dense."""
    head = " | ".join(f"{n} ms (model/sim)" for n in SPARSE)
    lines = [
        f"| ranks | density | {head} | topo_sparse vs best other sparse | best dense ms "
        "| topo_sparse vs best dense |",
        "|---:|---:|" + "---:|" * len(SPARSE) + "---:|---|---:|",
    ]
    for ranks in sorted({r.ranks for r in results}):
        here = [r for r in results if r.ranks == ranks]
        dense = min((r for r in here if r.density is None), key=lambda r: r.simulated_s)
        for density in sorted({r.density for r in here if r.density is not None}):
            by = {r.algorithm: r for r in _as_posted_first(here) if r.density == density}
            cells = [
                f"{by[n].simulated_s * 1e3:,.3f}{' p' if by[n].pairwise else ''} "
                f"({(by[n].model_s or 0) / by[n].simulated_s:.2f})"
                if n in by
                else "-"
                for n in SPARSE
            ]
            topo = by["topo_sparse"].simulated_s if "topo_sparse" in by else None
            others = [by[n].simulated_s for n in SPARSE[1:] if n in by]
            vs = f"{100 * (1 - topo / min(others)):+.0f}%" if topo and others else "-"
            vs_dense = f"{100 * (1 - topo / dense.simulated_s):+.0f}%" if topo else "-"
            lines.append(
                f"| {ranks} | {density:.3g} | {' | '.join(cells)} | {vs} | {dense.algorithm} "
                f"{dense.simulated_s * 1e3:,.3f} | {vs_dense} |"
            )
    return "\n".join(lines) + "\n"


def sparse_plot(results: list[Result], path: Path) -> None:
    """Simulated time against density, one panel per rank count; dense times as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r.ranks for r in results})
    fig, axes = plt.subplots(1, len(counts), figsize=(4.6 * len(counts), 4.4), squeeze=False)
    for ax, ranks in zip(axes[0], counts):
        here = _as_posted_first([r for r in results if r.ranks == ranks])
        for i, name in enumerate(SPARSE):
            rows = sorted(
                (r for r in here if r.algorithm == name and r.density), key=lambda r: r.density or 0
            )
            if rows:
                label = name + (" (pairwise rounds)" if any(r.pairwise for r in rows) else "")
                ax.plot([100 * (r.density or 0) for r in rows], [r.simulated_s * 1e3 for r in rows],
                        marker="o", color=f"C{i}", label=label)  # fmt: skip
        for r in sorted((r for r in here if r.density is None), key=lambda r: r.algorithm):
            colour = DENSE_COLOURS.get(r.algorithm, "k")
            ax.axhline(
                r.simulated_s * 1e3, color=colour, linestyle="--", label=f"dense {r.algorithm}"
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (% of the gradient per rank)")
        ax.set_ylabel("simulated allreduce time (ms)")
        ax.set_title(f"{ranks} ranks, 64 MiB, fat tree, 4 GPUs/node")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256")
    parser.add_argument("--size", default="1MiB,32MiB,256MiB")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/simulate_claim")
    parser.add_argument("--ring-max-ranks", type=int, default=256)
    parser.add_argument("--replot", action="store_true", help="only redraw from OUT.jsonl")
    parser.add_argument("--only", help="comma list of ALGORITHM@KIND to run (e.g. ring@fat-tree)")
    parser.add_argument(
        "--platforms",
        default=DEFAULT_KINDS,
        help=f"comma list of networks to run, of {', '.join(KINDS)} (default {DEFAULT_KINDS})",
    )
    parser.add_argument(
        "--sparse-report",
        type=Path,
        nargs="+",
        help="write the sparse table (.md) and plot (.png) of these JSON-lines files (beside "
        "the first) and stop; a run in a later file replaces the same run in an earlier one "
        "(the same simulation costed by a newer model)",
    )
    args = parser.parse_args()
    if args.sparse_report:
        runs = merged(args.sparse_report)
        rows = [r for r in runs if any(o.ranks == r.ranks and o.density is None for o in runs)]
        first = args.sparse_report[0]
        names = " ".join(str(path) for path in args.sparse_report)
        made = f"`python benchmarks/simulate.py --sparse-report {names}`"
        first.with_suffix(".md").write_text(
            f"Rendered by {made} from every run in "
            + ", ".join(f"`{path.name}`" for path in args.sparse_report)
            + " (the commands: simulate.md, 7)\n\n"
            + sparse_table(rows)
            + "\n## Every run\n\n"
            + report.markdown(rows)
        )
        sparse_plot(rows, first.with_suffix(".png"))
        return 0
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    sizes = [int(s[:-3]) * units[s[-3:]] for s in args.size.split(",")]
    kinds = tuple(k for k in args.platforms.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--platforms: unknown {', '.join(unknown)}; networks: {', '.join(KINDS)}")
    jsonl = args.out.with_suffix(".jsonl")
    results = load(jsonl)
    done = {(r.algorithm, r.platform, r.ranks, r.size_bytes) for r in results}
    if not args.replot:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for size in sizes:
                for algorithm, k in runs(ranks, args.ring_max_ranks, kinds):
                    spec = specs(ranks)[k]
                    if (algorithm, spec, ranks, size) in done or (
                        args.only and f"{algorithm}@{k}" not in args.only.split(",")
                    ):
                        continue
                    start = time.monotonic()
                    r = simulate(algorithm, platforms.generate(spec), size)
                    results.append(r)
                    with jsonl.open("a") as f:
                        f.write(report.json_line(r) + "\n")
                    print(report.markdown_row(r), f"({time.monotonic() - start:.0f} s)", flush=True)
    body = report.markdown(sorted(results, key=lambda r: (r.ranks, r.size_bytes, r.algorithm)))
    command = "python benchmarks/simulate.py " + " ".join(sys.argv[1:])
    made = "Rendered from the JSON lines by" if args.replot else "Made by (the last run)"
    args.out.with_suffix(".md").write_text(
        f"{made}: `{command}`; every run: `{jsonl.name}` (the commands: simulate.md, 4)\n\n"
        "## Summary: SHD on DLN and the reduction it gives over each (negative: slower)\n\n"
        + summary_table(results)
        + "\n## Oversubscribed fat tree and 2D DLN (reductions: SHD on DLN / SHD on 2D DLN)\n\n"
        + oversub_table(results)
        + "\n## SHD on DLN against each baseline\n\n"
        + claim_table(results)
        + "\n## Every run\n\n"
        + body
    )
    first = [r for r in results if kind(r) in DEFAULT_KINDS.split(",")]
    report.plot(first, args.out.with_suffix(".png"), "SHD on DLN vs baselines (4 GPUs/node)", kind)
    # ring and hierarchical on the oversubscribed trees lie on their full-tree lines (within
    # 0.3%): drawn on the full tree only, so that the lines that differ can be told apart
    second = [
        r
        for r in results
        if kind(r) == "fat-tree"
        or (kind(r) in ("fat-tree-os2", "fat-tree-os4", *DLNS) and r.algorithm not in O_N2)
    ]
    if any(kind(r) not in DEFAULT_KINDS.split(",") for r in second):
        report.plot(
            second,
            args.out.with_name(args.out.name + "_oversub.png"),
            "SHD on DLN / 2D DLN vs full and oversubscribed fat trees (4 GPUs/node)",
            kind,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
