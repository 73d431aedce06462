"""Partial-local shuffling (issue 24): accuracy against global shuffling, and epoch time and
bytes moved when shared storage is slower than local storage.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/shuffle.py accuracy \
        --out benchmarks/results/shuffle_accuracy_np4.json
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/shuffle.py io \
        --out benchmarks/results/shuffle_io_np4.json
    python benchmarks/shuffle.py report --out benchmarks/results/shuffle.md \
        benchmarks/results/shuffle_accuracy_np4.json benchmarks/results/shuffle_io_np4.json

accuracy: a small CNN with BatchNorm on scikit-learn's digits (``--dataset digits``, 1437
training images of 8x8) or on a subset of Fashion-MNIST (``--dataset fashion``, from Debian's
dataset-fashion-mnist package), the training set sorted by class and cut into one contiguous
shard per rank (the site-local case where local shuffling hurts).
Every strategy starts from the same weights and runs the same epochs and seeds; "global" is
torch's DistributedSampler over the whole training set, the others PartialLocalShuffler with
fraction Q (Q = 0: local shuffling). Each rank scores its own model copy (BatchNorm's running
statistics are per rank, as in any Horovod job without SyncBatchNorm) on the whole test set;
the curves are the mean over ranks.

io: a synthetic dataset of 3x32x32 float32 samples (12 kB pickled) and an MLP step per batch.
"global" reads every sample from a shared folder: through a reader throttled to a shared link
(``--shared-mbps`` divided among the ranks, plus ``--shared-latency-ms`` per file: emulated by
sleeping), or over HTTP from another host of the namespace cluster (``--shared-url``: every
read crosses that host's rate-limited link); the others read local per-rank folders (ShardStore
files) and exchange Q of them over commlayer's alltoall during the epoch. The strategies run
interleaved, epoch e of each before epoch e + 1 of any, so that each epoch is compared with
local shuffling's same epoch run seconds apart (other jobs' load drifts over minutes). Per
epoch: its time (slowest rank), bytes read from shared storage, bytes exchanged, and the
exchange's time on the user thread (busy: packing and staging chunks between batches; wait:
blocked at the end of the shard on chunks in flight, the part not hidden behind compute).

On the cluster (stores and the shared folder on the machine's one file system, which the
hosts share; the storage host serves the shared folder):

    bash scripts/cluster.sh up 3 --rate 1gbit
    bash scripts/cluster.sh exec node3 python benchmarks/shuffle.py serve --dir /tmp/cl-shuffle &
    commlayerrun -np 4 -H node1:2,node2:2 python benchmarks/shuffle.py io --dir /tmp/cl-shuffle \
        --shared-url http://node3:8000 --out benchmarks/results/shuffle_io_cluster_1gbit.json
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import pickle
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import procstat  # benchmarks/procstat.py, beside this script
import torch
import torch.nn.functional as F
import torch.utils.data
from torch import nn

import commlayer as cl
from commlayer.data import PartialLocalShuffler, ShardStore

FRACTIONS = (0.0, 0.01, 0.1, 0.3, 1.0)


# -- accuracy -------------------------------------------------------------------------------------
FASHION = Path("/usr/share/datasets/fashion-mnist")  # apt-get install dataset-fashion-mnist


class SmallCNN(nn.Module):
    """examples/train_digits.py's CNN with BatchNorm after each convolution: 1 x side x side
    images (8 for digits, 28 for Fashion-MNIST), two 3x3 convolutions, two linear layers."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.pool_twice = side > 8  # 28 -> 14 -> 7; 8 -> 4 with one pooling
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        out = side // 4 if self.pool_twice else side // 2
        self.fc1, self.fc2 = nn.Linear(32 * out * out, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        if self.pool_twice:
            x = F.max_pool2d(x, 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _idx(path: Path) -> np.ndarray:
    """An MNIST-format idx file: magic (dims in its last byte), dims, then uint8 data."""
    raw = gzip.decompress(path.read_bytes())
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * d : 8 + 4 * d], "big") for d in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_images(name: str, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """(train images, train labels, test images, test labels), images 1 x side x side in [0, 1]:
    digits split 80/20; Fashion-MNIST's first --train-samples / --test-samples of each set."""
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
        labels = torch.tensor(digits.target, dtype=torch.int64)
        order = torch.tensor(np.random.default_rng(0).permutation(len(labels)))
        cut = int(0.8 * len(labels))
        return images[order[:cut]], labels[order[:cut]], images[order[cut:]], labels[order[cut:]]
    sets = []
    for prefix, n in (("train", args.train_samples), ("t10k", args.test_samples)):
        images = _idx(FASHION / f"{prefix}-images-idx3-ubyte.gz")[:n]
        labels = _idx(FASHION / f"{prefix}-labels-idx1-ubyte.gz")[:n]
        sets += [
            torch.tensor(images / 255.0, dtype=torch.float32).unsqueeze(1),
            torch.tensor(labels, dtype=torch.int64),
        ]
    return tuple(sets)


def sorted_by_class(args: argparse.Namespace) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """(training samples sorted by class, test images, test labels)."""
    train_x, train_y, test_x, test_y = load_images(args.dataset, args)
    order = sorted(range(len(train_y)), key=lambda i: (int(train_y[i]), i))
    return [(train_x[i], int(train_y[i])) for i in order], test_x, test_y


def train_curve(strategy: str, seed: int, args: argparse.Namespace) -> list[float]:
    """Test accuracy after each epoch, mean over the ranks' model copies."""
    train, test_x, test_y = sorted_by_class(args)
    if strategy == "global":
        sampler: Any = torch.utils.data.DistributedSampler(
            train, num_replicas=cl.size(), rank=cl.rank(), shuffle=True, seed=seed
        )
        dataset: Any = train
    else:
        store = ShardStore.from_dataset(train, partition_by="given")
        shuffler = PartialLocalShuffler(store, fraction=float(strategy), seed=seed)
        sampler, dataset = shuffler, shuffler.dataset
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=getattr(sampler, "sampler", sampler)
    )
    torch.manual_seed(seed)
    model = SmallCNN(side=train[0][0].shape[-1])
    optimizer = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    curve = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        cl.join()  # shards differ by one sample: the ranks with fewer batches wait here
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        curve.append(float(np.mean(cl.allgather_object(accuracy))))
    return curve


def run_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    strategies = ["global"] + [str(q) for q in FRACTIONS]
    curves: dict[str, list[list[float]]] = {s: [] for s in strategies}
    for seed in range(args.seeds):
        for strategy in strategies:
            t0 = time.perf_counter()
            curves[strategy].append(train_curve(strategy, seed, args))
            if cl.rank() == 0:
                print(
                    f"seed {seed} {strategy:>6}: final {curves[strategy][-1][-1]:.4f} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
    return {"curves": curves}


# -- io -------------------------------------------------------------------------------------------
class SharedFolder(torch.utils.data.Dataset[Any]):
    """Samples read from the shared folder: through a throttled reader (a local folder whose
    reads sleep for the modelled link), or over HTTP from a storage host (``--shared-url``,
    the folder served by ``python -m http.server`` on another host of the namespace cluster,
    so every read crosses its rate-limited link)."""

    def __init__(self, folder: Path, n: int, args: argparse.Namespace) -> None:
        self.folder, self.n, self.url = folder, n, args.shared_url
        self.rate = args.shared_mbps * 1e6 / 8 / cl.size()
        self.latency = args.shared_latency_ms / 1e3
        self.bytes_read = 0
        self._conn: http.client.HTTPConnection | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.url:
            data = self._fetch(f"/{i}.pkl")
        else:
            data = (self.folder / f"{i}.pkl").read_bytes()
            time.sleep(self.latency + len(data) / self.rate)
        self.bytes_read += len(data)
        return pickle.loads(data)

    def _fetch(self, path: str) -> bytes:
        """GET over one kept-alive connection (``serve`` speaks HTTP/1.1): a connection per
        sample made `python -m http.server` drop connections after ~9000 in a minute."""
        for attempt in range(2):
            if self._conn is None:
                url = urllib.parse.urlsplit(self.url)
                self._conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
            try:
                self._conn.request("GET", path)
                reply = self._conn.getresponse()
                data = reply.read()
                if reply.status != 200:
                    raise OSError(f"GET {self.url}{path}: HTTP {reply.status}")
                return data
            except (http.client.HTTPException, ConnectionError):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def serve(folder: str, port: int) -> None:
    """The shared folder over HTTP/1.1 (kept-alive connections), for ``io --shared-url``."""
    import functools
    import http.server

    class Handler(http.server.SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out in two writes: with Nagle's algorithm the second waits
            # for the client's delayed ACK, 40 ms a sample (measured: 11.7 s for 256 samples)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args: Any) -> None:
            pass

    handler = functools.partial(Handler, directory=folder)
    http.server.ThreadingHTTPServer(("", port), handler).serve_forever()


def synthetic(n: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 32, 32, generator=g), int(i % 10)) for i in range(n)]


class Strategy:
    """One strategy's loader: global (shared folder) or a PartialLocalShuffler of fraction Q,
    with the per-epoch numbers gathered so far."""

    def __init__(self, name: str, data: list[Any], root: Path, args: argparse.Namespace) -> None:
        """``name``: "global", or Q, or Q@label (stores under the --dirs folder of that label)."""
        self.name, self.shuffler = name, None
        if name == "global":
            self.dataset: Any = SharedFolder(root / "shared", args.samples, args)
            self.sampler: Any = torch.utils.data.DistributedSampler(
                self.dataset, num_replicas=cl.size(), rank=cl.rank(), shuffle=True, seed=0
            )
        else:
            setting, _, label = name.partition("@")
            fraction, _, chunks = setting.partition(":")  # Q:chunks overrides --chunks
            base = Path(dict(args.dirs)[label]) if label else root
            path = base / f"q{setting}" / "local{rank}"
            store = ShardStore.from_dataset(data, path=path, partition_by="given", overwrite=True)
            self.shuffler = PartialLocalShuffler(
                store, fraction=float(fraction), seed=0, chunks=int(chunks or args.chunks)
            )
            self.dataset, self.sampler = self.shuffler.dataset, self.shuffler.sampler
        self.loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=args.batch_size, sampler=self.sampler
        )
        self.row: dict[str, list[float]] = {
            key: []
            for key in (
                "epoch_s",
                "cpu_s",
                "compacted_bytes",
                "collective_s",
                "shared_bytes",
                "busy_s",
                "wait_s",
                "set_epoch_s",
                "sent_bytes",
                "io_s",
                "hidden_s",
                "waited_s",
            )
        }

    def set_epoch(self, epoch: int) -> None:
        (self.shuffler or self.sampler).set_epoch(epoch)

    def record_exchange(self) -> None:
        """The exchange the last set_epoch committed (max over ranks; bytes summed)."""
        if self.shuffler is None:
            return
        done = self.shuffler.stats()
        stats = cl.allgather_object(done[-1] if done else {})
        self.row["busy_s"].append(max(s.get("busy_s", 0.0) for s in stats))  # {}: Q = 0
        self.row["wait_s"].append(max(s.get("wait_s", 0.0) for s in stats))
        self.row["set_epoch_s"].append(max(s.get("set_epoch_s", 0.0) for s in stats))
        self.row["sent_bytes"].append(sum(s.get("sent_bytes", 0) for s in stats))
        self.row["compacted_bytes"].append(max(s.get("compacted_bytes", 0) for s in stats))
        for key in ("io_s", "hidden_s", "waited_s"):
            self.row[key].append(max(s.get(key, 0.0) for s in stats))


_THREADS = {"MainThread": "train", "commlayer-engine": "engine", "commlayer-shuffle-io": "io"}


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads by role (training, the engine, the
    shufflers' I/O threads, the rest: torch's, MPI's), from /proc/self/task/<tid>/stat."""
    threads = threading.enumerate()  # ThreadPoolExecutor names its thread PREFIX_0
    roles = {t.native_id: _THREADS.get(t.name.split("_")[0], "other") for t in threads}
    cpu = dict.fromkeys(("train", "engine", "io", "other"), 0.0)
    for task in Path("/proc/self/task").iterdir():
        got = procstat.read(task / "stat")
        if got is not None:  # None: the thread ended
            cpu[roles.get(int(task.name), "other")] += got[1]
    return cpu


def run_epoch(st: Strategy, epoch: int, model: nn.Module, optimizer: Any, record: bool) -> None:
    """One epoch of ``st``: its time (slowest rank, from set_epoch, which commits the previous
    epoch's exchange, to the end of join), collective time and shared bytes."""
    read0 = getattr(st.dataset, "bytes_read", 0)
    cl.barrier()
    collective0 = cl.communication_stats()["collective_s"]
    cpu0 = time.process_time()  # every thread of this rank: training, engine, I/O
    threads0 = thread_cpu()
    t0 = time.perf_counter()
    st.set_epoch(epoch)
    for x, y in st.loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    cl.join()
    mine = (
        time.perf_counter() - t0,
        cl.communication_stats()["collective_s"] - collective0,
        getattr(st.dataset, "bytes_read", 0) - read0,
        time.process_time() - cpu0,
        {k: v - threads0[k] for k, v in thread_cpu().items()},
    )
    everyone = cl.allgather_object(mine)
    if epoch > 0:
        st.record_exchange()  # epoch - 1's exchange, committed by this set_epoch
    if record:
        st.row["epoch_s"].append(max(e[0] for e in everyone))
        st.row["collective_s"].append(max(e[1] for e in everyone))
        st.row["shared_bytes"].append(sum(e[2] for e in everyone))
        st.row["cpu_s"].append(sum(e[3] for e in everyone))
        for role in everyone[0][4]:  # summed over ranks, like cpu_s
            st.row.setdefault(f"cpu_{role}_s", []).append(sum(e[4][role] for e in everyone))


def run_io(args: argparse.Namespace) -> dict[str, Any]:
    """Every strategy runs its epoch e before any runs e + 1 (interleaved: load from other
    jobs drifts over minutes, so each epoch is compared with the same epoch of Q = 0 run
    seconds apart). Epoch 0 (warm-up) is left out."""
    root = Path(args.dir)
    shared = root / "shared"
    data = synthetic(args.samples)
    if cl.rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        shared.mkdir(parents=True)
        for i, sample in enumerate(data):
            (shared / f"{i}.pkl").write_bytes(pickle.dumps(sample, protocol=5))
    cl.barrier()
    sample_bytes = (shared / "0.pkl").stat().st_size
    fractions = [
        str(float(q.partition(":")[0])) + (f":{q.partition(':')[2]}" if ":" in q else "")
        for q in args.fractions
    ]
    if args.dirs:
        names = [f"{q}@{label}" for label, _ in args.dirs for q in fractions]
        if cl.rank() == 0:
            for _, folder in args.dirs:
                shutil.rmtree(folder, ignore_errors=True)
    else:
        names = fractions
    names = names if args.no_global else ["global"] + names
    strategies = [Strategy(name, data, root, args) for name in names]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(3072, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)
    )
    optimizer = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    for epoch in range(args.epochs + 1):
        # a new order each epoch (the same on every rank): no strategy always runs first
        for st in random.Random(epoch).sample(strategies, len(strategies)):
            run_epoch(st, epoch, model, optimizer, record=epoch > 0)
        if cl.rank() == 0 and epoch > 0:
            times = " ".join(f"{st.name}={st.row['epoch_s'][-1]:.3f}" for st in strategies)
            print(f"epoch {epoch}: {times}", flush=True)
    for st in strategies:  # commit the last exchange: its stats
        st.set_epoch(args.epochs + 1)
        st.record_exchange()
    cl.barrier()
    if cl.rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        for _, folder in args.dirs:
            shutil.rmtree(folder, ignore_errors=True)
    return {
        "rows": {st.name: st.row for st in strategies},
        "sample_bytes": sample_bytes,
        "interleaved": True,
    }


# -- report ---------------------------------------------------------------------------------------
def header(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "OMP_NUM_THREADS=1 mpiexec -n "
        f"{cl.size()} python benchmarks/shuffle.py " + " ".join(sys.argv[1:]),
        "ranks": cl.size(),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}",
        "load_before": os.getloadavg()[0],
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "args": vars(args),
    }


def report(paths: list[str], out: str, notes: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["# Partial-local shuffling (issues 24 and 40)", ""]
    lines += [
        "Produced by `benchmarks/shuffle.py` (its docstring says what each part measures); "
        "each section gives the exact command, and the raw numbers are in the .json beside it.",
        "",
    ]
    for path in paths:
        result = json.loads(Path(path).read_text())
        meta = result["meta"]
        lines += [
            f"## {meta['args']['part']}: {meta['ranks']} ranks"
            + (
                f", {meta['args'].get('dataset', 'digits')}"
                if "curves" in result
                else ", stores under "
                + (
                    ", ".join(f"{path} ({label})" for label, path in meta["args"]["dirs"])
                    if meta["args"].get("dirs")
                    else meta["args"]["dir"]
                )
                + f", {meta['args'].get('chunks', 8)} chunks (Q:K: K chunks)"
                + (
                    ", namespace cluster (HTTP shared folder)"
                    if meta["args"].get("shared_url")
                    else ""
                )
            ),
            "",
            f"- date: {meta['date']}; commit {meta['commit']}; machine {meta['machine']}; "
            f"load average before the run {meta['load_before']:.2f} (other jobs share the cores)",
            f"- command: `{meta['command']}`",
            f"- raw numbers: `{Path(path).name}`",
            "",
        ]
        if "curves" in result:
            lines += accuracy_table(result, meta)
            png = Path(out).with_name(Path(path).stem + ".png")
            plot_curves(result, meta, png, plt)
            lines += ["", f"![accuracy curves]({png.name})", ""]
        else:
            lines += io_table(result, meta) + [""]
    results = [json.loads(Path(path).read_text()) for path in paths]
    io_runs = [r for r in results if "rows" in r and any("@" in k for k in r["rows"])]
    if io_runs:
        accuracy = next((r for r in results if "curves" in r), None)
        png = Path(out).with_suffix(".png")
        plot_against_q(io_runs[-1], accuracy, png, plt)
        lines += [f"![epoch time and accuracy against Q]({png.name})", ""]
    if notes:
        lines += ["", Path(notes).read_text().rstrip()]
    Path(out).write_text("\n".join(lines) + "\n")


def accuracy_table(result: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    a = meta["args"]
    lines = [
        f"{a['epochs']} epochs, batch {a['batch_size']} per rank, SGD lr {a['lr']} momentum 0.9, "
        f"seeds 0..{a['seeds'] - 1}. Test accuracy (mean over ranks' models) in %:",
        "",
        "| strategy | final, mean over seeds | min..max over seeds | best epoch (mean) | "
        "vs global (final) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    curves = result["curves"]
    global_final = statistics.mean(c[-1] for c in curves["global"]) * 100
    for strategy, runs in curves.items():
        finals = [c[-1] * 100 for c in runs]
        mean_curve = np.mean(np.array(runs), axis=0) * 100
        name = "global (DistributedSampler)" if strategy == "global" else f"Q = {strategy}"
        lines.append(
            f"| {name} | {statistics.mean(finals):.2f} | {min(finals):.2f}..{max(finals):.2f} | "
            f"{mean_curve.max():.2f} | {statistics.mean(finals) - global_final:+.2f} |"
        )
    return lines


def plot_curves(result: dict[str, Any], meta: dict[str, Any], png: Path, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy, runs in result["curves"].items():
        curves = np.array(runs) * 100
        label = "global (DistributedSampler)" if strategy == "global" else f"Q = {strategy}"
        style = "k--" if strategy == "global" else "-"
        epochs = range(1, curves.shape[1] + 1)
        (line,) = ax.plot(epochs, curves.mean(axis=0), style, label=label)
        ax.fill_between(
            epochs, curves.min(axis=0), curves.max(axis=0), color=line.get_color(), alpha=0.12
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy, %: mean over ranks and seeds\n(band: min..max over seeds)")
    a = meta["args"]
    dataset = (
        f"Fashion-MNIST ({a['train_samples']} training images)"
        if a.get("dataset") == "fashion"
        else "digits (1437 training images)"
    )
    ax.set_title(f"{dataset}, shards sorted by class, {meta['ranks']} ranks")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot_against_q(
    io_run: dict[str, Any], accuracy: dict[str, Any] | None, png: Path, plt: Any
) -> None:
    """Epoch time over local shuffling's (paired, per storage) and final accuracy, against Q."""
    rows = io_run["rows"]
    labels = list(dict.fromkeys(k.partition("@")[2] for k in rows if "@" in k))
    panels = 2 if accuracy else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    for n, label in enumerate(labels):
        qs = [k.partition("@")[0] for k in rows if k.endswith(f"@{label}") and ":" not in k]
        local = rows[f"0.0@{label}"]["epoch_s"]
        med, low, high = [], [], []
        for q in qs:
            times = rows[f"{q}@{label}"]["epoch_s"]
            ratios = [(t / t0 - 1) * 100 for t, t0 in zip(times, local)]
            m = statistics.median(ratios)
            quartiles = statistics.quantiles(ratios, n=4)
            med.append(m)
            low.append(m - quartiles[0])
            high.append(quartiles[2] - m)
        x = [i + (n - (len(labels) - 1) / 2) * 0.12 for i in range(len(qs))]
        ax.errorbar(x, med, yerr=[low, high], fmt="o-", capsize=4, label=f"stores on {label}")
        ax.set_xticks(range(len(qs)), [f"{float(q):g}" for q in qs])
    ax.axhline(0, color="k", lw=0.8)
    ax.axhspan(-5, 5, color="g", alpha=0.08, label="target: within 5% of local")
    ax.set_xlabel("Q (fraction exchanged per epoch)")
    ax.set_ylabel("epoch time vs local shuffling (Q = 0), %\npaired per epoch: median, quartiles")
    ax.set_title(f"{io_run['meta']['ranks']} ranks, {io_run['meta']['args']['samples']} samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if accuracy:
        ax = axes[0][1]
        curves = accuracy["curves"]
        qs = [q for q in curves if q != "global"]
        finals = [[c[-1] * 100 for c in curves[q]] for q in qs]
        means = [statistics.mean(f) for f in finals]
        ax.errorbar(
            range(len(qs)),
            means,
            yerr=[
                [m - min(f) for m, f in zip(means, finals)],
                [max(f) - m for m, f in zip(means, finals)],
            ],
            fmt="o-",
            capsize=4,
            label="partial-local",
        )
        if "global" in curves:
            ax.axhline(
                statistics.mean(c[-1] * 100 for c in curves["global"]),
                color="k",
                ls="--",
                label="global (DistributedSampler)",
            )
        ax.set_xticks(range(len(qs)), [f"{float(q):g}" for q in qs])
        ax.set_xlabel("Q (fraction exchanged per epoch)")
        ax.set_ylabel("final test accuracy, %: mean, min..max over seeds")
        a = accuracy["meta"]["args"]
        ax.set_title(
            f"{a.get('dataset', 'digits')}, class-sorted shards ({accuracy['meta']['date']})"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def io_table(result: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    a = meta["args"]
    shared = (
        f"served over HTTP from {a['shared_url']} (a storage host of the namespace cluster)"
        if a.get("shared_url")
        else f"{a['shared_mbps']} Mbit/s shared by the ranks + {a['shared_latency_ms']} ms per "
        "file (throttled reader)"
    )
    lines = [
        f"{a['samples']} samples of {result['sample_bytes']} B, batch {a['batch_size']} per rank, "
        f"MLP 3072-{a['hidden']}-10, {a['epochs']} epochs per strategy after a warm-up epoch, "
        "strategies interleaved epoch by epoch. Shared storage: "
        f"{shared}. Epoch times are the slowest rank's; 'paired' is each epoch's time over "
        "Q = 0's (on the same storage) in the same epoch (run seconds apart), median and "
        "min..max over epochs; "
        "exchange busy/wait and set_epoch (vote, commit, next plan): the most of any rank, "
        "per epoch (median). CPU: the processor time of every rank's process (all its threads) "
        "in the epoch, summed, paired with Q = 0's like the epoch time: on a machine with more "
        "ranks and threads than cores, where the exchange's hidden work still takes cores from "
        "the others, the steadier measure of what it costs.",
        "",
        "| strategy | epoch s, median | min..max | paired vs Q = 0, median | min..max | "
        "shared storage read / epoch | exchanged / epoch | collectives s / epoch | "
        "exchange busy s | exchange wait s | set_epoch s | I/O thread s | of it hidden s | "
        "CPU paired vs Q = 0, median | min..max | compacted / epoch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: |",
    ]
    rows = result["rows"]
    for strategy, row in rows.items():
        times = row["epoch_s"]
        label = strategy.partition("@")[2]
        local = rows.get("0.0" + (f"@{label}" if label else ""), {}).get("epoch_s")
        ratios = [t / q - 1 for t, q in zip(times, local)] if local else []
        paired = _paired(ratios)
        cpu_local = rows.get("0.0" + (f"@{label}" if label else ""), {}).get("cpu_s")
        cpu = row.get("cpu_s")
        cpu_paired = _paired(
            [t / q - 1 for t, q in zip(cpu, cpu_local)] if cpu and cpu_local else []
        )
        name = "global (shared folder)" if strategy == "global" else f"Q = {strategy}"
        name = name.replace("@", ", stores on ")

        def med(key: str, row: dict[str, Any] = row) -> float:
            return statistics.median(row.get(key) or [0.0])

        lines.append(
            f"| {name} | {statistics.median(times):.3f} | {min(times):.3f}..{max(times):.3f} | "
            f"{paired} | {med('shared_bytes') / 1e6:.2f} MB | {med('sent_bytes') / 1e6:.2f} MB | "
            f"{med('collective_s'):.3f} | {med('busy_s'):.3f} | {med('wait_s'):.3f} | "
            f"{med('set_epoch_s'):.3f} | {med('io_s'):.3f} | {med('hidden_s'):.3f} | "
            f"{cpu_paired} | {med('compacted_bytes') / 1e6:.2f} MB |"
        )
    return lines


def _paired(ratios: list[float]) -> str:
    if not ratios:
        return "n/a | n/a"
    return (
        f"{statistics.median(ratios) * 100:+.1f}% | "
        f"{min(ratios) * 100:+.1f}..{max(ratios) * 100:+.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["accuracy", "io", "report", "serve"])
    parser.add_argument("inputs", nargs="*", help="report: the .json files")
    parser.add_argument("--out", help="where the .json (report: the .md) goes; not for serve")
    parser.add_argument("--port", type=int, default=8000, help="serve: the port")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dataset", choices=["digits", "fashion"], default="digits")
    parser.add_argument("--train-samples", type=int, default=12000)
    parser.add_argument("--test-samples", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=2, help="io: collectives per exchange")
    parser.add_argument(
        "--fractions",
        nargs="*",
        default=["0.0", "0.1", "0.3", "1.0"],
        help="io: the Qs; Q:K runs Q with K chunks (a strategy of its own)",
    )
    parser.add_argument("--shared-mbps", type=float, default=400.0)
    parser.add_argument("--shared-latency-ms", type=float, default=0.5)
    parser.add_argument("--shared-url", help="io: read global's samples over HTTP from here")
    parser.add_argument("--notes", help="report: a markdown file appended (the reading)")
    parser.add_argument("--dir", default=tempfile.gettempdir() + "/commlayer-shuffle-bench")
    parser.add_argument(
        "--dirs",
        nargs="*",
        default=[],
        type=lambda text: tuple(text.split("=", 1)),
        help="io: LABEL=FOLDER ...: every fraction's stores under each folder, strategies "
        "named Q@LABEL, all interleaved in one run (e.g. tmpfs=/dev/shm/x ext4=/var/tmp/x)",
    )
    parser.add_argument("--no-global", action="store_true", help="io: leave global out")
    args = parser.parse_intermixed_args()
    if args.part == "serve":
        serve(str(Path(args.dir) / "shared"), args.port)
        return
    if not args.out:
        parser.error(f"{args.part} needs --out")
    if args.part == "report":
        report(args.inputs, args.out, args.notes)
        return
    args.epochs = args.epochs or (15 if args.part == "accuracy" else 5)
    cl.init()
    meta = header(args)
    result = run_accuracy(args) if args.part == "accuracy" else run_io(args)
    if cl.rank() == 0:
        Path(args.out).write_text(json.dumps({"meta": meta, **result}, indent=1))
    cl.shutdown()


if __name__ == "__main__":
    main()
