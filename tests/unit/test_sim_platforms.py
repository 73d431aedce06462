"""commlayer/sim without SimGrid: platform specs and XML, hostfiles, DLN, trace export."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from commlayer import algorithms, cli
from commlayer.algorithms import hierarchical
from commlayer.common.topology import Topology
from commlayer.costmodel import sparse as sparse_cost
from commlayer.sim import export, platforms, simulate, smpi

MiB = 1 << 20


def _parse(xml: str) -> ET.Element:
    return ET.fromstring(xml.split("\n", 2)[2])  # past the declaration and DOCTYPE


@pytest.mark.parametrize(
    "spec, ranks, nodes",
    [
        ("flat:ranks=64", 64, 64),
        ("fat-tree:nodes=16,gpus-per-node=4", 64, 16),
        ("torus:2x4x2", 16, 16),
        ("dragonfly:groups=2,chassis=2,routers=2,nodes=2", 16, 16),
        ("dragonfly:groups=4,routers=4,gpus-per-node=4", 64, 16),
        ("dln:8,gpus-per-node=2", 16, 8),
        ("dln2d:2x4,gpus-per-node=2", 16, 8),
        ("dln2d:2x2,nodes-per-switch=2,gpus-per-node=2", 16, 8),
    ],
)
def test_generated_platforms_hold_their_ranks(spec: str, ranks: int, nodes: int) -> None:
    p = platforms.generate(spec)
    assert p.ranks == ranks
    assert p.topology().nodes == nodes
    _parse(p.xml)  # well-formed
    assert p.hostfile().splitlines()[0] == f"node-0:{ranks // nodes}"


def test_ranks_size_the_platform_when_the_spec_does_not() -> None:
    p = platforms.generate("fat-tree:gpus-per-node=4,leaf=4", ranks=32)
    assert (p.ranks, p.topology().nodes) == (32, 8)
    assert 'topo_parameters="2;4,2;1,4;1,1"' in p.xml
    assert platforms.generate("dln", ranks=16, gpus_per_node=4).topology().nodes == 4


def test_clusters_route_a_node_to_itself_over_the_intra_node_link() -> None:
    p = platforms.generate("flat:ranks=8,intra-bw=100GBps,intra-lat=0.2us", gpus_per_node=4)
    cluster = _parse(p.xml).find("cluster")
    assert cluster is not None
    assert float(cluster.get("loopback_bw", "0").removesuffix("Bps")) == 100e9
    assert p.links is not None and p.links.intra_alpha_s == pytest.approx(0.2e-6)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("mesh:4", "unknown kind"),
        ("flat:ranks=4,color=red", "unknown field"),
        ("dln:6", "power of two"),
        ("dln2d:3x4", r"X=3 switches must be a power of two"),
        ("dln2d:4x1", r"Y=1 switches must be a power of two >= 2"),
        ("dln2d:16", r"shape '16' must be XxY"),
        ("dln2d:4x4x4", r"must be XxY"),
        ("dln2d:nodes=24", r"Y=6 .*from nodes=24"),
        ("dln2d:nodes=6,nodes-per-switch=4", r"nodes=6 is not a multiple of nodes-per-switch=4"),
        ("dln2d:4x4,nodes=8", r"nodes=8 but 4x4 switches x 1 = 16"),
        ("dln2d:2x2,nodes-per-switch=0", r"nodes-per-switch=0: must be at least 1"),
        ("dln2d:2x2,spine-bw=1GBps", r"dln2d: no per-level field spine-bw"),
        ("dln2d", r"give its size \(dln2d:nodes=N\)"),
        ("torus", "shape"),
        ("flat:ranks=4,bw=fast", "bandwidth"),
        ("dragonfly:groups=4,routers=2", "groups - 1"),
    ],
)
def test_bad_specs_name_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        platforms.generate(spec)


def test_units() -> None:
    assert platforms.bandwidth("100Gbps") == 12.5e9
    assert platforms.bandwidth("12.5GBps") == 12.5e9
    assert platforms.seconds("0.5us") == pytest.approx(5e-7)


def _link_bandwidths(xml: str) -> dict[str, float]:
    return {
        link.get("id", ""): float(link.get("bandwidth", "0").removesuffix("Bps"))
        for link in _parse(xml).iter("link")
    }


def test_fat_tree_levels_have_their_own_bandwidths() -> None:
    spec = "fat-tree:nodes=8,leaf=4,node-bw=100Gbps,node-lat=1us,spine-bw=25Gbps,spine-lat=2us"
    p = platforms.generate(spec)
    bandwidths = _link_bandwidths(p.xml)
    node = {k: v for k, v in bandwidths.items() if k.startswith("n")}
    spine = {k: v for k, v in bandwidths.items() if k.startswith("l")}
    assert len(node) == 2 * 8 and set(node.values()) == {12.5e9}  # one link each way per node
    assert len(spine) == 2 * 2 * 4 and set(spine.values()) == {3.125e9}  # 2 leaves x 4 spines
    routes = {(r.get("src"), r.get("dst")): r for r in _parse(p.xml).iter("route")}
    assert len(routes) == 8 * 7
    same_leaf = [c.get("id") for c in routes[("node-0", "node-3")]]
    assert same_leaf == ["n0-up", "n3-down"]
    cross = [c.get("id") for c in routes[("node-1", "node-6")]]
    assert cross == ["n1-up", "l0-s2-up", "l1-s2-down", "n6-down"]  # spine 6 mod 4
    # the model's inter-node message: the farthest route's latencies, its slowest bandwidth
    assert p.links is not None
    assert p.links.inter_alpha_s == pytest.approx(2 * 1e-6 + 2 * 2e-6)
    assert p.links.inter_beta_s_per_byte == pytest.approx(1 / 3.125e9)


def test_fat_tree_with_default_levels_is_simgrids_cluster() -> None:
    default = platforms.generate("fat-tree:nodes=8,leaf=4")
    same = platforms.generate("fat-tree:nodes=8,leaf=4,node-bw=12.5GBps,spine-lat=0.5us")
    assert default.xml == same.xml and default.links == same.links
    assert 'topology="FAT_TREE"' in default.xml
    assert (
        platforms.generate("fat-tree:nodes=8,leaf=4,bw=10GBps").links
        == platforms.generate("fat-tree:nodes=8,leaf=4,node-bw=10GBps,spine-bw=10GBps").links
    )


def test_dln_levels_have_their_own_bandwidths() -> None:
    p = platforms.generate("dln:8,node-bw=50GBps,switch-bw=10GBps,switch-lat=1us")
    bandwidths = _link_bandwidths(p.xml)
    assert {v for k, v in bandwidths.items() if "node-" in k} == {50e9}
    assert {v for k, v in bandwidths.items() if "node-" not in k} == {10e9}
    assert p.links is not None
    # node link in and out at the default 0.5 us, diameter 2 switch hops of 1 us
    assert p.links.inter_alpha_s == pytest.approx(2 * 0.5e-6 + 2 * 1e-6)
    assert p.links.inter_beta_s_per_byte == pytest.approx(1 / 10e9)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fat-tree:nodes=4,spine-bw=0GBps", r"spine-bw '0GBps': expected a bandwidth > 0"),
        ("fat-tree:nodes=4,node-bw=-5GBps", r"node-bw '-5GBps'"),
        ("fat-tree:nodes=4,spine-lat=-1us", r"spine-lat '-1us': expected a latency >= 0"),
        ("fat-tree:nodes=4,node-lat=soon", r"node-lat 'soon'"),
        ("dln:8,switch-bw=fastGBps", r"switch-bw"),
        ("torus:2x2,spine-bw=1GBps", r"torus: no per-level field spine-bw .*fat-tree: node"),
        ("dragonfly:groups=2,node-lat=1us", r"dragonfly: no per-level field node-lat"),
        ("fat-tree:nodes=4,switch-bw=1GBps", r"fat-tree: no per-level field switch-bw"),
        ("flat:ranks=4,bw=0", r"bw '0'"),
    ],
)
def test_bad_level_values_name_the_field(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        platforms.generate(spec)


@pytest.mark.parametrize("switches, degree, diameter", [(8, 5, 2), (64, 11, 3), (256, 15, 4)])
def test_dln_degree_and_diameter(switches: int, degree: int, diameter: int) -> None:
    chords = platforms.dln_chords(switches)
    assert 2 * len(chords) == switches * degree
    assert platforms.dln_diameter(switches) == diameter
    # every halving-doubling partner (v XOR 2^k) is one chord away
    pairs = set(chords)
    for v in range(switches):
        for k in range(switches.bit_length() - 1):
            u = v ^ (1 << k)
            assert (min(u, v), max(u, v)) in pairs


@pytest.mark.parametrize(
    "x, y, degree, diameter",
    [(2, 2, 2, 2), (2, 4, 4, 2), (4, 4, 6, 2), (8, 8, 10, 4), (8, 16, 12, 4), (16, 16, 14, 4)],
)
def test_dln2d_degree_and_diameter(x: int, y: int, degree: int, diameter: int) -> None:
    """Each row and each column a 1D DLN: (2 log2 x - 1) + (2 log2 y - 1) chords per switch,
    diameter ceil(log2 x / 2) + ceil(log2 y / 2), the numbers platforms.py's docstring gives."""
    chords = platforms.dln2d_chords(x, y)
    ports = [0] * (x * y)
    for i, j in chords:
        ports[i] += 1
        ports[j] += 1
        (ri, ci), (rj, cj) = divmod(i, y), divmod(j, y)
        assert ri == rj or ci == cj  # a chord stays in its row or its column
    assert set(ports) == {degree}
    assert platforms.dln2d_diameter(x, y) == diameter
    bits = lambda d: d.bit_length() - 1  # noqa: E731
    assert degree == (2 * bits(x) - 1) + (2 * bits(y) - 1)
    assert diameter == -(-bits(x) // 2) + -(-bits(y) // 2)


@pytest.mark.parametrize("per_switch", [1, 2, 4])
def test_dln2d_halving_doubling_partners_are_one_switch_hop_apart(per_switch: int) -> None:
    x, y = 4, 8
    pairs = set(platforms.dln2d_chords(x, y))
    nodes = x * y * per_switch
    for v in range(nodes):
        for k in range(nodes.bit_length() - 1):
            a, b = sorted((v // per_switch, (v ^ (1 << k)) // per_switch))
            assert a == b if (1 << k) < per_switch else (a, b) in pairs


def test_dln2d_xml_links_every_node_to_its_switch_and_switches_by_chords() -> None:
    p = platforms.generate(
        "dln2d:2x4,nodes-per-switch=2,gpus-per-node=4,switch-bw=50GBps,switch-lat=1us"
    )
    assert (p.ranks, p.topology().nodes) == (64, 16)
    bandwidths = _link_bandwidths(p.xml)
    up = {k for k in bandwidths if k.startswith("node-")}
    assert up == {f"node-{n}_sw-{n // 2}" for n in range(16)}
    assert {bandwidths[k] for k in up} == {12.5e9}
    chords = {tuple(int(s) for s in k.replace("sw-", "").split("_")) for k in bandwidths
              if k.startswith("sw-") and "node" not in k}  # fmt: skip
    expected = set(platforms.dln2d_chords(2, 4))
    assert chords == expected | {(j, i) for i, j in expected}  # one link each way
    assert {v for k, v in bandwidths.items() if k.startswith("sw-") and "node" not in k} == {50e9}
    assert p.links is not None  # node link in and out, diameter 2 switch hops of 1 us
    assert p.links.inter_alpha_s == pytest.approx(2 * 0.5e-6 + 2 * 1e-6)
    # sized by the ranks: 1024 ranks of 4 GPUs, one node per switch: a 16x16 grid
    sized = platforms.generate("dln2d", ranks=1024, gpus_per_node=4)
    assert sized.topology().nodes == 256 and "sw-255" in sized.xml and "sw-256" not in sized.xml


def test_file_platform_with_hostfile(tmp_path: Path) -> None:
    xml = tmp_path / "p.xml"
    # SimGrid 3.19 accepted attributes without a space between them (the research's files)
    xml.write_text(platforms.generate("flat:ranks=4").xml.replace('" suffix', '"suffix'))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1:2\nnode-0\n# comment\nnode-3:2\n")
    p = platforms.from_file(xml, hostfile, None, 1)
    assert p.hosts == ("node-1", "node-1", "node-0", "node-3", "node-3")
    assert p.topology().node_of == (0, 0, 1, 2, 2)
    assert '" suffix' in p.xml
    assert platforms.from_file(xml, None, 8, 2).ranks == 8  # hosts in file order, 2 each


def test_trace_is_the_schedule() -> None:
    topology = Topology((0, 0, 1, 1))
    schedules = export.schedules("hierarchical", 1000, topology)
    for rank, schedule in enumerate(schedules):
        assert schedule == algorithms.schedule("hierarchical", rank, 4, 1000, topology)
    line = export.step_line(schedules[0][0], 4, gamma_s_per_byte=1e-9)
    nsend, nrecv, compute_s, *pairs = line.split()
    step = schedules[0][0]
    assert (int(nsend), int(nrecv)) == (len(step.sends), len(step.recvs))
    assert [int(x) for x in pairs[1::2]] == [4 * t.numel for t in step.sends + step.recvs]
    assert float(compute_s) == pytest.approx(4 * sum(t.numel for t in step.recvs) * 1e-9)


def test_aggregate_merges_pieces_to_one_peer(tmp_path: Path) -> None:
    schedule = algorithms.schedule("ring", 0, 2, 3 << 20)  # blocks of 1.5 Mi: two pieces each
    assert len(schedule[0].sends) == 2
    assert export.step_line(schedule[0], 4).split()[:2] == ["1", "1"]
    assert export.step_line(schedule[0], 4, aggregate=False).split()[:2] == ["2", "2"]
    messages = export.write([schedule, algorithms.schedule("ring", 1, 2, 3 << 20)], tmp_path)
    assert messages == 4
    assert (tmp_path / "rank1.trace").read_text().startswith("commlayer-sim-trace 1\n2\n")


def test_model_on_flat_is_the_alpha_beta_formula() -> None:
    p = platforms.generate("flat:ranks=64")
    assert p.links is not None
    alpha, beta = p.links.inter_alpha_s, p.links.inter_beta_s_per_byte
    for name in ("ring", "recursive_doubling", "rabenseifner"):
        model = simulate.model_time(name, p, 64 << 20)
        assert model == pytest.approx(simulate.alpha_beta(name, 64, 64 << 20, alpha, beta), 0.01)


def test_hierarchical_with_another_inter_is_registered_only_while_simulated() -> None:
    p = platforms.generate("flat:ranks=16", gpus_per_node=4)
    name = simulate.resolve("hierarchical:rabenseifner", p, 1 << 20)
    before = algorithms.generation()
    with simulate._variant(name):
        model = simulate.model_time(name, p, 1 << 20)
        schedule = algorithms.schedule(name, 0, 16, 1000, p.topology())
    assert name not in algorithms.schedules() and algorithms.generation() == before + 2
    assert model is not None and model > 0
    groups = [p.topology().members(n) for n in range(4)]
    assert schedule == hierarchical.two_level(0, 1000, groups, "rabenseifner")
    with pytest.raises(ValueError, match="unknown algorithm"):
        simulate.resolve("hierarchical:nope", p, 1 << 20)


def _pairs(streams: export.Streams) -> tuple[dict, dict]:
    """(sender, receiver) -> bytes of each message in order, as sent and as received."""
    sent: dict[tuple[int, int], list[float]] = {}
    received: dict[tuple[int, int], list[float]] = {}
    for rank, steps in enumerate(streams):
        for sends, recvs in steps:
            for peer, nbytes in sends:
                sent.setdefault((rank, peer), []).append(nbytes)
            for peer, nbytes in recvs:
                received.setdefault((peer, rank), []).append(nbytes)
    return sent, received


@pytest.mark.parametrize("name", ["topo_sparse", "dsar", "ssar_split_allgather", "gtopk"])
def test_sparse_streams_match_and_are_what_the_model_costs(name: str, tmp_path: Path) -> None:
    topology = Topology(tuple(r // 4 for r in range(16)))
    numel, nnz = 1 << 18, (1 << 18) // 100
    streams = sparse_cost.streams(name, 16, numel, nnz, topology)
    # the k-th message from a to b carries the bytes of b's k-th receive from a
    sent, received = _pairs(streams)
    assert sent == received
    most = max(sum(b for sends, _ in steps for _, b in sends) for steps in streams)
    assert most == pytest.approx(sparse_cost.predict(name, 16, numel, nnz, topology).bytes_sent)
    messages = export.write_sparse(streams, tmp_path)
    assert messages == sum(len(s) for key, s in sent.items())
    first = (tmp_path / "rank0.trace").read_text().splitlines()
    assert first[:2] == ["commlayer-sim-trace 1", str(len(streams[0]))]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algorithm", "nope"], "unknown algorithm 'nope'"),
        (["--sparse", "nope"], "unknown sparse algorithm 'nope'"),
        (["--sparse", "auto"], "unknown sparse algorithm 'auto'"),
        (["--platform", "flat"], "give its size"),
        (["--platform", "dln:4", "--gpus-per-node", "0"], "--gpus-per-node 0"),
        (["--platform", "flat:ranks=4", "--size", "2"], "at least one float32"),
        (["--platform", "missing.xml"], "missing.xml"),
    ],
)
def test_simulate_refuses_bad_input_before_simulating(
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(smpi, "tools", lambda: ("smpicc", "smpirun"))
    monkeypatch.setattr(smpi, "run", lambda *a, **k: pytest.fail("simulated bad input"))
    assert cli.main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


# export.pairwise: a sparse step's many streams replayed in pairwise-exchange rounds
@pytest.mark.parametrize("ranks", [5, 16])  # not a power of two too
@pytest.mark.parametrize("name", ["dsar", "ssar_split_allgather"])
def test_rounds_keep_every_message_in_order(name: str, ranks: int) -> None:
    topology = Topology(tuple(r // 4 for r in range(ranks)))
    streams = sparse_cost.streams(name, ranks, 1 << 16, 1 << 10, topology)
    cut, was_cut = export.pairwise(streams, 4)
    assert was_cut
    # the same messages between the same pairs, in the same order, at both ends
    assert _pairs(cut) == _pairs(streams)
    assert _pairs(cut)[0] == _pairs(cut)[1]
    for rank, steps in enumerate(cut):
        for sends, recvs in steps:
            # a round talks to one offset: sends to r + d, receives from r - d
            offsets = {(p - rank) % ranks for p, _ in sends}
            offsets |= {(rank - p) % ranks for p, _ in recvs}
            if len(sends) + len(recvs) > 4:  # a cut step's rounds
                assert len(offsets) == 1
    # a step to and from every other rank became p - 1 rounds, the others stayed
    full = sum(1 for s, r in streams[0] if len(s) + len(r) == 2 * (ranks - 1))
    assert full >= 1
    assert len(cut[0]) == len(streams[0]) + full * (ranks - 2)


def test_small_steps_are_left_as_posted() -> None:
    streams = sparse_cost.streams("topo_sparse", 8, 1 << 16, 1 << 10, Topology((0,) * 4 + (1,) * 4))
    cut, was_cut = export.pairwise(streams, 1000)
    assert not was_cut and cut == streams


def test_negative_max_streams_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--sparse", "dsar", "--platform", "flat:ranks=4", "--max-streams", "-1"]
    assert cli.main(argv) == 2
    assert "--max-streams -1" in capsys.readouterr().err


def test_claim_benchmark_tells_oversubscribed_fat_trees_and_2d_dlns_apart() -> None:
    """benchmarks/simulate.py: an oversubscribed fat tree is its own network in the tables (not
    the full fat tree's column), every spec it builds is valid, and the second summary gives
    SHD on DLN's and on 2D DLN's reductions over each baseline on the 2:1 tree."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate.py"
    spec = importlib.util.spec_from_file_location("benchmarks_simulate", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    specs = bench.specs(1024)
    assert specs["dln2d"] == "dln2d:16x16,gpus-per-node=4"
    for name in ("fat-tree-os2", "fat-tree-os4", "dln2d"):
        p = platforms.generate(specs[name])
        assert p.ranks == 1024 and p.topology().nodes == 256
    assert 'topo_parameters="2;16,16;1,8;1,1"' in platforms.generate(specs["fat-tree-os2"]).xml

    def result(algorithm: str, name: str, ms: float) -> simulate.Result:
        return simulate.Result(algorithm, specs[name], 1024, MiB, ms / 1e3, None, 1, 0.0)

    rows = [
        result("shd", "dln", 1.0),
        result("shd", "dln2d", 2.0),
        result("ring", "fat-tree", 3.0),
        result("ring", "fat-tree-os2", 4.0),
    ]
    assert [bench.kind(r) for r in rows] == ["dln", "dln2d", "fat-tree", "fat-tree-os2"]
    summary = bench.summary_table(rows).splitlines()[-1]
    assert "| 3.000 (+67%) |" in summary  # the full tree's ring only
    oversub = bench.oversub_table(rows).splitlines()[-1]
    assert oversub.startswith("| 1024 | 1 MiB | 1.000 | 2.000 | 4.000 (+75% / +50%) | - |")
    assert ("rabenseifner", "fat-tree-os2") in bench.runs(1024, 256, ("fat-tree-os2", "dln2d"))
    assert ("ring", "dln2d") not in bench.runs(64, 256, ("fat-tree-os2", "dln2d"))
