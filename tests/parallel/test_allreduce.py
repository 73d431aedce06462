"""allreduce and grouped_allreduce (issue #2) under real MPI, against a locally computed reference.

Covered: every op on every dtype; the call forms (blocking, in place, async + poll +
synchronize, grouped); the default op and the deprecated ``average=``; prescale/postscale;
rounding of 16-bit floats and results bitwise equal on every rank; integer Average truncating
toward zero; scalar and zero-element tensors; a name reused with another shape.

Collectives first, asserts last: a rank that fails an assert must not leave the others waiting
in a collective it never reaches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from collective_reference import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    OPS,
    SIGNED_INT_DTYPES,
    assert_reduced,
    assert_same_on_every_rank,
    dtype_id,
    every_rank_small_ints,
    gather_rows,
    random_floats,
    seed_of,
)

import commlayer as cl

FORMS = ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_")
GROUPED_FORMS = (
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
)
# One of each kind of member a group can hold: scalar, zero-element, one element, odd sizes.
GROUP_SHAPES = ((), (0,), (1,), (7,), (2, 3))


def _op_dtype_params() -> Iterator[Any]:
    for dtype in ALL_DTYPES:
        for op in OPS:
            if not (dtype == torch.bool and op == cl.Average):  # refused: see below
                yield pytest.param(dtype, op, id=f"{dtype_id(dtype)}-{op.name}")


def _run(form: str, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """One allreduce of ``tensor`` through ``form`` (any FORMS or GROUPED_FORMS entry)."""
    if form.startswith("grouped"):
        return _run_grouped(form, [tensor], **kwargs)[0]
    if form in ("allreduce", "allreduce_"):
        return getattr(cl, form)(tensor, **kwargs)
    handle = getattr(cl, form)(tensor, **kwargs)
    result = cl.synchronize(handle)
    assert cl.poll(handle) is True, f"rank {cl.rank()}: poll is not True after synchronize"
    return result


def _run_grouped(form: str, tensors: list[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
    if form in ("grouped_allreduce", "grouped_allreduce_"):
        return getattr(cl, form)(tensors, **kwargs)
    handle = getattr(cl, form)(tensors, **kwargs)
    polled = cl.poll(handle)
    results = cl.synchronize(handle)
    assert isinstance(polled, bool) and cl.poll(handle) is True
    return results


@pytest.mark.parametrize(("dtype", "op"), list(_op_dtype_params()))
def test_every_op_on_every_dtype(dtype: torch.dtype, op: cl.ReduceOp) -> None:
    name = f"allreduce.matrix.{dtype_id(dtype)}.{op.name}"
    inputs = every_rank_small_ints(seed_of(name), (3, 5), dtype, nonzero=op == cl.Product)
    result = cl.allreduce(inputs[cl.rank()], op=op, name=name)
    assert_reduced(result, inputs, op)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("form", FORMS)
def test_call_forms(form: str, layout: str) -> None:
    name = f"allreduce.form.{form}.{layout}"
    inputs = every_rank_small_ints(seed_of(name), (4, 3), torch.float32)
    mine = inputs[cl.rank()].clone()
    tensor = mine if layout == "contiguous" else mine.t().contiguous().t()  # same values
    result = _run(form, tensor, op=cl.Sum, name=name)
    if form.endswith("_"):
        assert_reduced(tensor, inputs, cl.Sum)
        assert result.data_ptr() == tensor.data_ptr(), f"rank {cl.rank()}: {form} not in place"
    else:
        assert_reduced(result, inputs, cl.Sum)
        assert result is not tensor
        assert torch.equal(tensor, inputs[cl.rank()]), f"rank {cl.rank()}: {form} changed input"


@pytest.mark.parametrize(
    ("kwargs", "op"),
    [({}, cl.Average), ({"average": True}, cl.Average), ({"average": False}, cl.Sum)],
    ids=["default", "average_true", "average_false"],
)
@pytest.mark.parametrize("form", FORMS + GROUPED_FORMS)
def test_default_op_is_average_and_deprecated_average(
    form: str, kwargs: dict[str, bool], op: cl.ReduceOp
) -> None:
    name = f"allreduce.default_op.{form}.{sorted(kwargs.items())}"
    inputs = every_rank_small_ints(seed_of(name), (6,), torch.float64)
    result = _run(form, inputs[cl.rank()].clone(), name=name, **kwargs)
    assert_reduced(result, inputs, op)


@pytest.mark.parametrize("form", ["allreduce", "allreduce_async_", "grouped_allreduce"])
@pytest.mark.parametrize("op", [cl.Sum, cl.Average], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.int32, torch.uint8], ids=dtype_id)
def test_prescale_postscale(dtype: torch.dtype, op: cl.ReduceOp, form: str) -> None:
    # Integer factors for integer dtypes keep the expected result free of truncation questions.
    pre, post = (0.3, 1.7) if dtype.is_floating_point else (2.0, 3.0)
    name = f"allreduce.scale.{dtype_id(dtype)}.{op.name}.{form}"
    inputs = every_rank_small_ints(seed_of(name), (5,), dtype)
    result = _run(
        form,
        inputs[cl.rank()].clone(),
        op=op,
        prescale_factor=pre,
        postscale_factor=post,
        name=name,
    )
    assert_reduced(result, inputs, op, prescale=pre, postscale=post)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_float_rounding_and_same_bits_on_every_rank(dtype: torch.dtype) -> None:
    # 1031 elements: above MPICH's short-message size (another algorithm than recursive
    # doubling for float16 too), and not divisible by 2, 3 or 4 ranks.
    name = f"allreduce.rounding.{dtype_id(dtype)}"
    inputs = [random_floats(seed_of(name), r, (1031,), dtype) for r in range(cl.size())]
    summed = cl.allreduce(inputs[cl.rank()], op=cl.Sum, name=f"{name}.sum")
    averaged = cl.allreduce(inputs[cl.rank()], op=cl.Average, name=f"{name}.average")
    rows = gather_rows(torch.cat([summed, averaged]), f"{name}.gather")
    assert_reduced(summed, inputs, cl.Sum)
    assert_reduced(averaged, inputs, cl.Average)
    assert_same_on_every_rank(rows)


@pytest.mark.parametrize("dtype", SIGNED_INT_DTYPES, ids=dtype_id)
def test_integer_average_truncates_toward_zero(dtype: torch.dtype) -> None:
    # Rank 0 holds -7..7, the others zeros: the mean is value / size, rounded toward zero
    # (-7 / 2 -> -3, where floor division would give -4).
    values = torch.arange(-7, 8)
    mine = values if cl.rank() == 0 else torch.zeros_like(values)
    result = cl.allreduce(mine.to(dtype), op=cl.Average, name=f"allreduce.trunc.{dtype}")
    expected = torch.div(values, cl.size(), rounding_mode="trunc")
    assert result.dtype == dtype
    assert torch.equal(result.long(), expected), f"got {result.tolist()}, want {expected.tolist()}"


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3)], ids=["scalar", "empty", "empty_3d"])
@pytest.mark.parametrize("form", FORMS + GROUPED_FORMS[:1])
def test_scalar_and_zero_element_tensors(form: str, shape: tuple[int, ...]) -> None:
    name = f"allreduce.shape.{form}.{shape}"
    inputs = every_rank_small_ints(seed_of(name), shape, torch.float64)
    result = _run(form, inputs[cl.rank()].clone(), op=cl.Sum, name=name)
    assert_reduced(result, inputs, cl.Sum)


def test_a_name_is_reused_with_another_shape_and_dtype() -> None:
    # The repeats hit the response cache; a new shape or dtype must replace the cached entry.
    name = "allreduce.reused"
    signatures = [
        ((3,), torch.float32),
        ((3,), torch.float32),
        ((2, 4), torch.float32),
        ((2, 4), torch.int16),
        ((2, 4), torch.int16),
        ((5,), torch.float64),
    ]
    runs = []
    for i, (shape, dtype) in enumerate(signatures):
        inputs = every_rank_small_ints(seed_of(f"{name}.{i}"), shape, dtype)
        runs.append((cl.allreduce(inputs[cl.rank()], op=cl.Sum, name=name), inputs))
    for result, inputs in runs:
        assert_reduced(result, inputs, cl.Sum)


@pytest.mark.parametrize("form", GROUPED_FORMS)
def test_grouped_forms(form: str) -> None:
    name = f"grouped.form.{form}"
    inputs = [
        every_rank_small_ints(seed_of(f"{name}.{i}"), shape, torch.float32)
        for i, shape in enumerate(GROUP_SHAPES)
    ]
    mine = [per_rank[cl.rank()].clone() for per_rank in inputs]
    mine[-1] = mine[-1].t().contiguous().t()  # a non-contiguous member
    results = _run_grouped(form, mine, op=cl.Sum, name=name)
    assert len(results) == len(GROUP_SHAPES)
    for i, result in enumerate(results):
        assert_reduced(result, inputs[i], cl.Sum)
        if form.endswith("_"):
            assert_reduced(mine[i], inputs[i], cl.Sum)
            assert result.data_ptr() == mine[i].data_ptr(), f"{form} member {i} not in place"
        else:
            assert torch.equal(mine[i], inputs[i][cl.rank()]), f"{form} changed member {i}"


@pytest.mark.parametrize("form", GROUPED_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16], ids=dtype_id)
def test_grouped_contiguous_members_with_average_and_scaling(form: str, dtype: torch.dtype) -> None:
    # All members contiguous: the group is checked in one pass and travels as one fusion entry.
    name = f"grouped.contiguous.{form}.{dtype_id(dtype)}"
    inputs = [
        every_rank_small_ints(seed_of(f"{name}.{i}"), shape, dtype)
        for i, shape in enumerate(GROUP_SHAPES)
    ]
    mine = [per_rank[cl.rank()].clone() for per_rank in inputs]
    averaged = _run_grouped(form, mine, op=cl.Average, name=name)
    again = [per_rank[cl.rank()].clone() for per_rank in inputs]
    scaled = _run_grouped(
        form, again, op=cl.Sum, prescale_factor=2.0, postscale_factor=0.5, name=f"{name}.s"
    )
    for i, per_rank in enumerate(inputs):
        assert_reduced(averaged[i], per_rank, cl.Average)
        assert_reduced(scaled[i], per_rank, cl.Sum)
        if form.endswith("_"):
            assert averaged[i] is mine[i] and scaled[i] is again[i]
        else:
            assert torch.equal(mine[i], per_rank[cl.rank()]), f"{form} changed member {i}"


def test_grouped_in_place_on_parameters_that_require_grad() -> None:
    # The fast path hands the engine the parameters themselves, not detached aliases.
    name = "grouped.parameters"
    inputs = [
        every_rank_small_ints(seed_of(f"{name}.{i}"), shape, torch.float32)
        for i, shape in enumerate([(3, 2), (5,)])
    ]
    params = [torch.nn.Parameter(per_rank[cl.rank()].clone()) for per_rank in inputs]
    returned = cl.grouped_allreduce_(params, op=cl.Sum, name=name)
    for param, result, per_rank in zip(params, returned, inputs, strict=True):
        assert result is param and isinstance(result, torch.nn.Parameter)
        assert param.requires_grad and param.grad_fn is None
        assert_reduced(param.detach(), per_rank, cl.Sum)


def test_many_small_groups_and_singles_in_flight_together() -> None:
    name = "grouped.mixed"
    groups = [
        [
            every_rank_small_ints(seed_of(f"{name}.{g}.{i}"), (i + 1,), torch.float32)
            for i in range(4)
        ]
        for g in range(5)
    ]
    singles = [
        every_rank_small_ints(seed_of(f"{name}.s{g}"), (3,), torch.float32) for g in range(5)
    ]
    handles = []
    for g in range(5):
        handles.append(
            cl.grouped_allreduce_async(
                [t[cl.rank()] for t in groups[g]], op=cl.Sum, name=f"{name}.{g}"
            )
        )
        handles.append(cl.allreduce_async(singles[g][cl.rank()], op=cl.Sum, name=f"{name}.s{g}"))
    results = [cl.synchronize(h) for h in handles]
    for g in range(5):
        for member, per_rank in zip(results[2 * g], groups[g], strict=True):
            assert_reduced(member, per_rank, cl.Sum)
        assert_reduced(results[2 * g + 1], singles[g], cl.Sum)


def _grouped_dtype_params() -> Iterator[Any]:
    for dtype in ALL_DTYPES:
        for op in (cl.Sum, cl.Average):
            if not (dtype == torch.bool and op == cl.Average):
                yield pytest.param(dtype, op, id=f"{dtype_id(dtype)}-{op.name}")


@pytest.mark.parametrize(("dtype", "op"), list(_grouped_dtype_params()))
def test_grouped_every_dtype(dtype: torch.dtype, op: cl.ReduceOp) -> None:
    # A group is packed into one fusion buffer: the path single tensors do not take.
    name = f"grouped.dtype.{dtype_id(dtype)}.{op.name}"
    inputs = [
        every_rank_small_ints(seed_of(f"{name}.{i}"), shape, dtype)
        for i, shape in enumerate(GROUP_SHAPES)
    ]
    results = cl.grouped_allreduce([per_rank[cl.rank()] for per_rank in inputs], op=op, name=name)
    for result, per_rank in zip(results, inputs, strict=True):
        assert_reduced(result, per_rank, op)


def test_in_place_forms_return_their_argument() -> None:
    tensors = [torch.ones(3) for _ in range(6)]
    returned = [
        cl.allreduce_(tensors[0], name="in_place.allreduce_"),
        cl.synchronize(cl.allreduce_async_(tensors[1], name="in_place.allreduce_async_")),
        cl.grouped_allreduce_([tensors[2]], name="in_place.grouped_allreduce_")[0],
        cl.synchronize(cl.grouped_allreduce_async_([tensors[3]], name="in_place.grouped_async_"))[
            0
        ],
        cl.broadcast_(tensors[4], 0, name="in_place.broadcast_"),
        cl.synchronize(cl.broadcast_async_(tensors[5], 0, name="in_place.broadcast_async_")),
    ]
    forms = [
        "allreduce_",
        "allreduce_async_",
        "grouped_",
        "grouped_async_",
        "broadcast_",
        "b_async_",
    ]
    wrong = [form for form, got, arg in zip(forms, returned, tensors) if got is not arg]
    assert not wrong, f"rank {cl.rank()}: {wrong} returned another tensor object"


@pytest.mark.parametrize(
    "call",
    [
        lambda t: cl.allreduce(t),  # Average is the default
        lambda t: cl.allreduce_(t, op=cl.Average),
        lambda t: cl.grouped_allreduce([t], average=True),
        lambda t: cl.reducescatter(t),
    ],
    ids=["allreduce", "allreduce_", "grouped", "reducescatter"],
)
def test_average_of_bool_is_refused(call: Any) -> None:
    """A mean of booleans has no bool value; Sum/Max (or) and Min/Product (and) do."""
    with pytest.raises(ValueError, match=f"rank {cl.rank()}: .*Average is not defined for bool"):
        call(torch.ones(cl.size(), dtype=torch.bool))


# -- Adasum ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["out_of_place", "in_place", "grouped"])
def test_adasum_combines_every_rank_in_horovods_tree(form: str) -> None:
    """allreduce(op=Adasum) on every rank equals the Adasum tree of all ranks' tensors computed
    locally (commlayer/algorithms/adasum.py): the same bits everywhere."""
    from commlayer.algorithms import adasum

    every = [
        torch.randn(6, 5, generator=torch.Generator().manual_seed(40 + r)) for r in range(cl.size())
    ]
    mine = every[cl.rank()].clone()
    want = adasum.combine(torch.stack([t * 0.5 for t in every])).view(6, 5) * 2.0
    if form == "out_of_place":
        got = cl.allreduce(mine, op=cl.Adasum, prescale_factor=0.5, postscale_factor=2.0)
        assert torch.equal(mine, every[cl.rank()])
    elif form == "in_place":
        got = cl.allreduce_(mine, op=cl.Adasum, prescale_factor=0.5, postscale_factor=2.0)
        assert got is mine
    else:
        got, other = cl.grouped_allreduce(
            [mine, mine[:2]], op=cl.Adasum, prescale_factor=0.5, postscale_factor=2.0
        )
        first_rows = adasum.combine(torch.stack([t[:2] * 0.5 for t in every])).view(2, 5) * 2.0
        assert torch.equal(other, first_rows)
    assert torch.equal(got, want)
