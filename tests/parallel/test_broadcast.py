"""broadcast (issue #2) under real MPI: from every root, every dtype, the four call forms (in
place on a non-contiguous tensor included), scalar and zero-element tensors.

Every rank's input differs (seeded by rank), so a result equal to the root's input shows that
the root's data arrived, not that nothing moved.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from collective_reference import ALL_DTYPES, dtype_id, random_floats, seed_of, small_ints

import commlayer as cl

FORMS = ("broadcast", "broadcast_", "broadcast_async", "broadcast_async_")


def _run(form: str, tensor: torch.Tensor, root: int, name: str) -> Any:
    if form in ("broadcast", "broadcast_"):
        return getattr(cl, form)(tensor, root, name=name)
    return cl.synchronize(getattr(cl, form)(tensor, root_rank=root, name=name))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_from_every_root(dtype: torch.dtype) -> None:
    name = f"broadcast.dtype.{dtype_id(dtype)}"
    inputs = [small_ints(seed_of(name), r, (4, 3), dtype) for r in range(cl.size())]
    results = [
        cl.broadcast(inputs[cl.rank()], root, name=f"{name}.{root}") for root in range(cl.size())
    ]
    for root, result in enumerate(results):
        assert result.dtype == dtype and result.shape == (4, 3)
        assert torch.equal(result, inputs[root]), f"rank {cl.rank()}: root {root} not received"
    assert torch.equal(inputs[cl.rank()], small_ints(seed_of(name), cl.rank(), (4, 3), dtype))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("form", FORMS)
def test_call_forms_from_every_root(form: str, layout: str) -> None:
    name = f"broadcast.form.{form}.{layout}"
    inputs = [random_floats(seed_of(name), r, (3, 5), torch.float64) for r in range(cl.size())]
    tensors, results = [], []
    for root in range(cl.size()):
        mine = inputs[cl.rank()].clone()
        tensors.append(mine if layout == "contiguous" else mine.t().contiguous().t())
        results.append(_run(form, tensors[-1], root, f"{name}.{root}"))
    for root, (tensor, result) in enumerate(zip(tensors, results)):
        assert torch.equal(result, inputs[root]), f"rank {cl.rank()}: root {root} not received"
        if form.endswith("_"):
            assert torch.equal(tensor, inputs[root]), f"rank {cl.rank()}: {form} not in place"
        else:
            assert torch.equal(tensor, inputs[cl.rank()]), f"rank {cl.rank()}: {form} changed input"


@pytest.mark.parametrize("shape", [(), (0,), (2, 0)], ids=["scalar", "empty", "empty_2d"])
@pytest.mark.parametrize("form", FORMS)
def test_scalar_and_zero_element_tensors(form: str, shape: tuple[int, ...]) -> None:
    root = cl.size() - 1
    name = f"broadcast.shape.{form}.{shape}"
    inputs = [small_ints(seed_of(name), r, shape, torch.int32) for r in range(cl.size())]
    result = _run(form, inputs[cl.rank()].clone(), root, name)
    assert result.shape == shape
    assert torch.equal(result, inputs[root]), f"rank {cl.rank()}: got {result.tolist()}"
