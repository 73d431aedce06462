"""The records of a ``benchmarks/oracle.py --calibrate --out F.md`` run, predicted again by the
current model (post hoc: after a change to the model, the same measured steps against the old
and the new prediction).

    OMP_NUM_THREADS=1 python benchmarks/oracle_repredict.py benchmarks/results/F.md

Reads ``F.jsonl`` (the records) and ``F_np*.calibration.json`` (the calibrations the run made);
prints, per record, the measured step, the recorded prediction and the current one with their
accuracy, the current communication and hidden part, and the collectives measured in training;
then the average accuracy at 2-4 ranks of both.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracle as bench  # noqa: E402

from commlayer import costmodel  # noqa: E402


def main() -> int:
    stem = Path(sys.argv[1])
    paths = sorted(stem.parent.glob(stem.stem + "_np*.calibration.json"))
    cals = [c for p in paths for c in costmodel.load_all(p)]
    print("engine cost per call, ms:", [(c.size, round(c.op_latency_s * 1e3, 2)) for c in cals])
    accuracy: dict[str, list[float]] = {"recorded": [], "current": []}
    for line in stem.with_suffix(".jsonl").read_text().splitlines():
        r = json.loads(line)
        net = bench.profiled_net(r["model"], r["profile_ms"] / 1e3 / r.get("batch", 32))
        plat = bench.this_machine(r["ranks"], os.cpu_count())  # oracle.py's --cores default
        new = bench.predict_step_s(net, plat, r["ranks"], r.get("batch", 32), cals)
        real = r["measured_s"]
        old, now = r["cores"]["accuracy"], 1 - abs(new["step_s"] - real) / real
        print(
            f"{r['model']} {r['ranks']}: measured {real * 1e3:.1f} ms, recorded "
            f"{r['cores']['step_s'] * 1e3:.1f} ({old:.1%}), current {new['step_s'] * 1e3:.1f} "
            f"({now:.1%}); comm {new['comm_s'] * 1e3:.1f}, hidden {new['hidden_s'] * 1e3:.1f}, "
            f"collectives in training {r.get('collective_ms_per_step') or 0:.1f}"
        )
        if r["ranks"] > 1:
            accuracy["recorded"].append(old)
            accuracy["current"].append(now)
    print({k: f"{statistics.mean(v):.1%}" for k, v in accuracy.items() if v})
    return 0


if __name__ == "__main__":
    sys.exit(main())
