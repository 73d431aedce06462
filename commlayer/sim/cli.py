"""``commlayer simulate``: the arguments, and the loop over algorithms, platforms, ranks, sizes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path

from commlayer import algorithms
from commlayer.sim import compressed, learn, platforms, report, smpi
from commlayer.sim.platforms import Platform
from commlayer.sim.simulate import (
    Result,
    check,
    check_sparse,
    gpus_per_node,
    simulate,
    simulate_sparse,
)

DESCRIPTION = (
    "Replay allreduce schedules (the ones the executor runs) in SimGrid's SMPI and print, per "
    "algorithm, platform, ranks and size: the simulated time, bus bandwidth and the cost "
    "model's prediction.\n\nPlatforms (--platform, repeatable):\n"
    + (platforms.__doc__ or "").split("\n\n", 1)[1]
)
DENSE = ["ring", "rabenseifner", "shd", "hierarchical", "auto"]
MAX_STREAMS = 256  # transfers a step: 64- and 128-rank splits replay as posted, 256 ranks not


def _list(cast: Callable[[str], object], what: str) -> Callable[[str], list[object]]:
    """A comma list parser; argparse names ``what`` in its error ("invalid size value")."""

    def parse(text: str) -> list[object]:
        return [cast(part) for part in text.split(",") if part.strip()]

    parse.__name__ = what
    return parse


def _density(text: str) -> float:
    """A fraction (0.01) or a percentage (1%)."""
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 < value <= 1:
        raise ValueError(text)
    return value


def add_arguments(parser: argparse.ArgumentParser, size: Callable[[str], int]) -> None:
    parser.add_argument(
        "--algorithm",
        type=_list(str, "algorithm"),
        help="comma list: schedule names, auto (the cost model's pick), hierarchical:INTER "
        "(two levels, INTER across nodes), smpi:NAME (SMPI's own MPI_Allreduce, e.g. smpi:lr "
        f"ring, smpi:rdb, smpi:rab_rdb); default {','.join(DENSE)}, none with --sparse",
    )
    parser.add_argument(
        "--sparse",
        type=_list(str, "sparse algorithm"),
        default=[],
        help="comma list of sparse allreduce algorithms (topo_sparse, ssar_split_allgather, "
        "dsar, ssar_recursive_doubling, gtopk, allgather): each rank holds --density of the "
        "--size buffer at random indices; dense --algorithm rows run beside them if given",
    )
    parser.add_argument(
        "--density",
        type=_list(_density, "density"),
        default=[0.01],
        help="with --sparse: comma list of nnz/numel per rank, 0.01 or 1%% (default 0.01)",
    )
    parser.add_argument(
        "--compression",
        action="append",
        default=[],
        help="a compressor spec (repeatable: specs hold commas), e.g. topk:ratio=0.01, "
        "powersgd:rank=4, qsgd:levels=7: one bucket of --size reduced under it, flat and once "
        "per host (--hierarchy), in place of --algorithm and --sparse; the table adds the most "
        "MB a node sends to the others (sim/compressed.py)",
    )
    parser.add_argument(
        "--hierarchy",
        type=_list(str, "hierarchy"),
        default=list(compressed.HIERARCHIES),
        help="with --compression: comma list of flat, host (default both; host only where "
        "nodes hold several ranks)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=MAX_STREAMS,
        help="with --sparse: a step posting more transfers than this (DSAR's and SSAR's split: "
        "2 (p - 1) a rank) is replayed in pairwise-exchange rounds (to r + d, from r - d), "
        "marked 'pairwise' in the output; SimGrid takes hours on p (p - 1) concurrent flows "
        f"from 256 ranks. 0: every step as posted (default {MAX_STREAMS})",
    )
    parser.add_argument(
        "--platform",
        action="append",
        help="KIND:key=value,... (above) or a SimGrid XML file; repeat for several "
        "(default flat, sized by --ranks)",
    )
    parser.add_argument("--hostfile", type=Path, help="with an XML file: host[:count] per line")
    parser.add_argument(
        "--gpus-per-node", type=int, help="ranks per node (generated: default 1; file: per host)"
    )
    parser.add_argument(
        "--ranks", type=_list(int, "ranks"), help="comma list (default: every GPU of the platform)"
    )
    parser.add_argument(
        "--size",
        type=_list(size, "size"),
        default=[1 << 20, 32 << 20],
        help="comma list, e.g. 1MiB,32MiB",
    )
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--plot", type=Path, help="draw simulated time against ranks (PNG)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument(
        "--factors",
        action="store_true",
        help="keep SMPI's latency and bandwidth factors (default: off, pure alpha-beta)",
    )
    parser.add_argument(
        "--reduce-GBps",
        type=float,
        default=0.0,
        help="cost each step's reduction at this rate (default: free)",
    )
    parser.add_argument("--timeout-s", type=float, help="per smpirun")


def _platform(spec: str, args: argparse.Namespace, ranks: int | None) -> Platform:
    if spec.endswith(".xml"):
        return platforms.from_file(Path(spec), args.hostfile, ranks, args.gpus_per_node or 1)
    return platforms.generate(spec, ranks, args.gpus_per_node)


def _checked(args: argparse.Namespace) -> list[Platform]:
    """Every input checked before the first simulation (ValueError or OSError naming it):
    names, sizes, counts, the plot's matplotlib, and every platform built once."""
    if args.compression and (args.algorithm or args.sparse):
        raise ValueError("--compression replays compressed reductions alone: drop --algorithm "
                         "and --sparse, or run them separately")  # fmt: skip
    for spec in args.compression:
        compressed.check(spec)
    for level in args.hierarchy:
        if level not in compressed.HIERARCHIES:
            raise ValueError(f"--hierarchy {level!r}: allowed {', '.join(compressed.HIERARCHIES)}")
    if args.algorithm is None:
        args.algorithm = [] if args.sparse or args.compression else DENSE
    for name in args.algorithm:
        check(name)
    for name in args.sparse:
        for density in args.density:
            check_sparse(name, density)
    if not args.algorithm and not args.sparse and not args.compression:
        raise ValueError("nothing to simulate: give --algorithm, --sparse or --compression")
    if args.max_streams < 0:
        raise ValueError(f"--max-streams {args.max_streams}: must be 0 (never cut) or more")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node}: must be at least 1")
    for nbytes in args.size:
        if nbytes < 4:
            raise ValueError(f"--size {nbytes}: must be at least one float32 (4 bytes)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'commlayer[bench]'")
    return [_platform(s, args, r) for s in args.platform or ["flat"] for r in args.ranks or [None]]


def _results(args: argparse.Namespace, machines: list[Platform]) -> Iterator[Result]:
    gamma = 1 / (args.reduce_GBps * 1e9) if args.reduce_GBps > 0 else 0.0
    for platform in machines:
        for nbytes in args.size:
            for algorithm in args.algorithm:
                yield simulate(algorithm, platform, nbytes, args.factors, gamma, args.timeout_s)
            for density in args.density if args.sparse else []:
                for name in args.sparse:
                    yield simulate_sparse(
                        name, platform, nbytes, density, args.factors, args.timeout_s,
                        args.max_streams or None,
                    )  # fmt: skip
            several = gpus_per_node(platform) != 1  # else per host is the flat reduction
            for spec in args.compression:
                for level in args.hierarchy:
                    if level == "flat" or several:
                        yield compressed.simulate_compressed(
                            spec, platform, nbytes, level == "host", args.factors,
                            args.timeout_s,
                        )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        machines = _checked(args)  # a bad argument is named whether or not SimGrid is here
        smpi.tools()
    except (smpi.SimGridMissing, ValueError, OSError) as exc:
        print(f"commlayer simulate: {exc}", file=sys.stderr)
        return 2
    results: list[Result] = []
    row = report.compressed_row if args.compression else report.markdown_row
    if args.format == "table":
        print(report.COMPRESSED_HEADER if args.compression else report.HEADER, flush=True)
    try:
        for result in _results(args, machines):
            results.append(result)
            line = report.json_line(result) if args.format == "json" else None
            print(line or row(result), flush=True)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"commlayer simulate: {exc}", file=sys.stderr)
        return 2
    command = "commlayer " + " ".join(shlex.quote(a) for a in args.argv)
    if args.out:
        args.out.write_text(f"Made by: `{command}`\n\n" + report.markdown(results))
    if args.plot:
        report.plot(results, args.plot)
    return 0


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    """``commlayer algorithms``'s options for a platform instead of a local calibration."""
    parser.add_argument(
        "--platform",
        help="predict for this platform (a `commlayer simulate` spec or XML file) from its links "
        "instead of a local calibration; needs --ranks unless the spec sizes it",
    )
    parser.add_argument("--gpus-per-node", type=int, help="with --platform: ranks per node")
    parser.add_argument("--hostfile", type=Path, help="with an XML --platform: host[:count] lines")
    parser.add_argument(
        "--sim-table",
        action="append",
        type=Path,
        default=[],
        help="with --platform: JSON lines of `commlayer simulate --format json` (repeatable): "
        "its simulated points, and elsewhere the model corrected by what they measured",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table")


def predict(args: argparse.Namespace) -> int:
    """``commlayer algorithms --platform``: every schedule's predicted time on the platform,
    corrected by ``--sim-table`` (sim/learn.py); each cell says where its time came from."""
    try:
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node {args.gpus_per_node}: must be at least 1")
        single = Namespace(hostfile=args.hostfile, gpus_per_node=args.gpus_per_node)
        platform = _platform(args.platform, single, args.ranks)
        table = learn.Table(learn.read(args.sim_table))
    except (ValueError, OSError) as exc:
        print(f"commlayer algorithms: {exc}", file=sys.stderr)
        return 2
    gpus = gpus_per_node(platform) or 1
    spec = learn.canonical(platform.name, gpus)
    if args.format == "table":
        print(_predict_header(platform, gpus, table, args.sim_table))
    for nbytes in args.size:
        cells = []
        for name in algorithms.schedules():
            found = table.predict(name, spec, platform.ranks, gpus, nbytes)
            if found is not None:
                cells.append((name, found))
        cells.sort(key=lambda c: (c[1].seconds, c[0]))
        if args.format == "json":
            for name, p in cells:
                print(json.dumps({
                    "algorithm": name, "platform": platform.name, "ranks": platform.ranks,
                    "gpus_per_node": gpus, "size_bytes": nbytes, "predicted_s": p.seconds,
                    "source": p.source, "model_s": p.model_s, "ratio": p.ratio,
                }, sort_keys=True))  # fmt: skip
        elif cells:
            best = cells[0][1].seconds
            print(f"{nbytes:>14,} B: " + ", ".join(
                f"{name} {p.seconds * 1e6:,.0f} us ({p.seconds / best:.2f}x, {p.source}"
                + (f" x{p.ratio:.2f})" if p.ratio is not None else ")")
                for name, p in cells
            ))  # fmt: skip
        else:
            print(f"{nbytes:>14,} B: no prediction (a file platform: only simulated points)")
    return 0


def _predict_header(platform: Platform, gpus: int, table: learn.Table, files: list[Path]) -> str:
    nodes = platform.topology().nodes
    text = (
        f"# predicted allreduce time on {platform.name}, {platform.ranks} ranks ({nodes} nodes x "
        f"{gpus}): the cost model on the platform's links, each node's link shared by its ranks"
    )
    if not files:
        return text + " (model: no --sim-table; the network's own contention is not counted)"
    return text + (
        f"; with {len(table.rows)} simulated rows of {', '.join(map(str, files))}: "
        "simulated = the table's own point, learned xR = model x R, the simulated/model ratio "
        "learned for the algorithm on this platform family, model = no row of it"
    )
