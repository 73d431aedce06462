"""State broadcast (issue #3) under real MPI: broadcast_parameters, broadcast_optimizer_state,
broadcast_object and allgather_object make every rank start from the root's state.

Ranks start deliberately different (seeded by their rank: data, not collection, depends on the
rank); afterwards every rank must hold exactly the root's values, checked by allgathering them.
The root is rank 0 and rank size() - 1, resolved inside the test so every rank collects the
same ids. Collectives first, asserts last, so a failing rank never strands the others.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as cl

ROOTS = ["first", "last"]


def _root(which: str) -> int:
    return 0 if which == "first" else cl.size() - 1


def _same(a: Any, b: Any) -> bool:
    """Exact structural equality; tensors must match in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _net(seed: int) -> nn.Sequential:
    """Linear-BatchNorm-Linear: parameters plus float and int64 buffers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 2))


def _rank_dependent_net() -> nn.Sequential:
    net = _net(100 + cl.rank())
    net(torch.randn(6, 5))  # moves BatchNorm's running statistics, differently on each rank
    net[1].num_batches_tracked.fill_(10 + cl.rank())
    return net


def _snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


# -- broadcast_parameters ------------------------------------------------------------------------
@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_parameters_of_a_state_dict(which: str) -> None:
    root = _root(which)
    net = _rank_dependent_net()
    before = cl.allgather_object(_snapshot(net.state_dict()))
    storage = {k: v.data_ptr() for k, v in net.state_dict().items()}
    cl.broadcast_parameters(net.state_dict(), root_rank=root)
    after = cl.allgather_object(_snapshot(net.state_dict()))

    assert cl.size() == 1 or not _same(before[0], before[-1]), "ranks must start different"
    for r, state in enumerate(after):
        assert _same(state, before[root]), f"rank {r} does not hold root {root}'s state_dict"
    assert {k: v.data_ptr() for k, v in net.state_dict().items()} == storage, "not in place"


@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_parameters_of_named_parameters_keeps_them_trainable(which: str) -> None:
    root = _root(which)
    net = _rank_dependent_net()
    before = cl.allgather_object(_snapshot(dict(net.named_parameters())))
    cl.broadcast_parameters(net.named_parameters(), root_rank=root)
    after = cl.allgather_object(_snapshot(dict(net.named_parameters())))
    # Same data on every rank, so one local SGD step on the same batch keeps them equal.
    torch.manual_seed(7)
    F.mse_loss(net(torch.randn(4, 5)), torch.zeros(4, 2)).backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    stepped = cl.allgather_object(_snapshot(dict(net.named_parameters())))

    for r, params in enumerate(after):
        assert _same(params, before[root]), f"rank {r} does not hold root {root}'s parameters"
    assert all(p.requires_grad and p.is_leaf for p in net.parameters())
    assert all(_same(s, stepped[0]) for s in stepped)
    assert not _same(stepped[0], after[0]), "the SGD step must have changed the parameters"


def test_broadcast_parameters_rejects_bad_arguments() -> None:
    net = _net(0)
    with pytest.raises(ValueError, match="'scale' is a float, not a tensor"):
        cl.broadcast_parameters([("scale", 0.5), *net.state_dict().items()], root_rank=0)
    with pytest.raises(ValueError, match="root_rank"):
        cl.broadcast_parameters(net.state_dict(), root_rank=cl.size())


# -- broadcast_optimizer_state -------------------------------------------------------------------
OPTIMIZERS = {
    "sgd_momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1),
}


def _local_steps(net: nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("which", ROOTS)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_broadcast_optimizer_state_created_lazily_on_the_root(opt_name: str, which: str) -> None:
    """The root has stepped (lazy state exists, its own lr); the others never stepped. After the
    broadcasts every rank holds the root's state, and a step on the same batch stays equal."""
    root = _root(which)
    net = _rank_dependent_net()
    opt = OPTIMIZERS[opt_name](net.parameters(), 0.01 * (1 + cl.rank()))
    if cl.rank() == root:
        _local_steps(net, opt, seed=5, steps=3)
    cl.broadcast_parameters(net.state_dict(), root_rank=root)
    cl.broadcast_optimizer_state(opt, root_rank=root)
    states = cl.allgather_object(copy.deepcopy(opt.state_dict()))
    _local_steps(net, opt, seed=6, steps=2)  # the same batches on every rank
    params = cl.allgather_object(_snapshot(net.state_dict()))
    stepped = cl.allgather_object(copy.deepcopy(opt.state_dict()))

    assert len(states[root]["state"]) == len(list(net.parameters())), "root state is lazy"
    assert states[root]["param_groups"][0]["lr"] == pytest.approx(0.01 * (1 + root))
    for r in range(cl.size()):
        assert _same(states[r], states[root]), f"rank {r}: optimizer state is not the root's"
        assert _same(params[r], params[root]), f"rank {r} stepped differently from the root"
        assert _same(stepped[r], stepped[root]), f"rank {r}: state after stepping differs"
    if opt_name != "sgd_momentum":
        assert all(int(s["step"]) == 5 for s in stepped[root]["state"].values())


@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_optimizer_state_from_a_fresh_root_gives_horovods_first_step(which: str) -> None:
    """A root whose optimizer never stepped: every rank takes Horovod's zero-gradient step
    (p.grad becomes zeros where it was None) and then holds the root's state, whatever it
    had before (issue 20: Horovod's test_broadcast_state_no_grad reads p.grad afterwards)."""
    root = _root(which)
    net = _net(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    if cl.rank() != root:
        _local_steps(net, opt, seed=5, steps=1)
    cl.broadcast_optimizer_state(opt, root_rank=root)
    states = cl.allgather_object(copy.deepcopy(opt.state_dict()))
    grads = [p.grad for p in net.parameters()]

    assert len(states[root]["state"]) == len(list(net.parameters()))
    assert all(int(s["step"]) == 1 for s in states[root]["state"].values())
    for r in range(cl.size()):
        assert _same(states[r], states[root]), f"rank {r}: optimizer state is not the root's"
    if cl.rank() == root:
        assert all(g is not None and not g.any() for g in grads)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_broadcast_optimizer_state_of_a_distributed_optimizer(opt_name: str) -> None:
    """Horovod's recipe: wrap, broadcast parameters and optimizer state from rank 0 (which
    resumed from a checkpoint), then train on per-rank data; ranks stay identical."""
    net = _rank_dependent_net()
    base = OPTIMIZERS[opt_name](net.parameters(), 0.01)
    if cl.rank() == 0:
        _local_steps(net, base, seed=5, steps=2)  # stands in for loading a checkpoint
    opt = cl.DistributedOptimizer(base, named_parameters=net.named_parameters())
    steps_seen = []
    opt.register_step_post_hook(lambda *_: steps_seen.append(1))
    cl.broadcast_parameters(net.state_dict(), root_rank=0)
    cl.broadcast_optimizer_state(opt, root_rank=0)
    states = cl.allgather_object(copy.deepcopy(opt.state_dict()))
    net.eval()  # BatchNorm statistics are per rank in training mode; parameters are what we check
    _local_steps(net, opt, seed=50 + cl.rank(), steps=2)  # each rank its own data
    params = cl.allgather_object(_snapshot(dict(net.named_parameters())))
    hook_calls = cl.allgather_object(len(steps_seen))

    assert isinstance(opt, type(base))
    # load_state_dict on the non-roots once made every step hook run twice there
    assert hook_calls == [2] * cl.size(), f"step post-hook calls per rank: {hook_calls}"
    for r in range(cl.size()):
        assert _same(states[r], states[0]), f"rank {r}: optimizer state is not rank 0's"
        assert _same(params[r], params[0]), f"rank {r}: parameters diverged from rank 0's"


# -- broadcast_object / allgather_object ---------------------------------------------------------
def _nested(r: int) -> dict[str, Any]:
    """A checkpoint-like object whose every part depends on r."""
    return {
        "epoch": r,
        "name": f"run-{r}-é",
        "history": [0.5 * r, None, (True, b"\x00\xff" * r), {"lr": 10.0**-r}],
        "tensors": {
            "w": torch.full((r + 1, 2), float(r)),
            "ids": torch.arange(r, dtype=torch.int32),
        },
        "big": torch.arange(100_000, dtype=torch.float64) + r,  # 800 kB on the wire
        "tags": frozenset({f"t{i}" for i in range(r + 1)}),
    }


@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_object_nested(which: str) -> None:
    root = _root(which)
    got = cl.broadcast_object(_nested(cl.rank()), root_rank=root)
    got_again = cl.broadcast_object(
        _nested(cl.rank()) if cl.rank() == root else None, root_rank=root, name="ckpt"
    )
    everyone = cl.allgather_object(got)

    assert _same(got, _nested(root))
    assert _same(got_again, _nested(root))
    assert all(_same(g, _nested(root)) for g in everyone)


def test_broadcast_object_of_none_and_scalars() -> None:
    root = cl.size() - 1
    results = [cl.broadcast_object(obj, root_rank=root) for obj in (None, 0, "", [], cl.rank())]

    assert results == [None, 0, "", [], root]


def test_allgather_object_nested_objects_of_different_sizes() -> None:
    got = cl.allgather_object(_nested(cl.rank()))
    lists = cl.allgather_object(list(range(cl.rank() * 1000)), name="ranges")

    assert len(got) == cl.size()
    for r, obj in enumerate(got):
        assert _same(obj, _nested(r)), f"entry {r} is not rank {r}'s object"
    assert lists == [list(range(r * 1000)) for r in range(cl.size())]
