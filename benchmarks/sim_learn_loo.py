"""Leave-one-out check of the cost model corrected by simulation (commlayer/sim/learn.py).

    python benchmarks/sim_learn_loo.py benchmarks/results/simulate_claim.jsonl [more.jsonl ...]

Prints Markdown: (1) every row at the largest rank count of its family predicted from the
smaller rank counts only (all that family's rows at that count left out), by the model alone,
learned with the extrapolation in ranks (the default) and learned holding the nearest rank
count's ratio; (2) a middle rank count predicted from the ones around it; (3) each row left
out alone (the held-out size or rank count of one algorithm), summarized per platform family:
the median and largest |prediction / simulated - 1|. Nothing is simulated: the rows are the
table's, the model is today's.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Iterable

from commlayer.sim import learn


def _size(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


def _kind(row: learn.Row) -> str:
    return row.family.partition(":")[0]


def held_out(
    table: learn.Table, hold: learn.Table, rows: Iterable[learn.Row], left: set[int]
) -> list[str]:
    """One Markdown row per row of ``rows``: model/sim, learned/sim with and without the
    extrapolation, every point of its family at a rank count in ``left`` left out."""
    lines = []
    for r in sorted(rows, key=lambda r: (r.family, r.algorithm, r.ranks, r.size_bytes)):
        out = frozenset(
            (o.spec, o.ranks, o.size_bytes)
            for o in table.rows
            if o.family == r.family and o.ranks in left
        )
        model = table.model(r.algorithm, r.spec, r.ranks, r.gpus_per_node, r.size_bytes)
        got = [t.predict(r.algorithm, r.spec, r.ranks, r.gpus_per_node, r.size_bytes, out)
               for t in (table, hold)]  # fmt: skip
        if model is None or None in got:
            continue
        cells = [f"{model / r.simulated_s:.3f}"]
        cells += [f"{g.seconds / r.simulated_s:.3f} ({g.source})" for g in got if g is not None]
        lines.append(
            f"| {_kind(r)} | {r.algorithm} | {r.ranks} | {_size(r.size_bytes)} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def main(paths: list[str]) -> int:
    rows = learn.read(paths)
    table, hold = learn.Table(rows), learn.Table(rows, extrapolate=False)
    print(f"Rows: {len(table.rows)} from {', '.join(paths)}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")  # fmt: skip
    header = (
        "| kind | algorithm | ranks | size | model/sim | learned/sim (extrapolated) "
        "| learned/sim (held) |\n|---|---|---:|---:|---:|---:|---:|"
    )
    ranks: dict[str, list[int]] = {}
    for r in table.rows:
        ranks.setdefault(r.family, [])
        if r.ranks not in ranks[r.family]:
            ranks[r.family].append(r.ranks)
    for counts in ranks.values():
        counts.sort()
    for title, which in (
        ("### Largest rank count of each family, learned from the smaller ones\n", -1),
        ("\n### A middle rank count, learned from the ones around it\n", -2),
    ):
        print(title)
        print(header)
        for fam, counts in ranks.items():
            if len(counts) > 2:
                out = [r for r in table.rows if r.family == fam and r.ranks == counts[which]]
                print("\n".join(held_out(table, hold, out, {counts[which]})))
    print("\n### Each row left out alone: |prediction / simulated - 1|, median and largest\n")
    print("A size *inside* is between two sizes still simulated at its rank count (interpolated);")
    print("*end*: the smallest or largest there (held, or only other rank counts have it).\n")
    print("| kind | held-out size | rows | model: median | model: largest | learned: median "
          "| learned: largest |\n|---|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for kind in sorted({_kind(r) for r in table.rows}):
        errors: dict[str, tuple[list[float], list[float]]] = {"inside": ([], []), "end": ([], [])}
        for r in (r for r in table.rows if _kind(r) == kind):
            out = frozenset({(r.spec, r.ranks, r.size_bytes)})
            got = table.predict(r.algorithm, r.spec, r.ranks, r.gpus_per_node, r.size_bytes, out)
            if got is None or got.model_s is None:
                continue
            sizes = [o.size_bytes for o in table.rows if o.algorithm == r.algorithm
                     and o.family == r.family and o.ranks == r.ranks and o is not r]  # fmt: skip
            inside = bool(sizes) and min(sizes) < r.size_bytes < max(sizes)
            before, after = errors["inside" if inside else "end"]
            before.append(abs(got.model_s / r.simulated_s - 1))
            after.append(abs(got.seconds / r.simulated_s - 1))
        for where, (before, after) in errors.items():
            if before:
                cells = [statistics.median(before), max(before)]
                cells += [statistics.median(after), max(after)]
                print(f"| {kind} | {where} | {len(before)} | "
                      + " | ".join(f"{c:.1%}" for c in cells) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["benchmarks/results/simulate_claim.jsonl"]))
