"""``import commlayer as hvd`` runs horovod.torch code (issue #7): tests in the style of Horovod's
test/parallel/test_torch.py, written against the ``hvd`` name only.

Like Horovod's, they run at any size (mismatch tests need 2 ranks and are skipped at 1), every
rank builds the same seeded tensors, and results are compared with what the collective must
give. Unlike Horovod's 4,000-line class, one short function per behaviour; collectives first,
asserts last (a rank failing early must not leave the others in a collective).
What does not carry over from Horovod is listed in the README ("Horovod drop-in").
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as hvd

DTYPES = [torch.int32, torch.int64, torch.float32, torch.float64]
DIMS = [1, 2, 3]


@pytest.fixture
def multi_rank() -> None:
    """Mismatch tests need ranks that disagree (size() is the same on every rank)."""
    if hvd.size() < 2:
        pytest.skip("needs 2 or more ranks")


def _tensor(dtype: torch.dtype, dim: int, seed: int = 1234) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype)


def _allclose_all_ranks(tensors: list[torch.Tensor]) -> bool:
    """Whether every rank holds the same tensors (compared after gathering them)."""
    gathered = hvd.allgather_object([t.detach() for t in tensors])
    return all(torch.equal(a, b) for other in gathered for a, b in zip(other, gathered[0]))


# -- the API surface ------------------------------------------------------------------------------
HOROVOD_TORCH_API = """
allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async
grouped_allreduce_ grouped_allreduce_async_ allgather allgather_async broadcast broadcast_async
broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async join barrier
poll synchronize init shutdown is_initialized size local_size cross_size rank local_rank
cross_rank is_homogeneous mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built
nccl_built ddl_built ccl_built cuda_built rocm_built broadcast_parameters
broadcast_optimizer_state broadcast_object allgather_object DistributedOptimizer Compression
Average Sum Adasum Min Max Product ProcessSet global_process_set add_process_set
remove_process_set HorovodInternalError
""".split()


def test_horovod_names_exist() -> None:
    missing = [name for name in HOROVOD_TORCH_API if not hasattr(hvd, name)]
    assert not missing, missing
    assert hvd.is_initialized() and hvd.mpi_enabled() and hvd.mpi_built()
    assert hvd.mpi_threads_supported() is True
    built = [hvd.gloo_built(), hvd.gloo_enabled(), hvd.nccl_built(), hvd.ddl_built()]
    assert built + [hvd.ccl_built(), hvd.cuda_built(), hvd.rocm_built()] == [False] * 7
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.Compression.none is not None and hvd.Compression.fp16 is not None


def test_horovod_rank_and_size_queries() -> None:
    ranks = hvd.allgather_object((hvd.rank(), hvd.local_rank(), hvd.cross_rank()))
    sizes = (hvd.size(), hvd.local_size(), hvd.cross_size())
    assert all(isinstance(v, int) for v in (*ranks[0], *sizes))
    assert [r for r, _, _ in ranks] == list(range(hvd.size()))
    assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
    if hvd.is_homogeneous():
        assert hvd.local_size() * hvd.cross_size() == hvd.size()
    # Local ranks of one node are 0..local_size-1, once each.
    same_node = sorted(lr for _, lr, cr in ranks if cr == hvd.cross_rank())
    assert same_node == list(range(hvd.local_size()))


# -- allreduce ------------------------------------------------------------------------------------
def test_horovod_allreduce() -> None:
    cases = list(itertools.product(DTYPES, DIMS))
    results = [(hvd.allreduce(_tensor(d, n), average=False), _tensor(d, n)) for d, n in cases]
    for summed, tensor in results:
        assert summed.dtype == tensor.dtype and summed.shape == tensor.shape
        torch.testing.assert_close(summed, tensor * hvd.size())


def test_horovod_allreduce_average_and_op() -> None:
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = _tensor(dtype, dim)
        torch.testing.assert_close(hvd.allreduce(tensor, average=True), tensor)
        torch.testing.assert_close(hvd.allreduce(tensor, op=hvd.Average), tensor)
        torch.testing.assert_close(hvd.allreduce(tensor, op=hvd.Sum), tensor * hvd.size())
        ranked = torch.full_like(tensor, float(hvd.rank()))
        assert torch.all(hvd.allreduce(ranked, op=hvd.Max) == hvd.size() - 1)
        assert torch.all(hvd.allreduce(ranked, op=hvd.Min) == 0)
    with pytest.raises(ValueError):
        hvd.allreduce(_tensor(torch.float32, 1), average=True, op=hvd.Sum)


def test_horovod_allreduce_inplace_returns_the_tensor() -> None:
    tensor = _tensor(torch.float64, 2)
    expected = tensor * hvd.size()
    result = hvd.allreduce_(tensor, average=False)
    assert result is tensor
    torch.testing.assert_close(tensor, expected)


def test_horovod_allreduce_async_fused() -> None:
    tensors = [_tensor(d, n) for d, n in itertools.product(DTYPES, DIMS)]
    handles = [
        hvd.allreduce_async(t, average=False, name=f"fused.{i}") for i, t in enumerate(tensors)
    ]
    outputs = [hvd.synchronize(h) for h in handles]
    assert all(isinstance(hvd.poll(h), bool) for h in handles)
    for out, tensor in zip(outputs, tensors):
        torch.testing.assert_close(out, tensor * hvd.size())


def test_horovod_allreduce_grad() -> None:
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = _tensor(dtype, dim).requires_grad_()
        hvd.allreduce(tensor, average=False).backward(torch.ones_like(tensor))
        # d(sum over ranks)/d(this rank's input) of ones, summed over ranks: size everywhere.
        torch.testing.assert_close(tensor.grad, torch.full_like(tensor, float(hvd.size())))


def test_horovod_grouped_allreduce() -> None:
    tensors = [_tensor(torch.float32, n) for n in DIMS]
    summed = hvd.grouped_allreduce(tensors, average=False)
    in_place = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(in_place, op=hvd.Sum)
    assert isinstance(summed, list) and len(summed) == len(tensors)
    for s, p, t in zip(summed, in_place, tensors):
        torch.testing.assert_close(s, t * hvd.size())
        torch.testing.assert_close(p, t * hvd.size())


@pytest.mark.usefixtures("multi_rank")
def test_horovod_allreduce_error_shape_mismatch_is_runtime_error() -> None:
    shape = [17] * 3
    shape[1] = 10 * (hvd.rank() + 1)
    with pytest.raises(RuntimeError):
        hvd.allreduce(torch.ones(shape), name="dropin.shape_mismatch")


@pytest.mark.usefixtures("multi_rank")
def test_horovod_allreduce_type_error_is_runtime_error() -> None:
    dtype = torch.int32 if hvd.rank() % 2 == 0 else torch.float32
    with pytest.raises(RuntimeError):
        hvd.allreduce(torch.ones(17, 17, dtype=dtype), name="dropin.dtype_mismatch")


def test_horovod_allreduce_duplicate_name_error_is_value_error() -> None:
    tensor = _tensor(torch.float32, 1)
    first = hvd.allreduce_async(tensor, name="dropin.duplicate")
    with pytest.raises(ValueError):
        hvd.allreduce_async(tensor, name="dropin.duplicate")
    hvd.synchronize(first)


# -- allgather, broadcast, alltoall, reducescatter -------------------------------------------------
def test_horovod_allgather_variable_first_dimension() -> None:
    for dtype, dim in itertools.product(DTYPES, DIMS):
        rows = hvd.rank() + 1
        tensor = torch.full([rows] + [4] * (dim - 1), hvd.rank()).to(dtype)
        gathered = hvd.allgather(tensor)
        expected = torch.cat([torch.full([r + 1] + [4] * (dim - 1), r) for r in range(hvd.size())])
        assert gathered.dtype == dtype
        assert torch.equal(gathered, expected.to(dtype))


@pytest.mark.usefixtures("multi_rank")
def test_horovod_allgather_error_is_runtime_error() -> None:
    tensor = torch.ones(2, 3 + hvd.rank())
    with pytest.raises(RuntimeError):
        hvd.allgather(tensor, name="dropin.allgather_mismatch")


def test_horovod_broadcast_and_broadcast_inplace() -> None:
    for dtype, root in itertools.product(DTYPES, range(hvd.size())):
        tensor = torch.full((5, 3), hvd.rank()).to(dtype)
        out = hvd.broadcast(tensor, root_rank=root)
        assert torch.all(tensor == hvd.rank())  # out of place: input untouched
        assert torch.all(out == root) and out.dtype == dtype
        assert hvd.broadcast_(tensor, root_rank=root) is tensor
        assert torch.all(tensor == root)


@pytest.mark.usefixtures("multi_rank")
def test_horovod_broadcast_rank_mismatch_is_runtime_error() -> None:
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(3), root_rank=hvd.rank(), name="dropin.root_mismatch")


def test_horovod_alltoall_with_splits() -> None:
    # Rank r sends q + 1 rows of value r to rank q; it receives rank + 1 rows from each peer.
    splits = torch.tensor([q + 1 for q in range(hvd.size())], dtype=torch.int32)
    tensor = torch.full((int(splits.sum()), 2), float(hvd.rank()))
    out, received = hvd.alltoall(tensor, splits=splits)
    expected = torch.cat([torch.full((hvd.rank() + 1, 2), float(q)) for q in range(hvd.size())])
    assert torch.equal(out, expected)
    assert received.tolist() == [hvd.rank() + 1] * hvd.size()


def test_horovod_reducescatter() -> None:
    tensor = _tensor(torch.float64, 2)[: 2 * hvd.size()]
    out = hvd.reducescatter(tensor, op=hvd.Sum)
    torch.testing.assert_close(out, tensor[2 * hvd.rank() : 2 * hvd.rank() + 2] * hvd.size())


def test_horovod_barrier_and_objects() -> None:
    hvd.barrier()
    obj = hvd.broadcast_object({"rank": hvd.rank(), "items": [1, 2]}, root_rank=0)
    everyone = hvd.allgather_object(hvd.rank() * 10)
    assert obj == {"rank": 0, "items": [1, 2]}
    assert everyone == [r * 10 for r in range(hvd.size())]


# -- DistributedOptimizer as Horovod scripts use it ------------------------------------------------
def _data(rank: int, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps)]


def test_broadcast_state_sets_every_rank_alike() -> None:
    torch.manual_seed(hvd.rank())  # different on every rank until broadcast
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    lrs = hvd.allgather_object(optimizer.param_groups[0]["lr"])
    assert _allclose_all_ranks(list(model.parameters()))
    assert lrs == [0.01] * hvd.size()


def test_duplicate_and_unnamed_parameters_are_value_errors() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    named = [("same", p) for p in model.parameters()]
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
    with pytest.raises(ValueError):
        partial = list(model.named_parameters())[:1]
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), partial)


def test_gradient_clipping_with_synchronize_and_skip_synchronize() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    reference = [p.detach().clone() for p in model.parameters()]
    # This rank's own gradients, from a twin without the optimizer's hooks: the wrapped model's
    # p.grad is averaged in place by the engine while backward still runs, so a clone taken
    # after backward may already hold the average on one rank and not on another.
    twin = copy.deepcopy(model)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = _data(hvd.rank())[0]
    F.mse_loss(twin(x), y).backward()
    local = [p.grad.clone() for p in twin.parameters()]  # type: ignore[union-attr]
    F.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    averaged = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    expected = [
        hvd.allreduce(g, op=hvd.Average, name=f"dropin.clip.{i}") for i, g in enumerate(local)
    ]
    prior = torch.cat([g.reshape(-1) for g in averaged]).norm()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step() after synchronize()" warning inside the context
        with optimizer.skip_synchronize():
            optimizer.step()
    for a, e in zip(averaged, expected):
        torch.testing.assert_close(a, e)
    assert prior > 0.01
    torch.testing.assert_close(
        torch.cat([g.reshape(-1) for g in clipped]).norm(), torch.tensor(0.01)
    )
    # The step used the clipped gradients, not a second reduction of the unclipped ones.
    for p, r, c in zip(model.parameters(), reference, clipped):
        torch.testing.assert_close(p.detach(), r - 0.1 * c)


def test_dynamic_requires_grad_gan() -> None:
    """Horovod's test_dynamic_requires_grad: generator and discriminator take turns."""
    torch.manual_seed(1234)
    gen, disc = nn.Conv2d(1, 10, 1), nn.Conv2d(10, 1, 1)
    inp = torch.rand(1, 1, 20, 20)
    gen_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(gen.parameters(), lr=0.1), named_parameters=gen.named_parameters()
    )
    disc_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(disc.parameters(), lr=0.1), named_parameters=disc.named_parameters()
    )
    wrong: list[str] = []

    def train_step(train_generator: bool, train_discriminator: bool) -> None:
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        for which, module, trained in (
            ("gen", gen, train_generator),
            ("disc", disc, train_discriminator),
        ):
            for p in module.parameters():
                has_grad = p.grad is not None and bool(p.grad.abs().max() > 0)
                if has_grad != trained:
                    wrong.append(f"{which}: trained={trained} grad={has_grad}")
        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    for _ in range(5):
        train_step(False, True)
        train_step(True, False)
    same = _allclose_all_ranks([*gen.parameters(), *disc.parameters()])
    assert not wrong, wrong
    assert same


def test_sparse_embeddings_match_sparse_as_dense() -> None:
    def train(sparse_as_dense: bool) -> list[torch.Tensor]:
        torch.manual_seed(5)
        model = nn.Embedding(20, 4, sparse=True)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            named_parameters=model.named_parameters(),
            sparse_as_dense=sparse_as_dense,
        )
        g = torch.Generator().manual_seed(100 + hvd.rank())
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randint(0, 20, (6,), generator=g)).pow(2).sum().backward()
            optimizer.step()
        return [model.weight.detach().clone()]

    sparse, dense = train(False), train(True)
    same = _allclose_all_ranks(sparse)
    torch.testing.assert_close(sparse[0], dense[0])
    assert same


def test_join_with_uneven_data() -> None:
    """Rank r has r + 2 batches; each joins when out of data; the last to join broadcasts."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for x, y in _data(hvd.rank(), steps=hvd.rank() + 2):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    last = hvd.join()
    lasts = hvd.allgather_object(last)
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    same = _allclose_all_ranks(list(model.parameters()))
    assert isinstance(last, int)
    assert lasts == [hvd.size() - 1] * hvd.size()
    assert same
