"""``commlayer simulate``: the arguments, and the loop over algorithms, platforms, ranks, sizes."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from commlayer.sim import platforms, report, smpi
from commlayer.sim.platforms import Platform
from commlayer.sim.simulate import Result, simulate

DESCRIPTION = (
    "Replay allreduce schedules (the ones the executor runs) in SimGrid's SMPI and print, per "
    "algorithm, platform, ranks and size: the simulated time, bus bandwidth and the cost "
    "model's prediction.\n\nPlatforms (--platform, repeatable):\n"
    + "\n".join(
        line
        for line in (platforms.__doc__ or "").split("\n\n", 1)[1].splitlines()
        if not line.startswith("DLN. ")
    )
)


def _list(cast: Callable[[str], object]) -> Callable[[str], list[object]]:
    return lambda text: [cast(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser, size: Callable[[str], int]) -> None:
    parser.add_argument(
        "--algorithm",
        type=_list(str),
        default=["ring", "rabenseifner", "shd", "hierarchical", "auto"],
        help="comma list: schedule names, auto (the cost model's pick), smpi:NAME (SMPI's own "
        "MPI_Allreduce, e.g. smpi:lr ring, smpi:rdb, smpi:rab_rdb)",
    )
    parser.add_argument(
        "--platform",
        action="append",
        help="KIND:key=value,... (above) or a SimGrid XML file; repeat for several (default flat)",
    )
    parser.add_argument("--hostfile", type=Path, help="with an XML file: host[:count] per line")
    parser.add_argument(
        "--gpus-per-node", type=int, help="ranks per node (generated: default 1; file: per host)"
    )
    parser.add_argument(
        "--ranks", type=_list(int), help="comma list (default: every GPU of the platform)"
    )
    parser.add_argument(
        "--size", type=_list(size), default=[1 << 20, 32 << 20], help="comma list, e.g. 1MiB,32MiB"
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


def run(args: argparse.Namespace) -> int:
    try:
        smpi.tools()
    except smpi.SimGridMissing as exc:
        print(f"commlayer simulate: {exc}", file=sys.stderr)
        return 2
    gamma = 1 / (args.reduce_GBps * 1e9) if args.reduce_GBps > 0 else 0.0
    results: list[Result] = []
    if args.format == "table":
        print(report.HEADER, flush=True)
    for spec in args.platform or ["flat"]:
        for ranks in args.ranks or [None]:
            try:
                platform = _platform(spec, args, ranks)
            except (ValueError, OSError) as exc:
                print(f"commlayer simulate: {exc}", file=sys.stderr)
                return 2
            for nbytes in args.size:
                for algorithm in args.algorithm:
                    try:
                        result = simulate(
                            algorithm, platform, nbytes, args.factors, gamma, args.timeout_s
                        )
                    except ValueError as exc:
                        print(f"commlayer simulate: {exc}", file=sys.stderr)
                        return 2
                    results.append(result)
                    line = report.json_line(result) if args.format == "json" else None
                    print(line or report.markdown_row(result), flush=True)
    command = "commlayer " + " ".join(shlex.quote(a) for a in args.argv)
    if args.out:
        args.out.write_text(f"Made by: `{command}`\n\n" + report.markdown(results))
    if args.plot:
        report.plot(results, args.plot)
    return 0
