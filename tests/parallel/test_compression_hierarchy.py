"""Compression once per host (issue 51) through DistributedOptimizer and the DDP hook, hosts
posed on one machine by COMMLAYER_TOPOLOGY, under mpiexec and torchrun.

Layouts by the job's size (the same on every rank): 2 ranks are 2 hosts x 1, 3 ranks 3 x 1
(one rank a host: the per-host path is the flat one, no set is registered), 4 ranks 2 x 2,
6 ranks 2 x 3; 1 rank skips.

The yardstick is the flat compressed path of the same job, run beside it (a spec's
``hierarchy=flat`` against ``hierarchy=host``): where the compressor is exact under summation
(random-k with its shared seed, top-k keeping every entry; fp16 up to its rounding) the
per-host result equals the flat one. Buckets are fixed from the first step there
(``groups=``), so leaders never move and random-k draws the positions the flat path draws.
For every built-in compressor the per-host path runs, every rank ends with the same
parameters and a step's reduced gradient points along the mean gradient; a bucket's
error-feedback residual lives on its leader alone, also after the plan moved a leader.

Collectives first, asserts last, as in test_optimizer.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from launch import start_gloo
from restart import reinit
from test_compression import (  # the flat tests' parameters and gradients
    SHAPES,
    _grad,
    _Params,
    _reduced,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import commlayer as cl
from commlayer import compression
from commlayer.comm.hierarchy import HostLevels
from commlayer.integrations import ddp

F64 = torch.float64
STEPS = 3
EXACT = {"rtol": 1e-10, "atol": 1e-12}
# fp16: each path rounds once to float16 (a rank's share, or its host's sum), and sums there
FP16 = {"rtol": 0.0, "atol": 4e-3}
LAYOUTS = {2: "nodes=2", 3: "nodes=3", 4: "nodes=2,local=2", 6: "nodes=2,local=3"}


@pytest.fixture(scope="module", autouse=True)
def posed() -> Iterator[str]:
    layout = LAYOUTS.get(cl.size())
    if layout is None:
        pytest.skip(f"no posed host layout at {cl.size()} rank(s)")
    reinit(topology=layout)
    yield layout
    reinit()


def _pays() -> bool:
    """Whether this size's layout has a host of several ranks (2 x 2, 2 x 3)."""
    return cl.size() in (4, 6)


def _spec(spec: str, hierarchy: str) -> str:
    return f"{spec}{',' if ':' in spec else ':'}hierarchy={hierarchy}"


def _train(
    spec: str, fixed: bool = True, steps: int = STEPS, **kwargs: Any
) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """Each step's reduced gradient per parameter (minus the change under SGD lr=1), each rank
    its seeded gradients; ``fixed``: buckets (and leaders) from the first step."""
    model = _Params()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression=spec,
        groups=[[model.w], [model.v]] if fixed else None,
        **kwargs,
    )
    return _reduced(model, opt, steps), opt


def _levels(opt: Any) -> HostLevels | None:
    return opt._commlayer.levels  # type: ignore[no-any-return]


def _parts(opt: Any) -> list[tuple[str, str, bool]]:
    """(part name, compressor, compressed per host) of every bucket."""
    buckets = opt._commlayer.bucketer.buckets
    return [(p.name, p.compressor.name, p.per_host) for b in buckets for p in b.parts]


def _mean(name: str, step: int) -> torch.Tensor:
    return torch.stack([_grad(name, r, step) for r in range(cl.size())]).mean(dim=0)


# -- equal to the flat path where summation is exact -----------------------------------------------
EXACT_CASES = {"randomk:ratio=0.1": EXACT, "topk:ratio=1,ef=0": EXACT, "fp16": FP16}


def test_per_host_equals_flat_where_summation_is_exact() -> None:
    got = {}
    for spec in EXACT_CASES:
        flat, _ = _train(_spec(spec, "flat"))
        host, opt = _train(_spec(spec, "host"))
        got[spec] = (flat, host, _levels(opt), _parts(opt))

    for spec, tolerance in EXACT_CASES.items():
        flat, host, levels, parts = got[spec]
        assert (levels is not None) == _pays(), (spec, levels)
        compressed = [per_host for _, name, per_host in parts if name != "none"]
        assert compressed and all(f == _pays() for f in compressed), (spec, parts)
        for step in range(STEPS):
            for name in SHAPES:
                torch.testing.assert_close(host[step][name], flat[step][name], **tolerance)
        if not spec.startswith("randomk"):  # these keep every entry: the mean, fp16 rounded
            torch.testing.assert_close(host[0]["v"], _mean("v", 0), **FP16)


# -- every compressor ----------------------------------------------------------------------------
def _every() -> list[str]:
    """Every built-in compressor (other test modules of a session register ones that fail on
    purpose)."""
    specs = []
    for name in (c.name for c in compression.BUILTINS):
        spec = "auto:lossy=1,margin=1000" if name == "auto" else name
        specs.append(_spec(spec, "host"))
    return specs


def test_every_builtin_compressor_runs_per_host() -> None:
    got = {}
    for spec in _every():
        reduced, opt = _train(spec, fixed=False)
        flat = torch.cat([p.detach().reshape(-1) for p in opt.param_groups[0]["params"]])
        got[spec] = (reduced, cl.allgather(flat[None], name=f"params.{spec}"), _parts(opt))

    for spec, (reduced, gathered, parts) in got.items():
        differ = [r for r in range(cl.size()) if not torch.equal(gathered[r], gathered[0])]
        assert not differ, f"{spec}: ranks {differ} hold other parameters than rank 0"
        assert bool(torch.isfinite(gathered).all()), spec
        first = reduced[0]["w"].reshape(-1)
        cosine = float(F.cosine_similarity(first, _mean("w", 0).reshape(-1), dim=0))
        assert cosine > 0.05, f"{spec}: the reduced gradient's cosine to the mean is {cosine}"
        if _pays() and not spec.startswith("none"):
            assert any(per_host for *_, per_host in parts), (spec, parts)


# -- error feedback on the leader ------------------------------------------------------------------
def _kept(opt: Any) -> tuple[int, dict[str, int], list[str], list[str]]:
    """(local index, leading index of each per-host part, residual names this rank keeps,
    residual names its state_dict saves)."""
    levels = _levels(opt)
    compressor = opt._commlayer.policy.default
    leaders = {}
    if levels is not None:
        leaders = {name: levels.leader(name) for name, _, per_host in _parts(opt) if per_host}
    saved = opt.state_dict()["commlayer_compression"]["compressors"]["default"]["residuals"]
    index = levels.local_index if levels is not None else 0
    return index, leaders, sorted(compressor.residuals), sorted(saved)


def test_the_residual_lives_on_the_leader_and_moves_with_it() -> None:
    """Fixed buckets (leaders from the first step), and planned ones (the first step's leader
    by a hash of the gradient's name, the plan's by bytes: a moved residual is folded into
    its rank's gradient, not kept), then a fresh optimizer restores this rank's."""
    found = {}
    for fixed in (True, False):
        _, opt = _train(_spec("topk:ratio=0.05", "host"), fixed=fixed, steps=4)
        found[fixed] = _kept(opt)
        if fixed:
            state = opt.state_dict()
            model = _Params()
            again = cl.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=1.0),
                named_parameters=model.named_parameters(),
                compression=_spec("topk:ratio=0.05", "host"),
            )
            again.load_state_dict(state)
            restored = again._commlayer.policy.default.residuals  # type: ignore[attr-defined]
            mine = opt._commlayer.policy.default.residuals  # type: ignore[attr-defined]
    every = cl.allgather_object(found)

    for fixed in (True, False):
        by_name: dict[str, list[int]] = {}  # residual name -> ranks keeping it
        for rank, kept in enumerate(every):
            index, leaders, names, saved = kept[fixed]
            assert names == saved, (rank, names, saved)
            for name in names:
                by_name.setdefault(name, []).append(rank)
            if _pays():
                led = {n for part, i in leaders.items() if i == index for n in _tensors(part)}
                assert set(names) == led, (fixed, rank, names, leaders, index)
        hosts = 2 if _pays() else cl.size()
        assert by_name and all(len(r) == hosts for r in by_name.values()), (fixed, by_name)
    assert restored.keys() == mine.keys()
    for name in mine:
        torch.testing.assert_close(restored[name], mine[name], rtol=0, atol=0)


def _tensors(part: str) -> list[str]:
    """The gradient names of a part named grad.bucket[first..last] (one or two here)."""
    first, last = part.removeprefix("grad.bucket[").removesuffix("]").split("..")
    return sorted({f"grad.{first}", f"grad.{last}"})


# -- process sets ---------------------------------------------------------------------------------
def test_a_process_set_other_than_the_global_one_per_host() -> None:
    """The set of every rank but the last (at 2 x 2: hosts of 2 and 1 ranks, one leading
    index), its optimizer constructed on every rank (its sets are registered then): the
    members' per-host result equals their flat one."""
    ranks = list(range(max(cl.size() - 1, 1)))
    ps = cl.add_process_set(ranks)
    got: dict[str, Any] = {}
    try:
        for hierarchy in ("flat", "host"):
            spec = _spec("randomk:ratio=0.1", hierarchy)
            reduced, opt = _train(spec, process_set=ps)
            got[hierarchy] = (reduced, _levels(opt))
    finally:
        cl.remove_process_set(ps)

    member = cl.rank() in ranks
    host_levels = got["host"][1]
    assert (host_levels is not None) == (member and cl.size() in (4, 6)), host_levels
    if member and len(ranks) > 1:
        for step in range(STEPS):
            for name in SHAPES:
                torch.testing.assert_close(got["host"][0][step][name], got["flat"][0][step][name])


# -- auto ------------------------------------------------------------------------------------------
def test_auto_decides_per_bucket_alike_on_every_rank() -> None:
    """COMMLAYER_COMPRESSION_HIERARCHY=auto (the default): rank 0 weighs flat against per host
    for a compressor given outright, and compression=auto weighs every candidate both ways;
    every rank compresses each bucket the same way."""
    _, given = _train("topk:ratio=0.05", fixed=False)
    _, chooser = _train("auto:lossy=1,margin=1000", fixed=False)
    parts = cl.allgather_object([_parts(given), _parts(chooser)])
    decisions = [given.compression_decisions(), chooser.compression_decisions()]  # type: ignore[attr-defined]

    assert all(p == parts[0] for p in parts), parts
    if cl.rank() != 0:
        assert decisions == [[], []]
        return
    levels = [d for d in decisions[0] if d["kind"] == "compression hierarchy"]
    assert bool(levels) == _pays(), decisions[0]
    for decision in levels:
        assert decision["choice"] in ("topk", "topk@host")
        assert set(decision["predicted_s"]) == {"topk", "topk@host"}
    weighed = [d for d in decisions[1] if d["kind"] == "compression"]
    assert weighed
    for decision in weighed:
        hosted = {c for c in decision["predicted_s"] if c.endswith("@host")}
        assert bool(hosted) == (_pays() and decision["cpu_s"] != {}), decision


# -- the DDP hook ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo() -> None:
    """torch.distributed over the same ranks (left up until the process exits, as
    test_ddp_hook.py's: destroying gloo's group in a test aborted a later one)."""
    start_gloo()


def _ddp(spec: str, hierarchy: str, algorithm: str = "auto") -> tuple[torch.Tensor, ddp.CommState]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 40)).to(F64)
    wrapped = DDP(model, bucket_cap_mb=1e-6)  # a bucket per parameter
    state = ddp.CommState(compression=spec, algorithm=algorithm, hierarchy=hierarchy, dense_iters=0)
    wrapped.register_comm_hook(state, ddp.hook)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(cl.rank())
    for _ in range(STEPS):
        x = torch.randn(8, 40, generator=data, dtype=F64)
        optimizer.zero_grad()
        wrapped(x).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state


def test_ddp_hook_per_host(gloo: None) -> None:
    """Random-k per host gives the flat hook's parameters; top-k per host trains alike on
    every rank; the state keeps its levels where the layout pays; over a group smaller than
    the world the hook's per-host path is refused (its groups could not be made there)."""
    flat, _ = _ddp("randomk:ratio=0.2", "flat")
    host, state = _ddp("randomk:ratio=0.2", "host")
    topk, _ = _ddp("topk:ratio=0.1", "host")
    gathered = cl.allgather(topk[None], name="ddp.topk")
    smaller = dist.new_group(list(range(cl.size() - 1)))  # every rank makes it
    refused = None
    if cl.rank() < cl.size() - 1:
        try:
            ddp.CommState(process_group=smaller, compression="topk", hierarchy="host")
        except ValueError as exc:
            refused = str(exc)

    assert (state.levels is not None) == _pays(), state.levels
    torch.testing.assert_close(host, flat, **EXACT)
    assert all(torch.equal(gathered[r], gathered[0]) for r in range(cl.size()))
    if cl.rank() < cl.size() - 1:  # a group smaller than the world: refused, said why
        assert refused is not None and "use the world group" in refused, refused


def test_ddp_hook_per_host_through_commlayers_engine(gloo: None, posed: str) -> None:
    """CommState(algorithm="ring"): the hook's collectives and the per-host path's process sets
    are commlayer's engine's; random-k per host gives the flat hook's parameters."""
    reinit(topology=posed, allreduce_algorithm="ring")
    try:
        flat, _ = _ddp("randomk:ratio=0.2", "flat", "ring")
        host, state = _ddp("randomk:ratio=0.2", "host", "ring")
    finally:
        reinit(topology=posed)

    assert (state.levels is not None) == _pays(), state.levels
    torch.testing.assert_close(host, flat, **EXACT)
