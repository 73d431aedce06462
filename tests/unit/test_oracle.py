"""The oracle: input parsing and its errors, each strategy's formulas against hand-computed
cases (ParaDL's and commlayer's), the memory limits, and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from commlayer import cli, costmodel, oracle
from commlayer.common.errors import SpecError
from commlayer.oracle import model, paradl, report
from commlayer.oracle.network import Compression, Network

PARADL_DATA = Path(__file__).resolve().parents[2] / "data" / "paradl"  # ParaDL's inputs

# A tiny CNN: a 3x3 conv on 8x8, ReLU, a 2x2 pool, an FC to 10; t measured on the first line.
NET = """Dataset|Toy
Input|1000x2x8x8
Model|Toy
# a comment line
CONV1|2x8x8|2x4x3x3|4x8x8|0.001
RELU|4x8x8|4x4x0x0|4x8x8|0
MPOOL|4x8x8|0x0x2x2|4x4x4|0
FC2|4x4x4|4x10x4x4|10x1x1|0
"""
PLAT = """MEM_PER_NODE|1e6|Bytes
NODE_SPEED|1e12|FLOPS
BANDWIDTH|1e9|Bps
LATENCY|1e-6|second
MAX_NODE|16|GPUs
GPU_PER_NODE|2|GPUs
"""
LC = "0 CONV1 |1\n1 RELU |0\n2 MPOOL |0\n3 FC2 |0\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name, text in (("toy.net", NET), ("toy.plat", PLAT), ("toy.lc", LC)):
        paths[name] = tmp_path / name
        paths[name].write_text(text.replace("\n", "\r\n"))  # ParaDL's files have CRLF
    return paths


@pytest.fixture
def net(files: dict[str, Path]) -> oracle.Net:
    return oracle.parse_net(files["toy.net"])


@pytest.fixture
def plat(files: dict[str, Path]) -> oracle.Platform:
    return oracle.parse_plat(files["toy.plat"])


# -- parsing ------------------------------------------------------------------------------------
def test_parse_net(net: oracle.Net) -> None:
    assert (net.dataset, net.samples, net.sample, net.model) == ("Toy", 1000, (2, 8, 8), "Toy")
    assert [la.kind for la in net.layers] == ["CONV", "RELU", "MPOOL", "FC"]
    conv = net.layers[0]
    assert (conv.in_items, conv.weight_items, conv.out_items, conv.kernel) == (128, 72, 256, 3)
    # ParaDL's FLOPs: forward 2 C F K^2 W H, twice for backward, plus |w|
    assert conv.flops() == 2 * (2 * 2 * 4 * 9 * 64) + 72
    assert net.layers[1].flops() == 2 * 256  # RELU: |y|, no weights (4x4x0x0)
    assert net.layers[2].flops() == 2 * (4 * 4 * 4 * 16)  # pooling as ParaDL writes it
    assert net.layers[3].flops() == 2 * 640 + 640  # FC: |w|
    assert net.activation_items() == (128 + 256 + 64, 256 + 64 + 10)  # RELU left out


def test_layer_times_spread_by_flops(net: oracle.Net) -> None:
    times = net.layer_times_s(1e12)
    flops = [la.flops() for la in net.layers]
    assert sum(times) == pytest.approx(0.001)  # the file's measured total
    assert times[0] / times[3] == pytest.approx(flops[0] / flops[3])
    # a profall file (one measured line) is spread by FLOPs in commlayer's model too
    assert net.layer_times_s(1e12, per_layer=True) == times
    # a per-layer profile keeps each layer's own time (ParaDL's rule still spreads the sum)
    layers = [dataclasses.replace(la, t_s=t) for la, t in zip(net.layers, (1e-3, 0, 0, 3e-3))]
    profiled = dataclasses.replace(net, layers=tuple(layers))
    assert profiled.layer_times_s(1e12, per_layer=True) == [1e-3, 0, 0, 3e-3]
    assert sum(profiled.layer_times_s(1e12)) == pytest.approx(4e-3)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("Dataset|D\nInput|10x3x8x8\nModel|M\nCONV1|3x8x8|3x4x3x3\n", 4, "4 or 5 fields"),
        ("Dataset|D\nInput|10x3x8x8\nModel|M\nCONV1|3x8x8|3x4x3|4x8x8\n", 4, "one size more"),
        ("Dataset|D\nInput|10x3x8x8\nModel|M\nCONV1|3xAx8|3x4x3x3|4x8x8\n", 4, "not integers"),
        ("Dataset|D\nInput|10x3x8x8\nModel|M\nCONV1|3x8x8|3x4x3x3|4x8x8|fast\n", 4, "not a num"),
        ("Dataset|D\nShape|10x3x8x8\nModel|M\n", 2, "expected 'Input|...'"),
    ],
)
def test_malformed_net_names_file_and_line(
    tmp_path: Path, text: str, line: int, words: str
) -> None:
    path = tmp_path / "bad.net"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"bad.net:{line}: .*{words}"):
        oracle.parse_net(path)


def test_net_without_layers_or_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.net"
    path.write_text("Dataset|D\nInput|10x3x8x8\nModel|M\n")
    with pytest.raises(SpecError, match="no layer lines"):
        oracle.parse_net(path)
    with pytest.raises(SpecError, match="cannot read"):
        oracle.parse_net(tmp_path / "missing.net")


def test_parse_plat(plat: oracle.Platform) -> None:
    assert plat.mem_per_gpu_bytes == 1e6 and plat.gpus_per_node == 2 and plat.max_gpus == 16
    assert plat.intra_bandwidth_bytes_s is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (PLAT + "SPEED_OF_LIGHT|3e8\n", r"toy.plat:7: unknown key 'SPEED_OF_LIGHT'"),
        (PLAT.replace("1e9", "fast"), r"toy.plat:3: BANDWIDTH 'fast' is not a number"),
        (PLAT.replace("MAX_NODE|16|GPUs\n", ""), "missing MAX_NODE"),
        (PLAT + "LATENCY|2e-6\n", "toy.plat:7: LATENCY given twice"),
        (PLAT.replace("1e12", "0"), "NODE_SPEED must be > 0"),
    ],
)
def test_malformed_plat(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "toy.plat"
    path.write_text(text)
    with pytest.raises(SpecError, match=match):
        oracle.parse_plat(path)


def test_parse_lc(files: dict[str, Path], net: oracle.Net, tmp_path: Path) -> None:
    assert oracle.parse_lc(files["toy.lc"], net) == (True, False, False, False)
    short = tmp_path / "short.lc"
    short.write_text("CONV1|1\nRELU|0\n")
    with pytest.raises(SpecError, match="2 entries for 4 layers"):
        oracle.parse_lc(short, net)
    wrong = tmp_path / "wrong.lc"
    wrong.write_text("CONV1|1\nBNORM|0\nMPOOL|0\nFC2|0\n")
    with pytest.raises(SpecError, match=r"wrong.lc:2: entry 1 names 'BNORM' but layer 1 .* 'RELU'"):
        oracle.parse_lc(wrong, net)
    bad = tmp_path / "bad.lc"
    bad.write_text("CONV1|yes\n")
    with pytest.raises(SpecError, match=r"bad.lc:1: a mask line is NAME\|0 or NAME\|1"):
        oracle.parse_lc(bad, net)


def test_strategy_and_gpu_arguments() -> None:
    assert oracle.strategy_names("d,ds,filter") == ["data", "data+spatial", "filter"]
    assert "single" not in oracle.strategy_names("all")
    assert len(oracle.strategy_names("all")) == 7
    with pytest.raises(ValueError, match="unknown strategy 'x'"):
        oracle.strategy_names("d,x")
    assert oracle.gpu_counts("1-1024") == [2**i for i in range(11)]
    assert oracle.gpu_counts("3-20") == [4, 8, 16]
    assert oracle.gpu_counts("1,3,6") == [1, 3, 6]
    with pytest.raises(ValueError, match="--gpus"):
        oracle.gpu_counts("8-2")


# -- ParaDL's model -----------------------------------------------------------------------------
def _paradl(net: oracle.Net, plat: oracle.Platform, names: list[str], **kw: object) -> dict:
    mask = kw.pop("mask", oracle.full_mask(net))
    rows = paradl.predict(net, plat, names, mask, **kw)  # type: ignore[arg-type]
    return {(r.case, r.p): r for r in rows}


def test_paradl_links() -> None:
    links = paradl.AbciLinks()
    assert links.factor(4) == (50e9, 9e-6)  # NVLink
    assert links.factor(8) == (12.5e9, pytest.approx(2 * 20.11e-6 + 90e-9))  # leaf switch
    assert links.factor(128)[1] == pytest.approx(2 * 20.11e-6 + 270e-9)  # in a rack
    assert links.factor(1024)[1] == pytest.approx(2 * 20.11e-6 + 760e-9)  # across the spine
    assert links.factor(4, gpudirect=False) == (16e9, pytest.approx(3e-3 + 110e-9))


def test_paradl_data(net: oracle.Net, plat: oracle.Platform) -> None:
    rows = _paradl(net, plat, ["data"], max_gpus=8, batch_per_gpu=4, max_batch=1e9)
    assert sorted(p for _, p in rows) == [2, 4, 8]  # ParaDL starts at 2
    r = rows[("data", 8)]
    w, x, y = 72 + 640, 448, 330
    bw, lat = paradl.AbciLinks().factor(8)
    assert r.B == 32 and r.mem_bytes == 2 * (4 * (x + y) + w) * 4
    assert r.tcomm_s == pytest.approx(2 * math.ceil(1000 / 32) * 7 * (lat + 4 * w / bw / 8))
    assert r.tcomp_s == pytest.approx(math.ceil(1000 / 8) * 0.001)
    assert r.cost_gpu_min == 8 * math.ceil(r.time_s / 60)


def test_paradl_filter_and_channel(net: oracle.Net, plat: oracle.Platform) -> None:
    mask = (True, False, False, False)
    rows = _paradl(
        net, plat, ["filter", "channel"], max_gpus=4, batch_per_gpu=4, max_batch=1e9, mask=mask
    )
    # filter: up to the fewest filters of split layers (4); channel: split layers after the
    # first only, none here, so no cap (1e9) but the GPUs (4)
    assert {c for c, _ in rows} == {"filter1", "filter3", "chan1", "chan3"}
    r = rows[("filter3", 2)]
    times = net.layer_times_s(1e12)
    w_f = 72 / 2 + 640  # split layer's weights divided by p ...
    assert r.mem_bytes == 2 * (4 * (448 + 330) + w_f / 2) * 4  # ... and again (ParaDL's)
    bw, lat = paradl.AbciLinks().factor(2)
    one = math.ceil(1000 / 4) * 1 * (lat * 1 + 4 * 256 * 4 / bw / 2)  # the CONV's output
    assert r.tcomm_s == pytest.approx(3 * one)
    assert r.tcomp_s == pytest.approx(math.ceil(1000 / 4) * 4 * (times[0] / 2 + sum(times[1:])))
    assert rows[("chan3", 2)].tcomm_s == pytest.approx(r.tcomm_s)


def test_paradl_filter_drops_rows_over_memory(net: oracle.Net, plat: oracle.Platform) -> None:
    # 2 (B (X + Y) + W) 4 > 1e6 bytes for B >= 160 samples: case 1 (B = b p) runs out first
    rows = _paradl(net, plat, ["filter"], max_gpus=4, batch_per_gpu=64, max_batch=1e9)
    assert ("filter1", 2) in rows and ("filter1", 4) not in rows and ("filter3", 4) in rows


def test_paradl_spatial_halo_uses_memory_bound(net: oracle.Net, plat: oracle.Platform) -> None:
    mask = (True, False, False, False)
    r = _paradl(net, plat, ["spatial"], max_gpus=2, batch_per_gpu=4, max_batch=1e9, mask=mask)[
        ("spatial", 2)
    ]
    x = math.ceil(128 / 2) + 256 + 256 + 64  # every layer counted, the split one halved
    y = math.ceil(256 / 2) + 256 + 64 + 10
    most = (1e6 / 4 / 2 - 712) / (x + y)
    bw, lat = paradl.AbciLinks().factor(2, gpudirect=False)
    iters = math.ceil(1000 / 4)
    halo = 2 * (lat + 8 * 1 * most * 4 / bw) + 2 * (lat + 8 * 1 * most * 4 / bw)
    gather = 2 * (2 - 1) * (lat + 4 * 256 * 4 / bw / 2)
    allreduce = 2 * (1000 / 4) * (2 - 1) * (lat + 712 * 4 / bw / 2)
    assert r.parts_s["halo"] == pytest.approx(halo * iters)
    assert r.tcomm_s == pytest.approx(halo * iters + gather * iters + allreduce)
    assert r.mem_bytes == 2 * (4 * (x + y) + 712) * 4


def test_paradl_hybrids(net: oracle.Net, plat: oracle.Platform) -> None:
    mask = (True, False, False, False)
    rows = _paradl(
        net,
        plat,
        ["data+filter", "data+spatial"],
        max_gpus=8,
        batch_per_gpu=4,
        max_batch=1e9,
        mask=mask,
    )
    assert sorted(p for c, p in rows if c == "df") == [2, 4, 8]  # from one node (2 GPUs)
    links = paradl.AbciLinks()
    df = rows[("df", 8)]
    p1, iters = 4, math.ceil(1000 / 16)
    bw, lat = links.factor(2)
    filt = 3 * iters * 1 * (lat * 1 + 4 * 256 * 4 / bw / 2)
    bw, lat = links.factor(8)
    data = 2 * iters * (p1 - 1) * (lat + 712 * 4 / (bw / 4) / p1)  # all W, at bw / (2 P2)
    assert df.B == 16 and df.tcomm_s == pytest.approx(filt + data)
    ds = rows[("ds", 8)]
    assert ds.B == 16
    # only the layers up to the split one: the CONV, halved
    assert ds.tcomp_s == pytest.approx(math.ceil(1000 / 4) * net.layer_times_s(1e12)[0] / 2)


def test_paradl_data_spatial_needs_batch(net: oracle.Net, plat: oracle.Platform) -> None:
    assert _paradl(net, plat, ["data+spatial"], max_gpus=8, max_batch=1e9) == {}


@pytest.mark.skipif(not PARADL_DATA.is_dir(), reason="ParaDL's inputs not here")
def test_paradl_reproduces_its_published_projection() -> None:
    """Rows of ParaDL's own script (python 2.7, parallel_analysis.py as published) for
    ResNet-50 on ABCI, --cmaxp 1024 --cmaxB 262144 --cBon 64 --lc spatial_resnet.lc."""
    net = oracle.parse_net(PARADL_DATA / "RESNET50_ImageNet_profall.net_sc")
    plat = oracle.parse_plat(PARADL_DATA / "ABCI.plat")
    mask = oracle.parse_lc(PARADL_DATA / "spatial_resnet.lc", net)
    rows = oracle.predict(net, plat, "all", [1024], 64, 262144, mask, paradl_model=True)
    got = {(r.case, r.p): (r.mem_bytes, r.tcomp_s, r.tcomm_s) for r in rows}
    published = {
        ("single", 1): (15434845696.0, 3992.96256, 0),
        ("data", 8): (15434845696.0, 499.12032, 33.2384724),
        ("data", 1024): (15434845696.0, 3.8993775, 1.9676128296),
        ("spatial", 4): (27294489600.0, 1150.44474057, 5019.51732935),
        ("filter3", 64): (15253269970.4, 262.157921995, 18469.0494576),
        ("chan3", 8): (15257607320.0, 676.691770662, 10609.8742512),
        ("df", 1024): (15310729600.0, 4.54425672524, 19.4024909069),
        ("ds", 16): (26932218880.0, 259.323676699, 1737.7456768),
    }
    for key, numbers in published.items():
        assert got[key] == pytest.approx(numbers, rel=1e-9), key
    assert len(rows) == 43


# -- commlayer's model --------------------------------------------------------------------------
def _setup(net: oracle.Net, plat: oracle.Platform, **kw: object) -> model.Setup:
    args: dict = dict(
        net=net,
        plat=plat,
        mask=(True, False, False, False),
        network=Network(plat),
        batch_per_gpu=4,
        max_batch=0.0,
        comp_s=tuple(net.layer_times_s(1e12)),
        fusion_bytes=64 << 20,
        overlap=True,
    )
    args.update(kw)
    return model.Setup(**args)


def test_network_from_platform(plat: oracle.Platform) -> None:
    network = Network(plat, algorithm="ring")
    # ring on 2 GPUs of one node: 2 steps of n / 2 at alpha + beta n (no local work in a .plat)
    assert network.allreduce_s(2_000_000, 2) == pytest.approx(2 * (1e-6 + 1e6 / 1e9), rel=5e-3)
    assert network.allgather_s(4e6, 4) == pytest.approx(3 * (1e-6 + 1e6 / 1e9), rel=5e-3)
    assert network.p2p_s(1e6, 2, inter=False) == pytest.approx(1e-6 + 1e6 / 1e9, rel=5e-3)
    assert network.allreduce_s(2_000_000, 1) == 0.0


def test_engine_op_latency(net: oracle.Net, plat: oracle.Platform) -> None:
    plain, slow = (
        Network(plat, algorithm="ring"),
        Network(plat, algorithm="ring", op_latency_s=1e-3),
    )
    assert slow.allreduce_s(4096, 2) == pytest.approx(plain.allreduce_s(4096, 2) + 1e-3)
    assert slow.allgather_s(4096, 2) == pytest.approx(plain.allgather_s(4096, 2) + 1e-3)
    spatial = [model.row(_setup(net, plat, network=n), "spatial", 2) for n in (plain, slow)]
    assert spatial[0] is not None and spatial[1] is not None
    # one split layer with a kernel: an alltoall forward and one backward, 250 iterations
    assert spatial[1].parts_s["halo"] - spatial[0].parts_s["halo"] == pytest.approx(250 * 2e-3)


def test_engine_op_latency_from_the_calibration(plat: oracle.Platform) -> None:
    # commlayer calibrate stores the engine's cost per call; the oracle adds it to every
    # collective of the ranks it measured, and to a calibration carried to other rank counts
    cal = costmodel.Calibration(
        size=2, nodes=1, alpha_s=1e-6, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0,
        copy_s_per_byte=0.0, native={}, exchange=[(1, 1e-6), (1 << 30, 1e-6 + 2**30 * 1e-9)],
        op_latency_s=2e-3,
    )  # fmt: skip
    measured, given = Network(plat, [cal], "ring"), Network(plat, [cal], "ring", op_latency_s=0.0)
    assert measured.op_latency(2) == measured.op_latency(4) == 2e-3
    assert measured.op_latency(1) == 0.0 and given.op_latency(2) == 0.0
    assert measured.allreduce_s(4096, 2) == pytest.approx(given.allreduce_s(4096, 2) + 2e-3)
    assert Network(plat, algorithm="ring").op_latency(2) == 0.0  # a platform file: none
    # a calibration file from before op_latency_s reads with 0
    raw = dataclasses.asdict(cal)
    del raw["op_latency_s"]
    assert costmodel.from_bytes(json.dumps([raw]).encode())[0].op_latency_s == 0.0


def test_compression_on_the_wire(plat: oracle.Platform) -> None:
    plain = Network(plat, algorithm="ring")
    half = Network(plat, algorithm="ring", compression=Compression.parse("fp16"))
    assert half.gradient_s(8_000_000, 2) == pytest.approx(plain.gradient_s(4_000_000, 2))
    topk = Network(plat, compression=Compression.parse("topk:ratio=0.01"))
    # 1% of 2e6 elements as (value, index) pairs, allgathered from 4 ranks
    assert topk.gradient_s(8_000_000, 4) == pytest.approx(topk.allgather_s(4 * 20_000 * 8, 4))
    with pytest.raises(ValueError, match="give its ratio"):
        Compression.parse("topk")
    with pytest.raises(ValueError, match="the oracle models"):
        Compression.parse("powersgd:rank=4")
    with pytest.raises(ValueError, match="algorithm 'fastest'"):
        Network(plat, algorithm="fastest")


def test_overlap_buckets() -> None:
    def cost(n: int) -> float:
        return n * 1e-3

    # three layers (last first), ready at 1, 2, 3 s with 1000 B each; buckets of 1000 B
    layers = [(1.0, 1000), (2.0, 1000), (3.0, 1000)]
    assert model.exposed_gradient_s(layers, cost, 1000, overlap=True) == (3.0, 2.0)
    assert model.exposed_gradient_s(layers, cost, 1000, overlap=False) == (3.0, 0.0)
    # one bucket for all: sent after backward, nothing hidden
    assert model.exposed_gradient_s(layers, cost, 1 << 20, overlap=True) == (3.0, 0.0)


def test_buckets_queued_behind_one_in_flight_go_out_fused() -> None:
    def cost(n: int) -> float:  # a per-call cost and a rate
        return 0.5 + n * 1e-4

    # four 1000 B buckets ready at 0, 0.1, 0.2, 0.3 s: the first alone (0-0.6 s), the three
    # queued behind it as one collective (0.6-1.4 s): 0.5 s of per-call cost paid twice, not 4x
    layers = [(0.0, 1000), (0.1, 1000), (0.2, 1000), (0.3, 1000)]
    total, hidden = model.exposed_gradient_s(layers, cost, 1000, overlap=True)
    assert total == pytest.approx(0.6 + 0.8) and hidden == pytest.approx(0.3)
    assert model.exposed_gradient_s(layers, cost, 1000, overlap=False) == (
        pytest.approx(1.4), 0.0)  # fmt: skip


def test_model_data_and_memory_limit(net: oracle.Net, plat: oracle.Platform) -> None:
    s = _setup(net, plat)
    r = model.row(s, "data", 2)
    assert r is not None and r.B == 8 and r.iterations == 125
    assert r.mem_bytes == 2 * 4 * (4 * 778 + 712) and r.fits
    assert r.tcomp_s == pytest.approx(125 * 4 * 0.001)
    big = model.row(_setup(net, plat, batch_per_gpu=256), "data", 2)
    assert big is not None and not big.fits  # 2 x 4 x (256 x 778 + 712) > 1e6: listed, not fit
    assert model.row(_setup(net, plat, max_batch=4.0), "data", 2) is None


def test_model_filter_channel_spatial(net: oracle.Net, plat: oracle.Platform) -> None:
    s = _setup(net, plat)
    network = s.network
    times = s.comp_s
    f = model.row(s, "filter", 2)
    assert f is not None and f.B == 4
    assert f.tcomp_s == pytest.approx(250 * 4 * (times[0] / 2 + sum(times[1:])))
    # the CONV's output allgathered forward; no input gradient for the first layer
    assert f.tcomm_s == pytest.approx(250 * network.allgather_s(4 * 256 * 4, 2))
    assert f.mem_bytes == 2 * 4 * (4 * 778 + 72 / 2 + 640)
    c = model.row(s, "channel", 2)
    assert c is not None and c.tcomm_s == pytest.approx(250 * network.allreduce_s(4096, 2))
    assert model.row(s, "filter", 8) is None  # more GPUs than the CONV's 4 filters
    sp = model.row(s, "spatial", 2)
    assert sp is not None
    halo = 2 * 2 * network.p2p_s(2 * 8 * 1 * 4 * 4, 2, False)  # C x H x (K-1)//2 x b x 4
    assert sp.parts_s["halo"] == pytest.approx(250 * halo)
    assert sp.parts_s["gradient allreduce"] == pytest.approx(250 * network.gradient_s(288, 2))


def test_model_pipeline(net: oracle.Net, plat: oracle.Platform) -> None:
    assert model.stages([1.0, 1.0, 1.0, 1.0], 2) == [(0, 2), (2, 4)]
    assert model.stages([3.0, 1.0, 1.0, 1.0], 2) == [(0, 1), (1, 4)]
    assert model.stages([1.0, 2.0], 3) is None
    s = _setup(net, plat)
    r = model.row(s, "pipeline", 2)
    assert r is not None and r.B == 8  # b p, in m = 4 p = 8 micro-batches of 1
    first, rest = s.comp_s[0], sum(s.comp_s[1:])
    slot = max(first + 2 * s.network.p2p_s(256 * 4, 2, False), rest)
    assert r.time_s == pytest.approx(125 * (8 + 2 - 1) * slot)


def test_model_hybrids_need_whole_nodes(net: oracle.Net, plat: oracle.Platform) -> None:
    s = _setup(net, plat)
    assert model.row(s, "data+filter", 1) is None and model.row(s, "data+spatial", 3) is None
    r = model.row(s, "data+filter", 4)
    assert r is not None and r.B == 8  # 2 nodes of 2 GPUs: b x P1


def test_model_hybrid_formulas(net: oracle.Net, plat: oracle.Platform) -> None:
    s = _setup(net, plat)
    network, times = s.network, s.comp_s
    # 4 GPUs = 2 nodes x 2: the split CONV among a node's 2 GPUs, data across the 2 nodes
    df = model.row(s, "data+filter", 4)
    assert df is not None and df.iterations == 125  # B = 4 x 2
    assert df.tcomp_s == pytest.approx(125 * 4 * (times[0] / 2 + sum(times[1:])))
    # inside the node: the CONV's output (4 x 256 items x 4 B) allgathered, as filter on 2
    assert df.parts_s["allgather"] == pytest.approx(125 * network.allgather_s(4096, 2, 1))
    # across nodes: the node's whole gradient (712 items), its 2 shards' flows on one link
    assert df.parts_s["gradient allreduce"] == pytest.approx(
        125 * network.gradient_s(712 * 4, 2, 2)
    )
    assert df.mem_bytes == 2 * 4 * (4 * 778 + 72 / 2 + 640)
    ds = model.row(s, "data+spatial", 4)
    assert ds is not None and ds.iterations == 125
    halo = 2 * 2 * network.p2p_s(2 * 8 * 1 * 4 * 4, 2, False)  # as spatial on one node's 2
    assert ds.parts_s["halo"] == pytest.approx(125 * halo)
    assert ds.parts_s["allgather"] == pytest.approx(125 * network.allgather_s(4096, 2, 1))
    # every weight's gradient allreduced over all 4 GPUs (the replicated layers' too)
    assert ds.parts_s["gradient allreduce"] == pytest.approx(125 * network.gradient_s(712 * 4, 4))
    # the split CONV's activations (128 + 256 items) halved, the others whole
    assert ds.mem_bytes == 2 * 4 * (4 * (384 / 2 + 320 + 74) + 712)


def test_model_spatial_and_pipeline_memory(net: oracle.Net, plat: oracle.Platform) -> None:
    s = _setup(net, plat)
    sp = model.row(s, "spatial", 2)
    assert sp is not None and sp.mem_bytes == 2 * 4 * (4 * (384 / 2 + 320 + 74) + 712)
    assert model.row(s, "spatial", 16) is None  # wider than the CONV's 8 columns
    pipe = model.row(s, "pipeline", 2)
    # stages [CONV1] and [RELU, MPOOL, FC2]: the larger holds B = 8 samples of 320 + 74
    # items (RELU in place) and the FC's 640 weights
    assert pipe is not None and pipe.mem_bytes == 2 * 4 * (8 * (320 + 74) + 640)
    small = dataclasses.replace(plat, mem_per_gpu_bytes=pipe.mem_bytes - 1)
    tight = model.row(_setup(net, small), "pipeline", 2)
    assert tight is not None and not tight.fits  # listed, marked as not fitting


def test_model_ranks_sharing_cores(files: dict[str, Path], net: oracle.Net) -> None:
    path = files["toy.plat"]
    path.write_text(
        PLAT.replace("GPU_PER_NODE|2|GPUs", "GPU_PER_NODE|4|GPUs") + "CORES_PER_NODE|2\n"
    )
    cpu = oracle.parse_plat(path)
    assert cpu.cores_per_node == 2
    assert [cpu.ranks_per_core(p) for p in (1, 2, 3, 4, 8)] == [1, 1, 1.5, 2, 2]
    gpu = dataclasses.replace(cpu, cores_per_node=None)
    mask = (True, True, True, True)
    for p, shared in ((2, 1.0), (4, 2.0)):
        rows = [model.row(_setup(net, pl, mask=mask), "data", p) for pl in (gpu, cpu)]
        assert rows[0] is not None and rows[1] is not None
        assert rows[1].tcomp_s == pytest.approx(shared * rows[0].tcomp_s)
        assert rows[1].tcomm_s == pytest.approx(rows[0].tcomm_s)
        # one rank per core: overlap as on GPUs; more: the engine's work adds to the step
        assert rows[1].hidden_s == (rows[0].hidden_s if shared == 1 else 0.0)
    path.write_text(PLAT + "CORES_PER_NODE|0\n")
    with pytest.raises(SpecError, match="CORES_PER_NODE must be >= 1"):
        oracle.parse_plat(path)


def test_predict_rows_and_json(net: oracle.Net, plat: oracle.Platform) -> None:
    rows = oracle.predict(
        net, plat, "all", [1, 2, 4], batch_per_gpu=4, mask=(True, False, False, False)
    )
    assert {r.strategy for r in rows} == {
        "data",
        "spatial",
        "filter",
        "channel",
        "pipeline",
        "data+filter",
        "data+spatial",
    }
    line = json.loads(report.json_lines(rows[:1]))
    for key in ("strategy", "B", "p", "mem_bytes", "tcomp_s", "tcomm_s", "time_s", "fits"):
        assert key in line
    assert "ranking" in report.ranking(rows) and "data" in report.table(rows)


def test_torch_model_from_the_meta_device() -> None:
    from torch import nn

    from commlayer.oracle import torchmodel

    def tiny() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * 4 * 4, 10),
        )

    net = torchmodel.describe_model(tiny, "3x8x8", 100)
    assert [la.kind for la in net.layers] == ["CONV", "RELU", "MPOOL", "OTHER", "FC"]
    conv, fc = net.layers[0], net.layers[-1]
    assert (conv.x, conv.w, conv.y) == ((3, 8, 8), (3, 8, 3, 3), (8, 8, 8))
    assert conv.weight_items == 3 * 8 * 9 + 8  # with its bias
    assert conv.flops() == 3 * (2 * 8 * 8 * 8 * 3 * 9)  # 3x the counted forward
    assert fc.x == (128, 1, 1) and fc.weight_items == 128 * 10 + 10
    assert net.samples == 100 and net.sample == (3, 8, 8)
    with pytest.raises(SpecError, match="module:callable"):
        torchmodel.describe("resnet50", "3x8x8", 1)
    # a module failing on import, a callable that fails, an input the model cannot take:
    # one line naming the problem, no traceback
    with pytest.raises(SpecError, match="No module named"):
        torchmodel.describe("no_such_module_23:net", "3x8x8", 1)
    with pytest.raises(SpecError, match="building it failed: TypeError"):
        torchmodel.describe("torch.nn:Conv2d", "3x8x8", 1)
    with pytest.raises(SpecError, match="on --input '5x8x8': forward failed"):
        torchmodel.describe_model(tiny, "5x8x8", 1)


# -- command line -------------------------------------------------------------------------------
def test_cli_table_json_and_plot(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    args = [
        "oracle",
        "--net",
        str(files["toy.net"]),
        "--plat",
        str(files["toy.plat"]),
        "--gpus",
        "1-4",
        "--batch-per-gpu",
        "4",
        "--lc",
        str(files["toy.lc"]),
    ]
    assert cli.main([*args, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ranking" in out and png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main([*args, "--format", "json", "--paradl", "--strategy", "d,f"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["strategy"] for r in rows} == {"data", "filter"}


def test_cli_errors_name_the_line(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.net"
    bad.write_text(NET.replace("FC2|4x4x4|4x10x4x4|10x1x1|0", "FC2|4x4x4"))
    assert cli.main(["oracle", "--net", str(bad), "--plat", str(files["toy.plat"])]) == 2
    assert "bad.net:8:" in capsys.readouterr().err
    assert cli.main(["oracle", "--plat", str(files["toy.plat"])]) == 2
    assert "--net FILE or --model" in capsys.readouterr().err


def test_the_namespace_cluster_splits_the_machines_cores_among_its_hosts() -> None:
    """benchmarks/oracle.py --cluster: the hosts are namespaces of one machine, so 2 hosts on
    2 cores get 1 core each: 2 x 1 ranks compute at full speed, 2 x 2 at half."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "oracle.py"
    spec = importlib.util.spec_from_file_location("benchmarks_oracle", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    one_each = bench.cluster_platform(2, 1, "1gbit", 2)
    two_each = bench.cluster_platform(2, 2, "10gbit", 2)
    assert (one_each.gpus_per_node, one_each.cores_per_node) == (1, 1)
    assert one_each.ranks_per_core(2) == 1.0 and two_each.ranks_per_core(4) == 2.0
    assert (one_each.bandwidth_bytes_s, two_each.bandwidth_bytes_s) == (125e6, 1.25e9)
    assert bench.cluster_platform(2, 2, "1gbit", None).ranks_per_core(4) == 1.0


def test_model_pipeline_micro_batches(net: oracle.Net, plat: oracle.Platform) -> None:
    """GPipe with m given: (m + p - 1) slots of the slowest stage, each its compute on B / m
    samples and its boundary's activation forward and gradient backward (one call each)."""
    s = _setup(net, plat, micro_batches=2, network=Network(plat, op_latency_s=1e-4))
    r = model.row(s, "pipeline", 2)
    assert r is not None and r.B == 8
    first, rest = s.comp_s[0], sum(s.comp_s[1:])
    # stage 0 = [CONV1] (out 256 items) on micro-batches of 8 / 2 = 4 samples
    send = 2 * (s.network.p2p_s(256 * 4 * 4, 2, False) + 1e-4)
    slot = max(4 * first + send, 4 * rest)
    assert slot == 4 * first + send  # the CONV's stage is the slowest here
    assert r.time_s == pytest.approx(125 * (2 + 2 - 1) * slot)
    assert r.parts_s["p2p"] == pytest.approx(125 * 3 * send)
    # m = 8: micro-batches of one sample, 8 + 2 - 1 slots of the CONV stage's compute
    many = model.row(_setup(net, plat, micro_batches=8), "pipeline", 2)
    assert many is not None
    assert many.tcomp_s / (125 * 9 * first) == pytest.approx(1.0)
    # m above B: one sample per micro-batch at most
    capped = model.row(_setup(net, plat, micro_batches=100), "pipeline", 2)
    assert capped is not None and capped.tcomp_s == pytest.approx(many.tcomp_s)


def test_model_hybrids_model_ways(net: oracle.Net, plat: oracle.Platform) -> None:
    """Groups of model_ways consecutive GPUs on one node (4 GPUs per node here): the group's
    communication inside the node, data+filter's gradient over the P1 = 2 groups on 1 node."""
    one_node = dataclasses.replace(plat, gpus_per_node=4)
    s = _setup(net, one_node, model_ways=2)
    network, times = s.network, s.comp_s
    df = model.row(s, "data+filter", 4)
    assert df is not None and df.B == 8  # b x P1
    assert df.tcomp_s == pytest.approx(125 * 4 * (times[0] / 2 + sum(times[1:])))
    assert df.parts_s["allgather"] == pytest.approx(125 * network.allgather_s(4096, 2, 1))
    assert df.parts_s["gradient allreduce"] == pytest.approx(
        125 * network.gradient_s(712 * 4, 2, 1)
    )
    ds = model.row(s, "data+spatial", 4)
    assert ds is not None and ds.B == 8
    assert ds.parts_s["gradient allreduce"] == pytest.approx(125 * network.gradient_s(712 * 4, 4))
    # without model_ways the group is the node's 4: one group, B = b
    whole = model.row(_setup(net, one_node), "data+filter", 4)
    assert whole is not None and whole.B == 4
    assert model.row(_setup(net, one_node, model_ways=3), "data+filter", 4) is None
    with pytest.raises(ValueError, match="model_ways must be >= 1"):
        oracle.predict(net, plat, "df", [4], model_ways=0)


# -- the plot -----------------------------------------------------------------------------------
def _bars(ax: object, label: str) -> list[tuple[float, float]]:
    """(bottom, top) of each bar of the container labelled ``label`` in ``ax``."""
    (container,) = [c for c in ax.containers if c.get_label() == label]  # type: ignore[attr-defined]
    return [(p.get_y(), p.get_y() + p.get_height()) for p in container.patches]


def test_plot_draws_shares_of_the_epoch_with_hidden_communication_inside_the_bar() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [
        # 80 s compute, 40 s communication of which 20 s hidden: a 100 s epoch
        oracle.Row("data", 64, 2, 1.0, 80.0, 40.0, 10, True, hidden_s=20.0),
        # the case: filter at p=2, 2098 s compute and 5296.1 s communication, none hidden
        oracle.Row("filter", 64, 2, 1.0, 2098.0, 5296.1, 10, True),
        oracle.Row("filter", 128, 4, 1.0, 1000.0, 1000.0, 10, False),
    ]
    fig = report.figure(rows, "t")
    data, filt = fig.axes[0], fig.axes[1]
    assert data.get_yscale() == "linear" and filt.get_yscale() == "linear"
    hidden = "communication hidden behind backward (inside the compute share)"
    exposed = "communication (exposed: adds to the epoch)"
    assert _bars(data, "compute") == [(0.0, 80.0)]
    assert _bars(data, exposed) == [(80.0, 100.0)]
    # hidden: the top 20% of the compute share, inside the bar, not above it
    assert _bars(data, hidden) == [(60.0, 80.0)]
    comp, comm = _bars(filt, "compute"), _bars(filt, exposed)
    assert comp[0][1] == pytest.approx(100 * 2098.0 / 7394.1)  # 28%, not drawn as ~1/5 of log
    assert comm[0] == pytest.approx((comp[0][1], 100.0))
    assert [b - a for a, b in _bars(filt, hidden)] == [0.0, 0.0]
    assert comp[1] == pytest.approx((0.0, 50.0)) and comm[1] == pytest.approx((50.0, 100.0))
    # a row over memory is faded, one that fits is not
    (container,) = [c for c in filt.containers if c.get_label() == "compute"]
    assert [p.get_facecolor()[3] for p in container.patches] == pytest.approx([1.0, 0.35])
    # every bar says its epoch and cost, and the figure says what GPU-min is
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts == ["100 s\n4 GPU-min", "7,394 s\n248 GPU-min", "2,000 s\n136 GPU-min"]
    assert any(t.get_text() == report.GPU_MIN for t in fig.texts)
    assert "GPU-min: the GPUs times the epoch rounded up to whole minutes" in report.GPU_MIN
    plt.close(fig)
