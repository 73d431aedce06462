"""Allreduce across hosts of the namespace cluster (scripts/cluster.sh): every algorithm, auto and
raw MPI, against the link rate (issue 21).

    sudo python benchmarks/network.py --rate 1gbit --layout 2x2 [--max-bytes 64M] [--out DIR]

1. Brings the cluster up with ``--rate`` (``cluster.sh up H --rate R``; H hosts from the layout
   ``HxR``: H hosts, R ranks each), runs benchmarks/algorithms.py on it through ``commlayerrun
   -H node1:R,...`` (the same measurements as on one machine: every algorithm on a communicator
   of its own, ``auto`` tuned, raw MPI's own allreduce as ``mpi``), and brings the cluster down,
   whatever happened.
2. The physical limit is the host's link: an allreduce of S bytes across H hosts must move
   S (H - 1) / H bytes in and out of each host at the least (reduce-scatter plus allgather
   between hosts; ranks of one host combine in shared memory first), so no algorithm beats
   ``S * 2 (H - 1) / H / rate``. "link" below is that bound over the measured time: 100% is the
   link's rate, and a flat algorithm that sends every rank's share across the link separately
   cannot reach it with more than one rank per host.
3. Writes ``network_<rate>_<layout>.md`` (the table, the link efficiency of the best algorithm
   and of auto per size; "auto vs best" compares auto's own measurement with the fastest
   column, taken seconds to minutes apart on a machine whose speed drifts, "in turn" compares
   auto with the row's two fastest algorithms measured alternately, at the same moment),
   ``.json`` (every measurement, machine-readable for the oracle and auto-tuning) and
   ``.png`` (link efficiency against size, one line per algorithm; needs matplotlib:
   ``pip install '.[bench]'``) under ``--out`` (default benchmarks/results), plus
   algorithms.py's own table. ``--replot JSON`` draws the picture again without measuring.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.sh"
_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"rate {text!r}: expected e.g. 100mbit, 1gbit, 10gbit")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def layout(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match or int(match.group(1)) < 2 or int(match.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected HOSTSxRANKS, e.g. 2x2, 4x1")
    return int(match.group(1)), int(match.group(2))


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def cluster(*args: str) -> None:
    subprocess.run(["bash", str(CLUSTER), *args], check=True)


def require_no_cluster() -> None:
    """Exit, naming them, where another job's cluster is up: this benchmark's ``up`` would
    resize it and its ``down`` remove it under that job (it happened once)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    taken = sorted(n for n in names if n == "cl-switch" or re.fullmatch(r"node\d+", n))
    if taken:
        sys.exit(
            f"{Path(sys.argv[0]).name}: a cluster is already up (namespaces {taken}); "
            "wait for its job, or 'bash scripts/cluster.sh down' if it is yours"
        )


def plot(result: dict, path: Path) -> None:
    """Link efficiency (% of the link bound) against size, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = result["hosts"]
    factor = 2 * (hosts - 1) / hosts
    rows = result["algorithms"]["sizes"]
    sizes = [row["bytes"] for row in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in rows[0]["seconds"]:
        link = [r["bytes"] * factor * 8 / result["rate_bits"] / r["seconds"][name] for r in rows]
        style = {"linewidth": 2.5, "color": "black"} if name == "auto" else {"linewidth": 1.2}
        ax.plot(sizes, [100 * v for v in link], marker="o", markersize=3, label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [human(n) for n in sizes], rotation=30)
    ax.set_ylim(0, 105)
    ax.axhline(90, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("allreduce size (float32)")
    ax.set_ylabel("% of the host link's bound")
    ax.set_title(
        f"allreduce across {hosts} hosts x {result['ranks_per_host']} ranks, "
        f"{result['rate_bits'] / 1e9:g} Gbit/s links (namespace cluster, 2-core VM)"
    )
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="link rate, e.g. 1gbit, 10gbit")
    parser.add_argument("--layout", type=layout, default=(2, 2), help="HOSTSxRANKS, e.g. 2x2")
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--reps", default="3")
    parser.add_argument("--size-factor", default="4", help="from one size to the next")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--suffix", help="appended to the result files' names (a repeat run)")
    parser.add_argument("--replot", type=Path, help="draw the .png again from this .json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    link_bps = rate_bits(args.rate)
    hosts, per_host = args.layout
    tag = f"network_{args.rate}_{hosts}x{per_host}" + (f"_{args.suffix}" if args.suffix else "")
    args.out.mkdir(parents=True, exist_ok=True)
    raw_json = args.out / f"{tag}.algorithms.json"
    command = [
        str(Path(sysconfig.get_path("scripts")) / "commlayerrun"),
        "-np", str(hosts * per_host),
        "-H", ",".join(f"node{k}:{per_host}" for k in range(1, hosts + 1)),
        sys.executable, str(ROOT / "benchmarks" / "algorithms.py"),
        "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--reps", args.reps,
        "--size-factor", args.size_factor,
        "--pairs", "0", "--out", str(args.out / f"{tag}.algorithms.md"), "--json", str(raw_json),
    ]  # fmt: skip
    require_no_cluster()
    load_before = os.getloadavg()[0]
    try:
        cluster("up", str(hosts), "--rate", args.rate)
        subprocess.run(command, check=True, cwd=ROOT)
    finally:
        cluster("down")
    load_after = os.getloadavg()[0]
    record = json.loads(raw_json.read_text())
    factor = 2 * (hosts - 1) / hosts
    names = [n for n in record["sizes"][0]["seconds"] if n != "auto"]
    lines = [
        f"# allreduce across {hosts} hosts x {per_host} ranks, links at {args.rate}",
        "",
        f"{datetime.date.today()}, {record['mpi']}, hosts {sorted(set(record['hosts']))}, "
        f"`sudo python benchmarks/network.py --rate {args.rate} --layout {hosts}x{per_host} "
        f"--min-bytes {args.min_bytes} --max-bytes {args.max_bytes} --reps {args.reps} "
        f"--size-factor {args.size_factor}"
        + (f" --suffix {args.suffix}" if args.suffix else "")
        + "` (scripts/cluster.sh: veth + tbf; UCX_TLS=tcp,self). "
        "link = the host link's lower bound (S x 2(H-1)/H / rate) over the measured time; "
        "100% is the link's rate. 2-core VM: every rank and the links' traffic share 2 cores; "
        f"load average (1 min) {load_before:.1f} before the run, {load_after:.1f} after.",
        "",
        "| bytes | " + " | ".join(f"{n} ms (link)" for n in names) + " | auto ms (link) "
        "| best | auto vs best | auto vs best two, in turn |",
        "| ---: | " + " | ".join("---:" for _ in names) + " | ---: | --- | ---: | ---: |",
    ]
    summary = []
    for row in record["sizes"]:
        nbytes, seconds = row["bytes"], row["seconds"]
        bound = nbytes * factor * 8 / link_bps
        best = min(names, key=lambda n: seconds[n])
        cells = [f"{seconds[n] * 1e3:,.2f} ({bound / seconds[n]:.0%})" for n in names]
        auto = seconds["auto"]
        in_turn = row.get("auto_in_turn")  # absent from runs before 2026-11-26
        lines.append(
            f"| {human(nbytes)} | " + " | ".join(cells)
            + f" | {auto * 1e3:,.2f} ({bound / auto:.0%}) | {best} | {seconds[best] / auto:.2f}x"
            + (f" | {in_turn:.2f}x |" if in_turn is not None else " | - |")
        )  # fmt: skip
        summary.append(
            {"bytes": nbytes, "best": best, "best_link": bound / seconds[best],
             "auto_link": bound / auto, "auto_vs_best": seconds[best] / auto,
             "auto_in_turn": in_turn}
        )  # fmt: skip
    (args.out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    result = {
        "rate_bits": link_bps,
        "hosts": hosts,
        "ranks_per_host": per_host,
        "summary": summary,
        "algorithms": record,
    }
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{tag}.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
