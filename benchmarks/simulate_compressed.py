"""One bucket compressed flat against once per host (issue 51), simulated at 64-1024 ranks on
the seed platforms: the most bytes a node sends to the others and the time, for top-k,
PowerSGD and QSGD.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/simulate_compressed.py --ranks 64,256,1024 \\
        --size 64MiB [--out benchmarks/results/simulate_compressed] [--replot]

1. The platforms are simulate.py's (``specs``): 4 GPUs per node on NVLink-like 50 GB/s inside
   a node, 12.5 GB/s and 0.5 us per network link, ``fat-tree``, ``torus`` and ``dln`` between
   the nodes.
2. Each (compressor, hierarchy, platform, ranks, size) is one ``commlayer simulate
   --compression`` run (commlayer/sim/compressed.py): flat, every rank's payload among all
   ranks (summable ones allreduced with the schedule the cost model picks, the others
   allgathered); per host, the bucket's sum inside each node, the payload among one leader a
   node, the share inside the node. Local work is free: the network alone. Results are
   appended to ``OUT.jsonl`` as they finish (a rerun skips what is there); ``OUT.md`` gets the
   table and a summary of per host against flat, ``OUT.png`` time and cross-node bytes against
   ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from simulate import specs  # noqa: E402

from commlayer.sim import platforms, report  # noqa: E402
from commlayer.sim.compressed import simulate_compressed  # noqa: E402
from commlayer.sim.simulate import Result  # noqa: E402

COMPRESSORS = ("topk:ratio=0.01", "powersgd:rank=4", "qsgd:levels=7")
KINDS = ("fat-tree", "torus", "dln")


def _key(r: Result) -> tuple[object, ...]:
    return (r.compression, bool(r.per_host), r.platform, r.ranks, r.size_bytes)


def load(path: Path) -> list[Result]:
    if not path.exists():
        return []
    fields = {f.name for f in dataclasses.fields(Result)}
    return [
        Result(**{k: v for k, v in json.loads(line).items() if k in fields})
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def summary(results: list[Result]) -> list[str]:
    """Per platform, ranks, size and compressor: per host against flat, time and bytes."""
    by = {_key(r): r for r in results}
    lines = [
        "| platform | ranks | size | compressor | flat ms | per host ms | per host / flat | "
        "flat MB out of a node | per host MB | per host / flat |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = sorted(
        by.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][2]).split(":")[0], *kv[0][3:])
    )
    for (spec, per_host, platform, ranks, size), flat in order:
        host = by.get((spec, True, platform, ranks, size))
        if per_host or host is None:
            continue
        fb, hb = flat.cross_bytes or 0, host.cross_bytes or 0
        lines.append(
            f"| {platform.split(':')[0]} | {ranks} | {size >> 20} MiB | {spec} | "
            f"{flat.simulated_s * 1e3:,.3f} | {host.simulated_s * 1e3:,.3f} | "
            f"{host.simulated_s / flat.simulated_s:.3f} | {fb / 1e6:,.1f} | {hb / 1e6:,.1f} | "
            f"{hb / max(fb, 1):.3f} |"
        )
    return lines


def render(results: list[Result], out: Path, command: str) -> None:
    out.with_suffix(".md").write_text(
        "\n".join(
            [
                "# One bucket compressed, flat against once per host (issue 51)",
                "",
                f"Made by: `{command}` (SimGrid SMPI; benchmarks/simulate_compressed.py's "
                "docstring). Network only: summing, compressing and decoding cost nothing here. "
                "MB: the most a node sends to the other nodes for the bucket.",
                "",
                "## Per host against flat",
                "",
                *summary(results),
                "",
                "## Every run",
                "",
                report.markdown(results),
            ]
        )  # fmt: skip
    )
    report.plot(
        results,
        out.with_suffix(".png"),
        "one bucket compressed: flat (dashed) against once per host (solid), 4 GPUs a node",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024")
    parser.add_argument("--size", default="64MiB")
    parser.add_argument("--platforms", default=",".join(KINDS))
    parser.add_argument("--compression", action="append", help="default: " + ", ".join(COMPRESSORS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/simulate_compressed")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--replot", action="store_true", help="render OUT.md and OUT.png again")
    args = parser.parse_args()
    # the run's command (a --replot renders what such a run wrote)
    given = [a for a in sys.argv[1:] if a != "--replot"]
    command = "OMP_NUM_THREADS=1 nice -n 10 python benchmarks/simulate_compressed.py " + " ".join(
        given
    )
    lines = args.out.with_suffix(".jsonl")
    results = load(lines)
    if not args.replot:
        done = {_key(r) for r in results}
        sizes = [int(s[:-3]) << 20 for s in args.size.split(",")]  # NMiB
        for ranks in map(int, args.ranks.split(",")):
            for kind in args.platforms.split(","):
                platform = platforms.generate(specs(ranks)[kind], None, None)
                for size in sizes:
                    for spec in args.compression or COMPRESSORS:
                        for per_host in (False, True):
                            key = (spec, per_host, platform.name, ranks, size)
                            if key in done:
                                continue
                            start = time.monotonic()
                            result = simulate_compressed(
                                spec, platform, size, per_host, timeout_s=args.timeout_s
                            )
                            results.append(result)
                            with lines.open("a") as f:
                                f.write(report.json_line(result) + "\n")
                            print(
                                f"{kind} {ranks} {spec} {'host' if per_host else 'flat'}: "
                                f"{result.simulated_s * 1e3:.3f} ms, "
                                f"{(result.cross_bytes or 0) / 1e6:.1f} MB "
                                f"({time.monotonic() - start:.0f} s)",
                                flush=True,
                            )
    render(results, args.out, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
