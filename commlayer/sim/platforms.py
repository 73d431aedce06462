"""Simulated machines: SimGrid platform XML generated from a spec, or any XML file.

A spec is ``KIND:key=value,...`` (``torus:8x8x16`` and ``dln:256`` take their shape bare).
Every kind is a set of nodes, each holding ``gpus-per-node`` ranks; ranks of one node talk over
the intra-node link (SimGrid's loopback: ``intra-bw`` per flow, ``intra-lat``, flows do not
share it, as point-to-point NVLink), ranks of different nodes leave through their node's
network link (``bw``, ``lat``), which the node's ranks share, and cross the network of the kind:

- ``flat:ranks=N`` (or ``nodes=N``): one crossbar of unlimited bandwidth (full bisection);
  routes are node link up, node link down (alpha = 2 lat, beta = 1/bw).
- ``fat-tree:nodes=N,leaf=L,oversub=O``: two levels, L nodes per leaf switch, L/O spine
  switches, every leaf linked to every spine (SimGrid's FAT_TREE cluster: links of ``bw``,
  ``lat``); O > 1 oversubscribes the leaves' uplinks. Per level: ``node-bw``/``node-lat``
  (node to leaf), ``spine-bw``/``spine-lat`` (leaf to spine); when they differ the tree is
  written link by link with FAT_TREE's routing (destination node mod spines), one route per
  node pair (256 nodes: 65 k routes, ~10 MB of XML).
- ``torus:XxY[xZ]``: one node per torus vertex, links of ``bw``/``lat`` to the neighbours in
  each dimension (SimGrid's TORUS cluster, dimension-order routing; one bw/lat for every link).
- ``dragonfly:groups=G,chassis=C,routers=R,nodes=N``: G groups of C chassis of R routers with
  N nodes each (SimGrid's DRAGONFLY cluster, one link of each kind, minimal routing; one
  bw/lat for every level); SimGrid needs R >= G - 1.
- ``dln:S`` (``dln:switches=S``): Distributed Loop Network, below. Per level: ``node-bw``/
  ``node-lat`` (node to its switch), ``switch-bw``/``switch-lat`` (switch to switch).
- ``dln2d:XxY,nodes-per-switch=Z``: the 2D DLN, below (the same per-level fields).

DLN. The research (Nguyen & Wahib, CCGrid 2021) co-designs SHD with a "distributed loop
network" whose fixed path lengths suit halving-doubling; its paper is not available to us, so
DLN is defined here from what the research states: S switches on a loop, switch i linked to
switch i +- 2^k mod S for every k < log2 S (a circulant graph C_S(1, 2, 4, ..., S/2)), one node
per switch. Halving-doubling partners at position distance 2^k (v XOR 2^k is v +- 2^k) are
then one switch hop apart at every step, whatever k: the fixed, short path the research asks
for. Switch degree 2 log2(S) - 1 (2 log2 S chords, S/2 counted once), diameter
ceil(log2(S) / 2) (any distance is a sum of at most that many signed powers of two);
S = 256: degree 15, diameter 4; S = 1024: degree 19, diameter 5. Shortest-path routing
(SimGrid Dijkstra).

2D DLN. ``dln2d:XxY`` (or ``dln2d:nodes=N``), ``nodes-per-switch=Z`` (default 1): the
research's "2D DLN(x,y,z)", its buildable two-dimensional form, which the research names but
does not define in what is available to us (its public simulation repository holds no DLN
platform), so defined here: X x Y switches on a grid (X, Y powers of two >= 2), each row a 1D
DLN of Y switches and each column a 1D DLN of X switches (switch (r, c) linked to (r, c +- 2^k
mod Y) for 2^k < Y and to (r +- 2^k mod X, c) for 2^k < X: the Cartesian product of the two
loops), Z nodes on every switch. Nodes are numbered switch by switch, switches row by row
(node n on switch n // Z = r Y + c), so a halving-doubling partner n XOR 2^k is on the same
switch (2^k < Z) or on a switch one chord away in the row (Z <= 2^k < Z Y) or in the column:
one switch hop at every step, as in the 1D DLN, with Z a power of two. Switch degree
(2 log2 X - 1) + (2 log2 Y - 1) network ports plus Z node ports; diameter ceil(log2(X) / 2) +
ceil(log2(Y) / 2) switch hops. 16x16 (256 switches): 14 + Z ports, diameter 4 (the 1D DLN of
256 switches: 15, 4); 32x32: 18 + Z, 6 (1D, 1024: 19, 5). Each chord is as long as a row or a
column at most, not half the machine, and with Z > 1 nodes per switch there are Z times fewer
switches, whose chords the Z nodes share (Z:1, like an oversubscribed leaf). ``dln2d:nodes=N``
picks X = 2^floor(log2(N/Z)/2), Y = N/(Z X). Per level as for ``dln``: ``node-bw``/
``node-lat``, ``switch-bw``/``switch-lat``; shortest-path routing.

Every generated kind has ``bw`` 12.5 GBps and ``lat`` 0.5 us per link (100 Gb/s, the order of
one switch hop; the default of every per-level field), ``intra-bw`` 50 GBps and ``intra-lat``
0.1 us unless given (Tsubame3's node in the research's platforms: 4 GPUs on NVLink of 50 GB/s,
100 Gb/s Omni-Path per node pair of GPUs; benchmarks/results/simulate.md uses their numbers).
A bandwidth is > 0 in Bps or bps with a prefix k/M/G/T (``100Gbps``), a latency >= 0 in
s/ms/us/ns (``0.5us``); a bare number is bytes/s or seconds. The cost model's prediction is
given the farthest pair's route: its latencies summed, its slowest link's bandwidth.

A file: ``--platform FILE.xml --hostfile HOSTS.txt --gpus-per-node G``: ranks placed on hosts
in hostfile order (smpirun's ``host[:count]`` lines), ranks of one host share a node.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from commlayer.common.topology import Topology

_BANDWIDTH = {"bps": 1 / 8, "Bps": 1.0}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
DEFAULTS = {"bw": "12.5GBps", "lat": "0.5us", "intra-bw": "50GBps", "intra-lat": "0.1us"}
KINDS = ("flat", "fat-tree", "torus", "dragonfly", "dln", "dln2d")


@dataclasses.dataclass(frozen=True)
class Links:
    """What the cost model is told about a platform: one message's alpha and beta inside a
    node and between nodes (the farthest pair: the latencies of its longest route summed, the
    slowest link of that route's bandwidth)."""

    intra_alpha_s: float
    intra_beta_s_per_byte: float
    inter_alpha_s: float
    inter_beta_s_per_byte: float


@dataclasses.dataclass(frozen=True)
class Platform:
    """A machine to simulate: its XML, the host of every rank, and the node of every rank."""

    name: str
    xml: str  # the platform file's text
    hosts: tuple[str, ...]  # host of each rank
    config: tuple[str, ...]  # extra smpirun --cfg settings (the intra-node link)
    links: Links | None  # None for a file: no parameters to give the cost model
    # ranks per node when every host is one GPU (a file modelling each GPU as a host, as the
    # research's): ranks r // gpus_per_node share a node; 0: ranks of one host share a node
    gpus_per_node: int = 0

    @property
    def ranks(self) -> int:
        return len(self.hosts)

    def topology(self) -> Topology:
        """Which ranks share a node: those of one host (first appearance order), or with
        ``gpus_per_node`` on a file of one rank per host, consecutive groups of that many."""
        if self.gpus_per_node > 1 and len(set(self.hosts)) == len(self.hosts):
            return Topology(tuple(r // self.gpus_per_node for r in range(self.ranks)))
        index: dict[str, int] = {}
        return Topology(tuple(index.setdefault(h, len(index)) for h in self.hosts))

    def hostfile(self) -> str:
        """smpirun's hostfile: ``host:count`` for each run of ranks on one host."""
        lines, run = [], 0
        for i, host in enumerate(self.hosts):
            run += 1
            if i + 1 == len(self.hosts) or self.hosts[i + 1] != host:
                lines.append(f"{host}:{run}")
                run = 0
        return "\n".join(lines) + "\n"


def bandwidth(text: str, name: str = "bandwidth") -> float:
    """Bytes per second (> 0) from ``12.5GBps``, ``100Gbps`` or a bare number (bytes/s)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKMGT]?)(bps|Bps)?\s*", text)
    value = _number(match.group(1)) if match else None
    if match is None or value is None or not 0 < value < math.inf:
        raise ValueError(f"{name} {text!r}: expected a bandwidth > 0 with a unit like 12.5GBps")
    return value * _PREFIX[match.group(2)] * _BANDWIDTH[match.group(3) or "Bps"]


def seconds(text: str, name: str = "latency") -> float:
    """Seconds (>= 0) from ``0.5us``, ``1ms`` or a bare number (seconds)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|ns)?\s*", text)
    value = _number(match.group(1)) if match else None
    if match is None or value is None or not 0 <= value < math.inf:
        raise ValueError(f"{name} {text!r}: expected a latency >= 0 with a unit like 0.5us")
    return value * _TIME[match.group(2) or "s"]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """(kind, fields) of ``KIND:key=value,...``; a field without ``=`` is the kind's shape."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"platform {spec!r}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            key, value = "shape", key
        if key in fields:
            raise ValueError(f"platform {spec!r}: {key!r} given twice")
        fields[key.strip()] = value.strip()
    return kind, fields


def generate(spec: str, ranks: int | None = None, gpus_per_node: int | None = None) -> Platform:
    """The platform of ``spec`` with ``ranks`` ranks (default: every GPU of every node)."""
    kind, fields = parse_spec(spec)
    gpus = int(fields.pop("gpus-per-node", gpus_per_node or 1))
    if gpus < 1:
        raise ValueError(f"platform {spec!r}: gpus-per-node={gpus} must be at least 1")
    try:
        values = {k: fields.pop(k, v) for k, v in DEFAULTS.items()}
        net = Link(bandwidth(values["bw"], "bw"), seconds(values["lat"], "lat"))
        intra = Link(
            bandwidth(values["intra-bw"], "intra-bw"), seconds(values["intra-lat"], "intra-lat")
        )
        levels = {level: _level(fields, level, net) for level in LEVELS[kind]}
    except ValueError as exc:
        raise ValueError(f"platform {spec!r}: {exc}") from None
    if kind == "flat" and "ranks" in fields:
        fields["nodes"] = str(-(-int(fields.pop("ranks")) // gpus))
    key = _SIZE_FIELD.get(kind)
    if key and key not in fields and "shape" not in fields:
        if ranks is None:
            raise ValueError(f"platform {spec!r}: give its size ({kind}:{key}=N) or --ranks N")
        fields[key] = str(-(-ranks // gpus))  # as many nodes as the ranks need
    try:
        _refuse_levels(kind, fields)
        body, nodes, route = _BUILDERS[kind](fields, net, levels)
    except ValueError as exc:
        raise ValueError(f"platform {spec!r}: {exc}") from None
    loopback = f'loopback_bw="{intra.bw!r}Bps" loopback_lat="{intra.lat!r}s"'
    body = body.replace("{loopback}", loopback)
    if fields:
        raise ValueError(f"platform {spec!r}: unknown field(s) {', '.join(sorted(fields))}")
    total = nodes * gpus
    ranks = total if ranks is None else ranks
    if not 0 < ranks <= total:
        raise ValueError(f"platform {spec!r} holds {total} ranks ({nodes} x {gpus}), not {ranks}")
    xml = _document(body)
    hosts = tuple(f"node-{r // gpus}" for r in range(ranks))
    config = (f"network/loopback-bw:{intra.bw!r}", f"network/loopback-lat:{intra.lat!r}")
    # the model's one inter-node curve: the farthest pair's route (a same-leaf pair is costed
    # as if it crossed the spine too; tests/system/test_simulate.py shows the direction holds)
    inter_lat, inter_bw = sum(link.lat for link in route), min(link.bw for link in route)
    links = Links(intra.lat, 1 / intra.bw, inter_lat, 1 / inter_bw)
    return Platform(spec, xml, hosts, config, links)


class Link(NamedTuple):
    """One network link's bandwidth (bytes/s) and latency (s)."""

    bw: float
    lat: float


# the network levels of each kind that take their own NAME-bw / NAME-lat (default bw / lat)
LEVELS: dict[str, tuple[str, ...]] = {
    "flat": (),
    "fat-tree": ("node", "spine"),
    "torus": (),
    "dragonfly": (),
    "dln": ("node", "switch"),
    "dln2d": ("node", "switch"),
}
_ALL_LEVELS = {level for levels in LEVELS.values() for level in levels}


def _level(fields: dict[str, str], level: str, net: Link) -> Link:
    bw, lat = fields.pop(f"{level}-bw", None), fields.pop(f"{level}-lat", None)
    return Link(
        net.bw if bw is None else bandwidth(bw, f"{level}-bw"),
        net.lat if lat is None else seconds(lat, f"{level}-lat"),
    )


def _refuse_levels(kind: str, fields: dict[str, str]) -> None:
    """A per-level field on a kind without it: say which kinds have which levels."""
    wrong = sorted(k for k in fields if k.rsplit("-", 1)[0] in _ALL_LEVELS and k[-3:] in "-bw-lat")
    if wrong:
        have = "; ".join(f"{k}: {', '.join(v)}" for k, v in LEVELS.items() if v)
        raise ValueError(
            f"{kind}: no per-level field {', '.join(wrong)} (its SimGrid cluster has one bw/lat "
            f"for every link; per-level links exist on {have})"
        )


def from_file(path: Path, hostfile: Path | None, ranks: int | None, gpus_per_node: int) -> Platform:
    """A SimGrid XML file; ranks placed by ``hostfile`` (``host[:count]`` lines), else
    ``gpus_per_node`` ranks per host in the order the file lists hosts. With a hostfile of one
    rank per host (each GPU a host of the file), ``gpus_per_node`` consecutive ranks form a
    node for the topology-aware algorithms."""
    xml = path.read_text()
    if hostfile is not None:
        hosts = list(_hostfile_hosts(hostfile.read_text()))
    else:
        hosts = [h for h in _host_names(xml) for _ in range(gpus_per_node)]
    ranks = len(hosts) if ranks is None else ranks
    if not 0 < ranks <= len(hosts):
        raise ValueError(f"{hostfile or path} places {len(hosts)} ranks, not {ranks}")
    grouping = gpus_per_node if hostfile is not None else 0
    return Platform(str(path), _sanitize(xml), tuple(hosts[:ranks]), (), None, grouping)


def _host_names(xml: str) -> list[str]:
    """Hosts in file order: ``<host id=...>`` and every host of a ``<cluster>``."""
    names = []
    for tag in re.finditer(r"<(host|cluster)\s([^>]*)>", xml):
        attrs = dict(re.findall(r"([\w-]+)\s*=\s*[\"']([^\"']*)", tag.group(2)))
        if tag.group(1) == "host":
            names.append(attrs.get("id", ""))
            continue
        for part in attrs.get("radical", "").split(","):
            low, _, high = part.partition("-")
            for i in range(int(low), int(high or low) + 1):
                names.append(f"{attrs.get('prefix', '')}{i}{attrs.get('suffix', '')}")
    return names


def _hostfile_hosts(text: str) -> Iterator[str]:
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            host, _, count = line.partition(":")
            yield from [host.strip()] * int(count or 1)


def _sanitize(xml: str) -> str:
    """XML written for older SimGrid, made readable by this one: a space between attributes
    (``id="n0"speed=...``, which SimGrid 3.19 accepted)."""
    return re.sub(r"(=\s*\"[^\"]*\")(?=[A-Za-z_])", r"\1 ", xml)


def _document(body: str) -> str:
    return (
        "<?xml version='1.0'?>\n"
        '<!DOCTYPE platform SYSTEM "https://simgrid.org/simgrid.dtd">\n'
        '<platform version="4.1">\n' + body + "</platform>\n"
    )


def _cluster(nodes: int, bw: float, lat: float, extra: str) -> str:
    return (
        f'<cluster id="net" prefix="node-" suffix="" radical="0-{nodes - 1}" speed="1Gf" '
        f'bw="{bw!r}Bps" lat="{lat!r}s" sharing_policy="SPLITDUPLEX" {{loopback}} {extra}/>\n'
    )


def _take(fields: dict[str, str], key: str, default: int | None = None) -> int:
    if key not in fields:
        if default is None:
            raise ValueError(f"missing {key!r}")
        return default
    value = int(fields.pop(key))
    if value < 1:
        raise ValueError(f"{key}={value}: must be at least 1")
    return value


def _flat(
    fields: dict[str, str], net: Link, levels: dict[str, Link]
) -> tuple[str, int, list[Link]]:
    nodes = _take(fields, "nodes")
    extra = 'bb_bw="1e15Bps" bb_lat="0s" bb_sharing_policy="FATPIPE"'
    return _cluster(nodes, net.bw, net.lat, extra), nodes, [net, net]


def _fat_tree(
    fields: dict[str, str], net: Link, levels: dict[str, Link]
) -> tuple[str, int, list[Link]]:
    nodes = _take(fields, "nodes")
    leaf = _take(fields, "leaf", min(nodes, 16))
    oversub = _take(fields, "oversub", 1)
    if nodes % leaf or leaf % oversub:
        raise ValueError(f"fat-tree: nodes={nodes} by leaf={leaf} by oversub={oversub}")
    node, spine = levels["node"], levels["spine"]
    route = [node, spine, spine, node] if nodes > leaf else [node, node]  # one leaf: no spine
    if node == spine == net:  # SimGrid's own FAT_TREE cluster: every result before per-level
        params = f"2;{leaf},{nodes // leaf};1,{leaf // oversub};1,1"
        extra = f'topology="FAT_TREE" topo_parameters="{params}"'
        return _cluster(nodes, net.bw, net.lat, extra), nodes, route
    return fat_tree_links(nodes, leaf, leaf // oversub, node, spine), nodes, route


def fat_tree_links(nodes: int, leaf: int, spines: int, node: Link, spine: Link) -> str:
    """A two-level fat tree written link by link (a Full zone: one route per node pair), with
    the routing of SimGrid's FAT_TREE cluster: node a to node b on another leaf goes up through
    spine b mod ``spines`` (d-mod-k), every link one each way (SPLITDUPLEX). With equal levels
    it simulates what the cluster does (tests/system/test_simulate.py)."""
    hosts = [f'<host id="node-{i}" speed="1Gf"/>\n' for i in range(nodes)]
    links = [
        f'<link id="{name}" bandwidth="{link.bw!r}Bps" latency="{link.lat!r}s"/>\n'
        for name, link in [
            *((f"n{i}-{way}", node) for i in range(nodes) for way in ("up", "down")),
            *(
                (f"l{j}-s{k}-{way}", spine)
                for j in range(nodes // leaf)
                for k in range(spines)
                for way in ("up", "down")
            ),
        ]
    ]
    routes = []
    for a in range(nodes):
        for b in range(nodes):
            if a == b:
                continue
            path = [f"n{a}-up", f"n{b}-down"]
            if a // leaf != b // leaf:
                k = b % spines
                path[1:1] = [f"l{a // leaf}-s{k}-up", f"l{b // leaf}-s{k}-down"]
            hops = "".join(f'<link_ctn id="{p}"/>' for p in path)
            routes.append(f'<route src="node-{a}" dst="node-{b}" symmetrical="NO">{hops}</route>\n')
    return "".join(['<zone id="net" routing="Full">\n', *hosts, *links, *routes, "</zone>\n"])


def _torus(
    fields: dict[str, str], net: Link, levels: dict[str, Link]
) -> tuple[str, int, list[Link]]:
    dims = [int(d) for d in fields.pop("shape", "").split("x") if d]
    if not dims or min(dims) < 1:
        raise ValueError("torus: give the shape, e.g. torus:8x8x16")
    nodes = math.prod(dims)
    hops = sum(d // 2 for d in dims) + 1  # farthest pair, plus the links into the torus
    params = ",".join(map(str, dims))
    extra = f'topology="TORUS" topo_parameters="{params}"'
    return _cluster(nodes, net.bw, net.lat, extra), nodes, [net] * hops


def _dragonfly(
    fields: dict[str, str], net: Link, levels: dict[str, Link]
) -> tuple[str, int, list[Link]]:
    g, c = _take(fields, "groups"), _take(fields, "chassis", 1)
    r, n = _take(fields, "routers", 1), _take(fields, "nodes", 1)
    if r < g - 1:  # SimGrid 3.32 segfaults then (seen: groups=4 with routers=2)
        raise ValueError(
            f"dragonfly: routers={r} per chassis must be at least groups - 1 = {g - 1}"
        )
    params = f"{g},1;{c},1;{r},1;{n}"
    extra = f'topology="DRAGONFLY" topo_parameters="{params}"'
    return _cluster(g * c * r * n, net.bw, net.lat, extra), g * c * r * n, [net] * 5


def _dln(fields: dict[str, str], net: Link, levels: dict[str, Link]) -> tuple[str, int, list[Link]]:
    switches = int(fields.pop("switches", fields.pop("shape", "0")))
    if switches < 2 or switches & (switches - 1):
        raise ValueError(f"dln: switches={switches} must be a power of two >= 2")
    node, switch = levels["node"], levels["switch"]
    body = _switched_network("dln", switches, 1, dln_chords(switches), node, switch)
    route = [node, *[switch] * dln_diameter(switches), node]
    return body, switches, route


def _switched_network(
    name: str, switches: int, per_switch: int, chords: list[tuple[int, int]], node: Link,
    switch: Link,
) -> str:  # fmt: skip
    """A zone of routers ``sw-i`` linked by ``chords``, ``per_switch`` hosts ``node-n`` on
    switch n // per_switch, one link per direction on every edge, shortest-path routing."""
    # SimGrid's DTD: hosts, routers and links first, then the routes (the graph's edges)
    nodes, links, routes = [], [], []
    edges = [(f"node-{n}", f"sw-{n // per_switch}", node) for n in range(switches * per_switch)]
    edges += [(f"sw-{i}", f"sw-{j}", switch) for i, j in chords]
    for i in range(switches):  # one line per switch: its hosts, then the switch
        hosts = range(i * per_switch, (i + 1) * per_switch)
        nodes.append("".join(f'<host id="node-{n}" speed="1Gf"/>' for n in hosts))
        nodes.append(f'<router id="sw-{i}"/>\n')
    for a, b, link in edges:
        for src, dst in ((a, b), (b, a)):  # one link per direction: full duplex
            links.append(
                f'<link id="{src}_{dst}" bandwidth="{link.bw!r}Bps" latency="{link.lat!r}s"/>\n'
            )
            routes.append(
                f'<route src="{src}" dst="{dst}" symmetrical="NO">'
                f'<link_ctn id="{src}_{dst}"/></route>\n'
            )
    zone = f'<zone id="{name}" routing="DijkstraCache">\n'
    return "".join([zone, *nodes, *links, *routes, "</zone>\n"])


def dln_chords(switches: int) -> list[tuple[int, int]]:
    """The DLN's switch-to-switch links (i < j): i to i + 2^k mod S for every k < log2 S."""
    found = set()
    for i in range(switches):
        step = 1
        while step < switches:
            j = (i + step) % switches
            found.add((min(i, j), max(i, j)))
            step <<= 1
    return sorted(found)


def dln_diameter(switches: int) -> int:
    """Largest switch-hop distance of the DLN (breadth-first from switch 0: it is vertex-
    transitive)."""
    return _eccentricity(switches, dln_chords(switches))


def _eccentricity(switches: int, chords: list[tuple[int, int]]) -> int:
    """Hops from switch 0 to the farthest switch (the diameter of a vertex-transitive graph)."""
    neighbours: dict[int, set[int]] = {i: set() for i in range(switches)}
    for i, j in chords:
        neighbours[i].add(j)
        neighbours[j].add(i)
    depth, frontier, seen = 0, {0}, {0}
    while len(seen) < switches:
        frontier = {n for f in frontier for n in neighbours[f]} - seen
        if not frontier:
            raise ValueError(f"{switches} switches: the chords do not connect them")
        seen |= frontier
        depth += 1
    return depth


def dln2d_chords(x: int, y: int) -> list[tuple[int, int]]:
    """The 2D DLN's switch-to-switch links (i < j), switch (r, c) numbered r y + c: a 1D DLN
    along every row (c +- 2^k mod y) and along every column (r +- 2^k mod x)."""
    row, column = dln_chords(y), dln_chords(x)  # dln_chords(1) is empty: a 1-wide grid
    found = {(r * y + a, r * y + b) for r in range(x) for a, b in row}
    found |= {(a * y + c, b * y + c) for c in range(y) for a, b in column}
    return sorted(found)


def dln2d_diameter(x: int, y: int) -> int:
    """Largest switch-hop distance of the x-by-y 2D DLN (breadth-first from switch 0)."""
    return _eccentricity(x * y, dln2d_chords(x, y))


def _dln2d(
    fields: dict[str, str], net: Link, levels: dict[str, Link]
) -> tuple[str, int, list[Link]]:
    per_switch = _take(fields, "nodes-per-switch", 1)
    shape, count = fields.pop("shape", None), fields.pop("nodes", None)
    if shape is not None:
        dims = shape.split("x")
        if len(dims) != 2 or not all(d.isdigit() for d in dims):
            raise ValueError(f"dln2d: shape {shape!r} must be XxY (two powers of two), e.g. 8x8")
        x, y = int(dims[0]), int(dims[1])
    elif count is not None:
        nodes = int(count)
        if nodes < 1 or nodes % per_switch:
            raise ValueError(
                f"dln2d: nodes={nodes} is not a multiple of nodes-per-switch={per_switch}"
            )
        switches = nodes // per_switch
        x = 1 << max(switches.bit_length() - 1, 0) // 2
        y = switches // x
    else:
        raise ValueError("dln2d: give the shape (dln2d:8x8) or nodes=N")
    for name, d in (("X", x), ("Y", y)):
        if d < 2 or d & (d - 1):
            raise ValueError(
                f"dln2d: {name}={d} switches must be a power of two >= 2 (grid {x}x{y}"
                f"{f', from nodes={count} / nodes-per-switch={per_switch}' if count else ''})"
            )
    if shape is not None and count is not None and int(count) != x * y * per_switch:
        raise ValueError(
            f"dln2d: nodes={count} but {x}x{y} switches x {per_switch} = {x * y * per_switch}"
        )
    node, switch = levels["node"], levels["switch"]
    body = _switched_network("dln2d", x * y, per_switch, dln2d_chords(x, y), node, switch)
    route = [node, *[switch] * dln2d_diameter(x, y), node]
    return body, x * y * per_switch, route


# the field that sizes a kind, filled from --ranks when the spec leaves it out
_SIZE_FIELD = {"flat": "nodes", "fat-tree": "nodes", "dln": "switches", "dln2d": "nodes"}

_BUILDERS = {
    "flat": _flat,
    "fat-tree": _fat_tree,
    "torus": _torus,
    "dragonfly": _dragonfly,
    "dln": _dln,
    "dln2d": _dln2d,
}
