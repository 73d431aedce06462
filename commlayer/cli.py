"""``commlayer`` command: ``calibrate`` the cost model, print the ``algorithms`` it predicts,
``simulate`` them in SimGrid at thousands of ranks, ask the ``oracle`` which parallelism
strategy to use. ``commlayer COMMAND --help`` describes each.

mpiexec -n 2 commlayer calibrate [--quick] [--out FILE]
commlayer algorithms --list
commlayer algorithms --size 64MiB [--ranks 2] [--file FILE]
commlayer algorithms --platform torus:8x8x4 --gpus-per-node 4 --size 1MiB,64MiB \
    [--sim-table simulated.jsonl]
commlayer algorithms --compression topk:ratio=0.01 --platform fat-tree:gpus-per-node=4 \
    --ranks 256 --size 64MiB
commlayer simulate --algorithm ring,shd,auto --platform fat-tree:gpus-per-node=4 \
    --ranks 64,256 --size 1MiB,32MiB [--out r.md] [--plot r.png] [--format json]
commlayer oracle --net resnet50.net --plat abci.plat --gpus 1-1024 --batch-per-gpu 64
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from commlayer import costmodel
from commlayer.common.config import parse_variable
from commlayer.launch import calibrate as measure


def _bytes(text: str) -> int:
    return int(parse_variable("COMMLAYER_FUSION_THRESHOLD", text))


def _print_table(cal: costmodel.Calibration, sizes: Sequence[int]) -> None:
    print(
        f"# predicted allreduce time, {cal.size} ranks on {cal.nodes} node(s), calibrated "
        f"{cal.date} on {cal.host}: alpha {cal.alpha_s * 1e6:.1f} us, beta "
        f"{1 / cal.beta_s_per_byte / 1e9:.2f} GB/s, reduce {1 / cal.gamma_s_per_byte / 1e9:.2f} "
        f"GB/s, copy {1 / cal.copy_s_per_byte / 1e9:.2f} GB/s, engine "
        f"{cal.op_latency_s * 1e6:,.0f} us a collective call"
    )
    for nbytes in sizes:
        rows = costmodel.table(nbytes, cal)
        best = rows[0][1]
        cells = ", ".join(
            f"{name} {seconds * 1e6:,.0f} us ({seconds / best:.2f}x)" for name, seconds in rows
        )
        print(f"{nbytes:>12,} B: {cells}")


def _engine_op_latency_s(cal: costmodel.Calibration, quick: bool) -> float:
    """commlayer's engine per collective call (``Calibration.op_latency_s``): the median
    blocking 4-byte allreduce through the engine (``commlayer.init``, as training runs it),
    the slowest rank's, less the fastest native allreduce of the smallest size the calibration
    measured."""
    import statistics
    import time

    import torch

    import commlayer

    commlayer.init()
    try:
        one = torch.zeros(1)
        for _ in range(10):  # the first calls negotiate and tune
            commlayer.allreduce(one, name="commlayer.calibrate.op_latency")
        times = []
        for _ in range(20 if quick else 60):
            start = time.perf_counter()
            commlayer.allreduce(one, name="commlayer.calibrate.op_latency")
            times.append(time.perf_counter() - start)
        mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
        slowest = float(commlayer.allreduce(mine, op=commlayer.Max, name="commlayer.calibrate.op"))
    finally:
        commlayer.shutdown()
    # the natives' smallest point (1 KiB) is a latency, as 4 bytes' is
    native = [points[0][1] for points in cal.native.values() if points]
    return max(0.0, slowest - min(native, default=0.0))


def calibrate(args: argparse.Namespace) -> int:
    from commlayer.backends.mpi import MPIBackend
    from commlayer.common import config, topology
    from commlayer.core.registries import REGISTRIES

    backend = MPIBackend()
    # COMMLAYER_TOPOLOGY: one machine measured as several nodes
    override = config.load(registries=REGISTRIES).topology
    try:
        topo = topology.build(override, backend.size, backend.nodes())
    except ValueError as exc:
        print(f"rank {backend.rank}: COMMLAYER_TOPOLOGY={override!r}: {exc}", file=sys.stderr)
        backend.close()
        return 2
    cal = measure.calibrate(backend, quick=args.quick, topology=topo)
    backend.close()
    cal = dataclasses.replace(cal, op_latency_s=_engine_op_latency_s(cal, args.quick))
    if backend.rank == 0:
        path = costmodel.save(cal, Path(args.out) if args.out else None)
        print(f"saved to {path}")
        from commlayer.costmodel import sparse as sparse_cost

        # With --out everything measured goes beside that file, not into this machine's cache
        # (where it would steer later runs: the system tests calibrate with --out).
        sparse_path = path.with_suffix(".sparse.json") if args.out else sparse_cost.local_path()
        rates = sparse_cost.calibrate_local(quick=args.quick, path=sparse_path)
        print(
            f"sparse kernels: merge {1e-6 / rates['merge_s_per_pair']:.0f} M pairs/s, scatter-add "
            f"{1e-6 / rates['scatter_s_per_entry']:.0f} M entries/s, saved to {sparse_path}"
        )
        _print_table(cal, [1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26])
    return 0


# What each kind of algorithm is (algorithms/registry.py), for ``commlayer algorithms --list``.
_KINDS = {
    "selection": "picks one of the others per buffer size (the cost model)",
    "native": "the backend's own",
    "schedule": "steps every rank runs, for Sum, Average, Min, Max, Product",
    "combine": "every rank's tensor gathered, then combined on every rank",
}


def algorithms_list() -> int:
    """``commlayer algorithms --list``: every registered algorithm, its kind, and what selects
    it (COMMLAYER_ALLREDUCE_ALGORITHM, or a combine's operator), then the sparse ones."""
    from commlayer import algorithms
    from commlayer.algorithms import sparse

    aliases = {name: alias for alias, name in algorithms.ALIASES.items()}
    found = (algorithms.combining(op) for op in algorithms.combining_ops())
    combines = {c.name: c for c in found if c is not None}
    for name, kind in algorithms.kinds().items():
        combine = combines.get(name)
        if combine is not None:
            how = f"allreduce(op={combine.op.name}): {combine.moves}, then combine"
        else:
            how = f"COMMLAYER_ALLREDUCE_ALGORITHM={name}"
            how += f" (or {aliases[name]})" if name in aliases else ""
        print(f"{name:<24} {kind:<9} {_KINDS[kind]}; {how}")
    for name in sparse.available():
        print(f"{name:<24} {'sparse':<9} COMMLAYER_SPARSE_ALGORITHM={name}")
    return 0


def algorithms_table(args: argparse.Namespace) -> int:
    from commlayer.sim import cli as sim_cli

    if args.list:
        return algorithms_list()
    if args.compression:
        return compressed_table(args)
    if args.platform:
        return sim_cli.predict(args)
    if args.sim_table or args.hostfile or args.gpus_per_node or args.format != "table":
        print(
            "commlayer algorithms: --sim-table, --hostfile, --gpus-per-node and --format need "
            "--platform (without it the table is read from a local calibration)",
            file=sys.stderr,
        )
        return 2
    path = Path(args.file) if args.file else None
    found = costmodel.load_all(path)
    if args.ranks is not None:
        found = [c for c in found if c.size == args.ranks]
    if not found:
        where = path or costmodel.default_path()
        print(
            f"no calibration in {where}"
            + (f" for {args.ranks} ranks" if args.ranks else "")
            + "; run: mpiexec -n N commlayer calibrate",
            file=sys.stderr,
        )
        return 1
    for cal in found:
        _print_table(cal, args.size)
    return 0


def compressed_table(args: argparse.Namespace) -> int:
    """``commlayer algorithms --compression SPEC``: one bucket's reduction under each spec, flat
    and once per host: the cost model's time (network only) and the most bytes a node sends to
    the others (costmodel/compressed.py), on a platform or the local calibrations."""
    from commlayer.common.topology import Topology
    from commlayer.costmodel import compressed
    from commlayer.sim import cli as sim_cli
    from commlayer.sim import simulate as sim

    try:
        for spec in args.compression:
            compressed.payload(spec, 1 << 10)
        targets: list[tuple[str, costmodel.Calibration, Topology]] = []
        if args.platform:
            single = argparse.Namespace(hostfile=args.hostfile, gpus_per_node=args.gpus_per_node)
            platform = sim_cli._platform(args.platform, single, args.ranks)
            cal = sim.calibration(platform)
            if cal is None:
                raise ValueError(f"{args.platform}: a platform file's links are not known")
            targets.append((platform.name, cal, platform.topology()))
        for cal in (
            [] if args.platform else costmodel.load_all(Path(args.file) if args.file else None)
        ):
            if args.ranks is None or cal.size == args.ranks:
                topo = costmodel.node_major(cal) or Topology.flat(cal.size)
                targets.append((f"calibration of {cal.host or 'this machine'}", cal, topo))
    except (ValueError, OSError) as exc:
        print(f"commlayer algorithms: {exc}", file=sys.stderr)
        return 2
    if not targets:
        print("no calibration found; run: mpiexec -n N commlayer calibrate, or give --platform",
              file=sys.stderr)  # fmt: skip
        return 1
    for name, cal, topo in targets:
        print(
            f"# one bucket compressed, {topo.size} ranks on {topo.nodes} node(s), {name}: the "
            "cost model's time (the network alone) and the most MB a node sends to the others, "
            "flat and once per host"
        )
        for nbytes in args.size:
            for spec in args.compression:
                flat = compressed.predict(spec, max(nbytes // 4, 1), cal, topo, False)
                host = compressed.predict(spec, max(nbytes // 4, 1), cal, topo, True)
                cell = f"{nbytes:>14,} B {spec}: flat {flat.seconds * 1e3:,.3f} ms, "
                cell += f"{flat.cross_bytes / 1e6:,.2f} MB"
                if host == flat and topo.nodes in (1, topo.size):
                    print(cell + "; per host: the same (one node, or one rank a node)")
                    continue
                print(
                    f"{cell}; per host {host.seconds * 1e3:,.3f} ms "
                    f"({host.seconds / flat.seconds:.2f}x), {host.cross_bytes / 1e6:,.2f} MB "
                    f"({host.cross_bytes / max(flat.cross_bytes, 1):.2f}x)"
                )
    return 0


def simulate(args: argparse.Namespace) -> int:
    from commlayer.sim import cli as sim_cli

    return sim_cli.run(args)


def description() -> str:
    """The first paragraph of this module's docstring, whole (``--help`` shows it)."""
    first = (__doc__ or "").strip().split("\n\n", 1)[0]
    return " ".join(first.replace("``", "").split())


def parser() -> argparse.ArgumentParser:
    """The ``commlayer`` command's parser (also what the documentation's CLI page prints)."""
    parser = argparse.ArgumentParser(prog="commlayer", description=description())
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser(
        "calibrate",
        help="measure alpha, beta, gamma and the native algorithms",
        description="Measure this machine's cost model for COMMLAYER_ALLREDUCE_ALGORITHM=auto: "
        "the latency (alpha), seconds per byte on the link (beta) and of a reduction (gamma), "
        "the native MPI allreduce at each size and the engine's own cost per call, then the "
        "sparse kernels' rates; save them and print the predicted time of every algorithm. Run "
        "it under the launcher at the ranks and nodes you train with (one calibration a rank "
        "count): mpiexec -n 2 commlayer calibrate.",
    )
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    cal.add_argument("--out", help=f"calibration file (default {costmodel.default_path()})")
    cal.set_defaults(run=calibrate)
    from commlayer.sim import cli as sim_cli

    table = sub.add_parser(
        "algorithms",
        help="predicted time of every algorithm: from the local calibration, or on a platform "
        "(--platform), corrected by simulated tables (--sim-table)",
        description="Print the cost model's predicted allreduce time of every algorithm at "
        "each --size, fastest first: from this machine's calibration (commlayer calibrate; "
        "--file, --ranks), or on a generated machine (--platform, no calibration needed), "
        "corrected where a simulated table covers it (--sim-table).",
    )
    table.add_argument(
        "--size", type=sim_cli._list(_bytes, "size"), default=[64 << 20], help="e.g. 1MiB,64MiB"
    )
    table.add_argument(
        "--ranks", type=int, help="only the calibration for this many ranks; with --platform: "
        "the ranks placed on it"
    )  # fmt: skip
    table.add_argument("--file", help="calibration file to read")
    table.add_argument(
        "--list",
        action="store_true",
        help="list every registered algorithm, its kind (selection, native, schedule, combine, "
        "sparse) and what selects it, instead of the predicted times",
    )
    table.add_argument(
        "--compression",
        action="append",
        default=[],
        help="a compressor spec (repeatable): one bucket of --size reduced under it, flat and "
        "once per host, instead of the allreduce algorithms",
    )
    sim_cli.add_predict_arguments(table)
    table.set_defaults(run=algorithms_table)

    sim = sub.add_parser(
        "simulate",
        help="replay the algorithms' schedules in SimGrid (SMPI) on a generated or given platform",
        description=sim_cli.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(sim, _bytes)
    sim.set_defaults(run=simulate)
    from commlayer.oracle import command as oracle_command

    oracle = sub.add_parser(
        "oracle",
        help="which parallelism strategy: per-GPU memory, compute, "
        "communication and time per epoch (ParaDL's model and commlayer's)",
        description=oracle_command.DESCRIPTION,
    )
    oracle_command.add_arguments(oracle)
    oracle.set_defaults(run=oracle_command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what simulate --out records
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
