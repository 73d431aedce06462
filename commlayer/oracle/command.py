"""``commlayer oracle``: its arguments and what it prints (cli.py adds the subcommand).

commlayer oracle --net resnet50.net --plat abci.plat --strategy all --gpus 1-1024 \\
    --batch-per-gpu 64 [--max-batch 262144] [--lc spatial_resnet.lc] [--plot out.png]
commlayer oracle --model torchvision.models:resnet50 --input 3x224x224 --dataset-size 1281167 \\
    --plat abci.plat ...
commlayer oracle ... --calibration ~/.cache/commlayer/calibration.json
commlayer oracle ... --compression topk:ratio=0.01 --algorithm hierarchical
commlayer oracle ... --paradl           # ParaDL's own model, its quirks included
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from commlayer import oracle
from commlayer.common.errors import SpecError
from commlayer.oracle import report

DESCRIPTION = (
    "Predict, per GPU count, each parallelism strategy's memory per GPU, compute, "
    "communication and time per epoch (data, spatial, filter, channel, pipeline, data+filter, "
    "data+spatial) for a model (--net in ParaDL's format, or --model, a torch model) on a "
    "machine (--plat), rank them, and plot the breakdown (--plot, needs matplotlib)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("model and machine")
    what.add_argument("--net", help="model and dataset, ParaDL's .net format")
    what.add_argument(
        "--model",
        help="a torch model instead: module:callable, e.g. "
        "torchvision.models:resnet50 (built on the meta device: no weights)",
    )
    what.add_argument("--input", help="with --model: one sample's shape, e.g. 3x224x224")
    what.add_argument("--dataset-size", type=int, help="with --model: samples per epoch")
    what.add_argument("--plat", required=True, help="platform, ParaDL's .plat format")
    what.add_argument("--lc", help="layer mask: which layers spatial/filter/channel split")
    what.add_argument("--calibration", help="commlayer calibrate's file: this machine's curves")
    scan = parser.add_argument_group("what to predict")
    scan.add_argument(
        "--strategy",
        default="all",
        help="d, s, f, c, p, df, ds, o, their names, a comma list, or all",
    )
    scan.add_argument(
        "--gpus",
        default="1-1024",
        help="A-B: the powers of two between (ParaDL's --cmaxp); or a list 1,2,3",
    )
    scan.add_argument(
        "--batch-per-gpu",
        type=int,
        help="samples per GPU (ParaDL's --cBon; default: the most that fit)",
    )
    scan.add_argument("--max-batch", type=float, help="largest global batch (ParaDL's --cmaxB)")
    scan.add_argument("--algorithm", default="auto", help="allreduce algorithm, or auto")
    scan.add_argument(
        "--compression",
        help="a compressor spec that declares its payload's size: fp16, topk:ratio=R, ...",
    )
    scan.add_argument(
        "--no-overlap",
        action="store_true",
        help="gradient communication does not overlap backward (as ParaDL)",
    )
    scan.add_argument(
        "--op-latency-us",
        type=float,
        help="the engine's cost per collective call besides its transfers (default: the "
        "calibration's, which commlayer calibrate measures; 0 without a calibration)",
    )
    scan.add_argument(
        "--micro-batches", type=int, help="pipeline: GPipe's micro-batches (default 4 per stage)"
    )
    scan.add_argument(
        "--model-ways",
        type=int,
        help="data+filter, data+spatial: GPUs splitting the model (default a node's)",
    )
    scan.add_argument("--paradl", action="store_true", help="ParaDL's own model and quirks")
    out = parser.add_argument_group("output")
    out.add_argument("--format", choices=("table", "json"), default="table")
    out.add_argument("--plot", help="PNG of the time per epoch against GPUs (matplotlib)")


def _inputs(args: argparse.Namespace) -> tuple[oracle.Net, oracle.Platform]:
    plat = oracle.parse_plat(args.plat)
    if (args.net is None) == (args.model is None):
        raise SpecError("give one of --net FILE or --model module:callable")
    if args.net:
        return oracle.parse_net(args.net), plat
    if not args.input or not args.dataset_size:
        raise SpecError("--model needs --input (e.g. 3x224x224) and --dataset-size")
    from commlayer.oracle import torchmodel

    return torchmodel.describe(args.model, args.input, args.dataset_size), plat


def run(args: argparse.Namespace) -> int:
    # Before any work: the tables can take minutes, and the plot is drawn last.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "commlayer oracle: --plot needs matplotlib (pip install 'commlayer[bench]'), which "
            "is not installed; nothing was computed",
            file=sys.stderr,
        )
        return 2
    try:
        net, plat = _inputs(args)
        mask = oracle.parse_lc(args.lc, net) if args.lc else None
        calibrations = None
        if args.calibration:
            from commlayer import costmodel

            if not Path(args.calibration).is_file():
                raise SpecError(f"--calibration {args.calibration!r}: no such file")
            calibrations = costmodel.load_all(Path(args.calibration))
            if not calibrations:
                raise SpecError(
                    f"{args.calibration}: no calibration in it (run: mpiexec -n N "
                    "commlayer calibrate --out FILE)"
                )
        rows = oracle.predict(
            net,
            plat,
            args.strategy,
            oracle.gpu_counts(args.gpus),
            args.batch_per_gpu,
            args.max_batch,
            mask,
            calibrations,
            args.algorithm,
            args.compression,
            paradl_model=args.paradl,
            overlap=not args.no_overlap,
            op_latency_s=None if args.op_latency_us is None else args.op_latency_us * 1e-6,
            micro_batches=args.micro_batches,
            model_ways=args.model_ways,
        )
    except (SpecError, ValueError) as exc:
        print(f"commlayer oracle: {exc}", file=sys.stderr)
        return 2
    title = f"{net.model} on {Path(plat.path).name}, {net.samples} samples/epoch, " + (
        "ParaDL's model" if args.paradl else "commlayer's model"
    )
    if args.format == "json":
        print(report.json_lines(rows))
    else:
        print(f"# {title}")
        print(report.table(rows))
        print()
        print(report.ranking(rows))
    if args.plot:
        if not rows:
            print("commlayer oracle: no rows to plot", file=sys.stderr)
            return 1
        path = report.plot(rows, args.plot, title)
        print(f"plot: {path}", file=sys.stderr)
    return 0
