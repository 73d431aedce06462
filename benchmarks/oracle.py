"""The oracle against measured runs on this machine: data parallelism of train.py's models.

    OMP_NUM_THREADS=1 python benchmarks/oracle.py [--np 1,2,3,4] [--models mlp,resnet] \
        [--rounds 3] [--quiet-load 1.5] [--calibration F ...] [--out F]

1. Profile: one process trains the model alone (``train.py --worker single``: zero_grad,
   forward, backward, SGD step on random inputs, median step); its seconds per sample are the
   model's compute, spread over the layers by FLOPs as ParaDL spreads a profiled total
   (torchmodel.py counts them on the meta device).
2. Predict: ``oracle.predict`` for data parallelism at each rank count on this machine as a
   platform: one node of ``--cores`` cores (CORES_PER_NODE: ranks beyond the cores compute
   ranks / cores times slower and overlap nothing), communication from the calibrations given
   (``commlayer calibrate`` on this machine, as committed with the algorithm benchmarks), the
   gradient buckets overlapped with backward. Also shown: the same as if every rank had a
   device of its own (the GPU model, no CORES_PER_NODE), to see what the cores change.
3. Measure: ``train.py --worker commlayer`` under ``mpiexec -n N`` (DistributedOptimizer),
   median step.
This machine is shared: other jobs' load changes a profile several-fold within minutes. So
the measurement is repeated in ``--rounds`` rounds; in each, every run is preceded at once by
its own profile, and both by a wait (at most ``--quiet-wait-s``) until the runnable threads of
other jobs, sampled from /proc/loadavg, average at most ``--quiet-load``; the figure before
and after the pair and the 1-minute load average are recorded, and a pair with both at most
``--quiet-load`` counts as quiet. Accuracy is 1 - |predicted - measured| /
measured per round (each round's prediction from its own profile); the table gives the median
over rounds and the range. ``--measured train.md``: read one round from a table train.py wrote.

Across the namespace cluster (scripts/cluster.sh, root; issue 23 with issue 21's cluster):

    sudo OMP_NUM_THREADS=1 python benchmarks/oracle.py --cluster 2x1,2x2 --rates 1gbit,10gbit \
        --rounds 2 --warmup 24 --out benchmarks/results/oracle_cluster.md

4. Brings the cluster up (refused while ``ip netns list`` shows any namespace: someone else's
   cluster), and for each rate sets every link to it live, then per layout HxR runs
   ``commlayerrun -np H*R -H node1:R,... commlayer calibrate --out F`` (F beside ``--out``:
   the links' alpha/beta as the ranks see them, TCP over the rate-limited veths) and, in
   rounds, the profile (one process, on the machine as in 1.) followed by train.py's commlayer
   worker through the same ``commlayerrun -H``; the cluster comes down whatever happens.
   ``--warmup`` must cover auto's tuning (it explores its candidates during the first 12-24
   calls per size class: network_train.py's note); 24 as there.
5. The platform: H nodes of R ranks (GPU_PER_NODE = R, node-major as ``-H`` places them),
   the link's rate as BANDWIDTH (a fallback: the calibration of exactly (H*R ranks, H nodes)
   is what the prediction reads), and CORES_PER_NODE = this machine's cores / H: the hosts are
   network namespaces of one machine, so they share its cores; with every rank busy the
   scheduler spreads them evenly, so a host gets cores / H of them (2 hosts on 2 cores: 1
   each; 2 x 2 ranks compute at half speed, 2 x 1 at full). Giving each host all the
   machine's cores would predict 2 x 2 ranks at full speed on 2 cores. Not modelled: the
   kernel's work moving the traffic (TCP, veth, tbf: at 10 Gbit/s the 2 cores are the limit,
   6.6 Gbit/s measured) takes the same cores from compute; the calibration's curves include
   its cost for the transfers alone, not its competition with backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train  # noqa: E402
from network import CLUSTER, layout, rate_bits  # noqa: E402

from commlayer import costmodel, oracle  # noqa: E402
from commlayer.oracle import torchmodel  # noqa: E402

INPUTS = {"mlp": "768", "resnet": "3x32x32"}


def profiled_net(model: str, seconds_per_sample: float) -> oracle.Net:
    """The model's layers with the measured total on the first, as a ``*_profall`` file."""
    net = torchmodel.describe(f"train:{model}", INPUTS[model], 1)
    first = dataclasses.replace(net.layers[0], t_s=seconds_per_sample)
    rest = tuple(dataclasses.replace(la, t_s=0.0) for la in net.layers[1:])
    return dataclasses.replace(net, layers=(first, *rest))


def this_machine(ranks: int, cores: int | None = None) -> oracle.Platform:
    """One node holding every rank, its ``cores`` shared by them (None: a device per rank);
    the network figures come from the calibrations."""
    return oracle.Platform(
        mem_per_gpu_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        gpu_speed_flops=1.0,
        bandwidth_bytes_s=1e9,
        latency_s=1e-5,
        max_gpus=max(ranks, 1),
        gpus_per_node=max(ranks, 1),
        path=platform.node(),
        cores_per_node=cores,
    )


def cluster_platform(hosts: int, per_host: int, rate: str, cores: int | None) -> oracle.Platform:
    """The namespace cluster: ``hosts`` nodes of ``per_host`` ranks behind links of ``rate``;
    the machine's ``cores`` shared by the hosts (None: a device per rank). Module item 5."""
    return dataclasses.replace(
        this_machine(hosts * per_host),
        bandwidth_bytes_s=rate_bits(rate) / 8,
        gpus_per_node=per_host,
        path=f"namespace cluster {hosts}x{per_host}, links {rate}",
        cores_per_node=max(1, cores // hosts) if cores else None,
    )


def predict_step_s(
    net: oracle.Net, plat: oracle.Platform, ranks: int, batch: int, cals: list[Any]
) -> dict[str, Any]:
    (row,) = oracle.predict(
        net,
        plat,
        "data",
        [ranks],
        batch_per_gpu=batch,
        calibrations=cals,
    )
    return {
        "step_s": row.iter_s,
        "comp_s": row.tcomp_s / row.iterations,
        "comm_s": row.tcomm_s / row.iterations,
        "hidden_s": row.hidden_s / row.iterations,
    }


# -- the machine's load ---------------------------------------------------------------------------
def runnable_now(seconds: float = 2.0, samples: int = 20) -> float:
    """Runnable threads on the machine, averaged over ``seconds`` (/proc/loadavg's 4th field,
    less this sampling process itself)."""
    total = 0.0
    for _ in range(samples):
        with open("/proc/loadavg") as f:
            total += int(f.read().split()[3].split("/")[0]) - 1
        time.sleep(seconds / samples)
    return total / samples


def wait_quiet(limit: float | None, wait_s: float) -> dict[str, float]:
    """Wait until ``runnable_now() <= limit`` or ``wait_s`` passed; what was seen."""
    start = time.monotonic()
    seen = runnable_now()
    while limit is not None and seen > limit and time.monotonic() - start < wait_s:
        time.sleep(3.0)
        seen = runnable_now()
    return {"runnable": seen, "load1": os.getloadavg()[0], "waited_s": time.monotonic() - start}


def spread(values: list[float], fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    """``median [min-max]`` (the median alone for one value)."""
    med = statistics.median(values) * scale
    if len(values) == 1:
        return fmt.format(med)
    lo, hi = min(values) * scale, max(values) * scale
    return f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def read_table(path: Path) -> dict[tuple[str, str, int], float]:
    """(model, system, ranks) -> step ms, from the first table of a train.py results file."""
    steps = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[1].isdigit():
            try:
                steps.setdefault((cells[0], cells[2], int(cells[1])), float(cells[3]))
            except ValueError:
                continue
    return steps


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["mlp", "resnet"])
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        help="calibration file(s); default the committed algorithms_np*.json",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="first run commlayer calibrate at each rank count above 1 (files beside --out) "
        "and predict from those: they hold the engine's cost per collective call "
        "(op_latency_s), which the committed ones predate",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-load", type=float, help="wait for at most this many runnable")
    parser.add_argument("--quiet-wait-s", type=float, default=120.0)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    # The profile runs under the glibc malloc thresholds commlayer.init() sets in every measured
    # run (train.py's "+malloc": glibc's own variables). Without them the one process unmaps
    # and faults in its gradients every step: 2026-11-26, quiet, 3 runs each: MLP 37.5-41.2 ms
    # plain, 28.0-29.3 with the thresholds, 30.5-31.7 commlayer at 1 rank; ResNet 281-299,
    # 252-259, 262-267. The plain profile put every prediction 12-15% high.
    parser.add_argument(
        "--profile",
        choices=("single+malloc", "single"),
        default="single+malloc",
        help="train.py worker for the one-process profile",
    )
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--measured", help="train.py's table to read instead of running")
    parser.add_argument(
        "--cluster",
        type=lambda text: [layout(x) for x in text.split(",")],
        help="layouts HOSTSxRANKS across the namespace cluster, e.g. 2x1,2x2 (root)",
    )
    parser.add_argument(
        "--rates", type=lambda text: text.split(","), default=["1gbit"], help="with --cluster"
    )
    parser.add_argument("--out", help="also write the markdown report here")
    args = parser.parse_args()
    if args.measured:
        args.rounds = 1
    for rate in args.rates:
        rate_bits(rate)
    return args


def measure_one(
    args: argparse.Namespace,
    cals: list[Any],
    model: str,
    plats: dict[str, oracle.Platform],
    hosts: str | None = None,
) -> dict[str, Any]:
    """A quiet wait, the one-process profile, at once the run it predicts (``hosts``: across
    the cluster), and the load after; predicted on each of ``plats`` ("cores", "gpu")."""
    ranks = plats["cores"].max_gpus
    load = wait_quiet(args.quiet_load, args.quiet_wait_s)
    single_ms = float(train.run_one(args, args.profile, model, 1)["step_ms"])
    run = train.run_one(args, "commlayer", model, ranks, hosts)
    after = runnable_now(1.0, 10)
    net = profiled_net(model, single_ms / 1e3 / args.batch)
    return {
        "model": model,
        "ranks": ranks,
        "profile_ms": single_ms,
        "load": load,
        "load_after": after,
        "quiet": args.quiet_load is not None and max(load["runnable"], after) <= args.quiet_load,
        "measured_s": float(run["step_ms"]) / 1e3,
        "collective_ms_per_step": run.get("collective_ms_per_step"),
        "overlap": run.get("overlap"),
        **{key: predict_step_s(net, plat, ranks, args.batch, cals) for key, plat in plats.items()},
    }


def _scored(record: dict[str, Any], **extra: Any) -> dict[str, Any]:
    record.update(extra)
    for key in ("cores", "gpu"):
        got, real = record[key]["step_s"], record["measured_s"]
        record[key]["accuracy"] = 1 - abs(got - real) / real
    print(json.dumps(record), flush=True)
    return record


def measure(args: argparse.Namespace, cals: list[Any]) -> list[dict[str, Any]]:
    """Every round, model and rank count on this machine: one record each (measure_one)."""
    table = read_table(Path(args.measured)) if args.measured else {}
    records = []
    for round_ in range(args.rounds):
        for model in args.models:
            for ranks in args.np:
                plats = {"cores": this_machine(ranks, args.cores), "gpu": this_machine(ranks)}
                if not args.measured:
                    record = measure_one(args, cals, model, plats)
                else:  # the steps a train.py table holds, predicted from its one-process step
                    single_ms = table[(model, "single", 1)]
                    net = profiled_net(model, single_ms / 1e3 / args.batch)
                    record = {
                        "model": model,
                        "ranks": ranks,
                        "profile_ms": single_ms,
                        "load": wait_quiet(None, 0),
                        "load_after": runnable_now(1.0, 10),
                        "quiet": False,
                        "measured_s": table[(model, "commlayer", ranks)] / 1e3,
                        **{
                            k: predict_step_s(net, plat, ranks, args.batch, cals)
                            for k, plat in plats.items()
                        },
                    }
                records.append(_scored(record, round=round_, case=[model, str(ranks)]))
    return records


def _cluster(*words: str) -> None:
    subprocess.run(["bash", str(CLUSTER), *words], check=True, stdout=subprocess.DEVNULL)


def calibrate_cluster(args: argparse.Namespace, rate: str, hosts: int, per_host: int) -> Path:
    """``commlayer calibrate`` across the cluster's hosts; the file it wrote."""
    path = Path(args.out or HERE / "results" / "oracle_cluster.md")
    path = path.with_name(f"{path.stem}_{rate}_{hosts}x{per_host}.calibration.json")
    launcher = os.path.join(sysconfig.get_path("scripts"), "commlayerrun")
    start = [launcher, "-np", str(hosts * per_host), "-H", _hostlist(hosts, per_host)]
    return _calibrate(args, start, path, f"{rate} {hosts}x{per_host}")


def calibrate_here(args: argparse.Namespace, ranks: int) -> Path:
    """``commlayer calibrate`` at ``ranks`` on this machine; the file it wrote."""
    path = Path(args.out or HERE / "results" / "oracle_data_parallel.md")
    path = path.with_name(f"{path.stem}_np{ranks}.calibration.json")
    path.unlink(missing_ok=True)
    return _calibrate(args, ["mpiexec", "-n", str(ranks)], path, f"{ranks} ranks")


def _calibrate(args: argparse.Namespace, start: list[str], path: Path, what: str) -> Path:
    """``commlayer calibrate --out path`` started by ``start`` (a launcher and its arguments),
    after a quiet wait; says how long it took and under what load."""
    command = [*start, sys.executable, "-m", "commlayer.cli", "calibrate", "--out", str(path)]
    load = wait_quiet(args.quiet_load, args.quiet_wait_s)
    t0 = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=args.timeout_s,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    print(
        f"calibrated {what} in {time.monotonic() - t0:.0f} s after "
        f"{load['waited_s']:.0f} s of quiet wait, other jobs' runnable threads before "
        f"{load['runnable']:.1f}, after {runnable_now(1.0, 10):.1f}: {path}",
        flush=True,
    )
    return path


def _hostlist(hosts: int, per_host: int) -> str:
    return ",".join(f"node{k}:{per_host}" for k in range(1, hosts + 1))


def measure_cluster(args: argparse.Namespace) -> tuple[list[Any], list[dict[str, Any]]]:
    """Module items 4-5: per rate, calibrate each layout, then rounds of every (layout, model)."""
    if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip():
        sys.exit("network namespaces exist (ip netns list): another cluster is up; not touched")
    records: list[dict[str, Any]] = []
    cals: list[Any] = []
    hosts_needed = max(h for h, _ in args.cluster)
    # a SIGTERM (a background job's kill) unwinds through the finally: the cluster comes down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        _cluster("up", str(hosts_needed), "--rate", args.rates[0])
        for rate in args.rates:
            for k in range(1, hosts_needed + 1):
                _cluster("set", f"node{k}", "--rate", rate)
            mine = {
                (h, r): costmodel.load_all(calibrate_cluster(args, rate, h, r))
                for h, r in args.cluster
            }
            cals += [c for found in mine.values() for c in found]
            for round_ in range(args.rounds):
                for (h, r), found in mine.items():
                    plats = {
                        "cores": cluster_platform(h, r, rate, args.cores),
                        "gpu": cluster_platform(h, r, rate, None),
                    }
                    for model in args.models:
                        record = measure_one(args, found, model, plats, _hostlist(h, r))
                        case = [rate, f"{h}x{r}", model]
                        records.append(_scored(record, round=round_, case=case, rate=rate))
    finally:
        _cluster("down")
    return cals, records


def _command(args: argparse.Namespace) -> str:
    where = (
        f"--cluster {','.join(f'{h}x{r}' for h, r in args.cluster)} --rates {','.join(args.rates)}"
        if args.cluster
        else f"--np {','.join(map(str, args.np))}"
    )
    return (
        f"`python benchmarks/oracle.py {where} --models {','.join(args.models)} --steps "
        f"{args.steps} --warmup {args.warmup} --rounds {args.rounds} --profile {args.profile}"
        + (f" --quiet-load {args.quiet_load} --quiet-wait-s {args.quiet_wait_s:.0f}"
           if args.quiet_load else "")
        + (" --calibrate" if args.calibrate else "")
        + (f" --measured {args.measured}`" if args.measured else "`")
    )  # fmt: skip


def _calibration_text(c: Any) -> str:
    text = f"{c.size} ranks on {c.nodes} node(s) ({c.host} {c.date}"
    if c.has_inter:  # the link as the ranks see it: every pair at once exchanging across it
        n, t = c.exchange_inter[-1]
        text += f"; a {n >> 20} MiB exchange across the link {t * 1e3:.0f} ms"
    return text + f"; engine {c.op_latency_s * 1e3:.2f} ms a collective call)"


def _averages(args: argparse.Namespace, records: list[dict[str, Any]]) -> list[str]:
    """Average accuracy per round (and over quiet runs) for each group of cases."""
    groups: list[tuple[str, Any]] = [("every case", lambda r: True)]
    if args.cluster:
        groups += [(f"links at {rate}", lambda r, x=rate: r["rate"] == x) for rate in args.rates]
        groups += [(f"{h}x{n}", lambda r, x=f"{h}x{n}": r["case"][1] == x) for h, n in args.cluster]
    else:
        groups.append(("2-4 ranks", lambda r: r["ranks"] > 1))
    lines = []
    for label, keep in groups:
        for key, name in (("cores", f"{args.cores} cores"), ("gpu", "a device per rank")):
            per_round = [
                statistics.mean(r[key]["accuracy"] for r in records if r["round"] == i and keep(r))
                for i in range(args.rounds)
                if any(r["round"] == i and keep(r) for r in records)
            ]
            calm = [r[key]["accuracy"] for r in records if r["quiet"] and keep(r)]
            if per_round:
                lines.append(
                    f"- average accuracy, {label}, {name}: {statistics.mean(per_round):.1%} "
                    f"(rounds: {', '.join(f'{a:.1%}' for a in per_round)})"
                    + (
                        f"; over the {len(calm)} runs with other jobs' runnable threads <= "
                        f"{args.quiet_load} before and after: {statistics.mean(calm):.1%}"
                        if calm
                        else ""
                    )
                )
    return lines


def report(args: argparse.Namespace, cals: list[Any], records: list[dict[str, Any]]) -> str:
    loads = [r["load"]["runnable"] for r in records] + [r["load_after"] for r in records]
    load1 = [r["load"]["load1"] for r in records]
    where = (
        "across the namespace cluster (scripts/cluster.sh; CORES_PER_NODE = "
        f"{args.cores} cores / hosts)"
        if args.cluster
        else "on this machine"
    )
    lines = [
        f"# the oracle against measured data-parallel steps {where} (batch {args.batch} per rank)",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()},"
        f" {args.cores} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"niceness {os.nice(0)}, {args.rounds} round(s), profile `{args.profile}`; "
        + (
            f"steps read from the first table of {args.measured}"
            if args.measured
            else f"other jobs' runnable threads before and after each run {spread(loads)} "
            f"(quiet wait: <= {args.quiet_load} for at most {args.quiet_wait_s:.0f} s), "
            f"1-minute load average {spread(load1)}"
        )
        + "; calibrations: "
        + ", ".join(_calibration_text(c) for c in cals),
        "",
        _command(args),
        "",
        "Median over rounds [min-max]; each round's prediction from its own profile. "
        "Collectives: the engine's time in collectives per step, measured in training.",
        "",
        ("| link | hosts x ranks | model" if args.cluster else "| model | ranks")
        + f" | profile ms | measured step ms | predicted ms, {args.cores} cores "
        "(comp + comm - hidden) | accuracy | predicted, a device per rank | accuracy | "
        "collectives ms |",
        ("| --- | --- | --- " if args.cluster else "| --- | ---: ")
        + "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    cases: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in records:
        cases.setdefault(tuple(r["case"]), []).append(r)
    for case, rs in cases.items():
        c = [r["cores"] for r in rs]
        comp, comm, hidden = (
            statistics.median(x[k] for x in c) * 1e3 for k in ("comp_s", "comm_s", "hidden_s")
        )
        parts = (
            f"{spread([x['step_s'] for x in c], scale=1e3)} "
            f"({comp:.1f} + {comm:.1f} - {hidden:.1f})"
        )
        collectives = [r["collective_ms_per_step"] for r in rs if r.get("collective_ms_per_step")]
        lines.append(
            f"| {' | '.join(case)} | {spread([r['profile_ms'] for r in rs])} | "
            f"{spread([r['measured_s'] for r in rs], scale=1e3)} | {parts} | "
            f"{spread([x['accuracy'] for x in c], '{:.1%}')} | "
            f"{spread([r['gpu']['step_s'] for r in rs], scale=1e3)} | "
            f"{spread([r['gpu']['accuracy'] for r in rs], '{:.1%}')} | "
            f"{spread(collectives) if collectives else ''} |"
        )
    return "\n".join([*lines, "", *_averages(args, records)])


def main() -> int:
    args = _arguments()
    paths = args.calibration or sorted(
        str(p) for p in (HERE / "results").glob("algorithms_np*.calibration.json")
    )
    if args.cluster:
        cals, records = measure_cluster(args)
    else:
        if args.calibrate:
            paths = [str(calibrate_here(args, n)) for n in args.np if n > 1]
        cals = [c for p in paths for c in costmodel.load_all(Path(p))]
        records = measure(args, cals)
    text = report(args, cals, records)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
