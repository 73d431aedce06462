"""Reference for the collective tests: deterministic per-rank inputs, and what a collective must
return, computed locally.

1. Every input is a function of (seed, rank), so each rank regenerates every other rank's input
   and knows the expected result without communicating.
2. ``small_ints`` are integers in [-3, 3]: exact in every dtype (bfloat16 included), and any sum
   or product over 4 ranks fits int8, so Sum, Min, Max and Product must match exactly. Only
   Average (a division) and the scale factors round; ``assert_reduced`` bounds that rounding by
   the dtype's epsilon, tight enough that a missing or doubled rank, or a wrong divisor, fails.
3. Seeds come from ``seed_of(text)`` (crc32), never ``hash()``: string hashes differ per process.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

import commlayer as cl

ALL_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
NUMERIC_DTYPES = tuple(d for d in ALL_DTYPES if d != torch.bool)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIGNED_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
OPS = (cl.Sum, cl.Average, cl.Min, cl.Max, cl.Product)


def dtype_id(dtype: torch.dtype) -> str:
    """Short name for test ids: 'float16'."""
    return str(dtype).removeprefix("torch.")


def seed_of(text: str) -> int:
    return zlib.crc32(text.encode())


def _generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + rank)


def small_ints(
    seed: int, rank: int, shape: Sequence[int], dtype: torch.dtype, *, nonzero: bool = False
) -> torch.Tensor:
    """Rank ``rank``'s input: integers in [-3, 3] ([0, 3] for uint8, {0, 1} for bool).
    ``nonzero`` turns zeros into ones, so a Product is not mostly zeros. A bool input's first
    element is True and its second False on every rank, so that logical and/or results of
    both values occur at any number of ranks."""
    low, high = (0, 2) if dtype == torch.bool else (0, 4) if dtype == torch.uint8 else (-3, 4)
    values = torch.randint(low, high, tuple(shape), generator=_generator(seed, rank))
    if nonzero:
        values = torch.where(values == 0, 1, values)
    if dtype == torch.bool and values.numel() >= 2:
        values.view(-1)[:2] = torch.tensor([1, 0])
    return values.to(dtype)


def every_rank_small_ints(
    seed: int, shape: Sequence[int], dtype: torch.dtype, *, nonzero: bool = False
) -> list[torch.Tensor]:
    """``small_ints`` of every rank, in rank order."""
    return [small_ints(seed, r, shape, dtype, nonzero=nonzero) for r in range(cl.size())]


def random_floats(seed: int, rank: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: standard normal values (not exact: sums round)."""
    return torch.randn(tuple(shape), generator=_generator(seed, rank), dtype=torch.float64).to(
        dtype
    )


def _scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """tensor * factor; integers truncate toward zero (docs/reference/collectives.md: integer
    Average truncates)."""
    scaled = tensor.double() * factor
    return scaled if tensor.is_floating_point() else scaled.trunc().long()


def reduce_reference(
    inputs: Sequence[torch.Tensor],
    op: cl.ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected, rounding bound) of reducing ``inputs`` (one per rank) with ``op``.

    Expected is float64 for floating dtypes, int64 for integers (bound 0: exact), bool for bool
    (Sum/Max: any, Min/Product: all; Average is refused for bool). The bound
    allows one rounding to the dtype per term and per partial result, plus the scaling.
    """
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(list(inputs))
        logical_and = op in (cl.Min, cl.Product)
        return (stack.all(0) if logical_and else stack.any(0)), torch.zeros(())
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    terms = torch.stack([_scale(t.to(wide), prescale) for t in inputs])
    if op in (cl.Sum, cl.Average):
        combined, magnitude = terms.sum(0), terms.abs().sum(0)
    else:
        reduce = {cl.Min: terms.amin, cl.Max: terms.amax, cl.Product: terms.prod}[op]
        combined = reduce(0)
        magnitude = combined.abs()
    factor = postscale / len(inputs) if op == cl.Average else postscale
    expected = _scale(combined, factor)
    if not dtype.is_floating_point:
        return expected, torch.zeros(())
    bound = (len(inputs) + 2) * torch.finfo(dtype).eps * magnitude.double() * abs(factor)
    return expected, bound


def assert_reduced(
    actual: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    op: cl.ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> None:
    """``actual`` is the reduction of ``inputs`` (one per rank) by ``op``, within rounding."""
    expected, bound = reduce_reference(inputs, op, prescale, postscale)
    assert_within(actual, expected, bound, inputs[0].dtype)


def assert_within(
    actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype
) -> None:
    """actual has ``dtype``, expected's shape, and differs from it by at most ``bound``."""
    assert actual.dtype == dtype, f"rank {cl.rank()}: dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, (
        f"rank {cl.rank()}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    )
    if dtype == torch.bool or not dtype.is_floating_point:
        assert torch.equal(actual.to(expected.dtype), expected), (
            f"rank {cl.rank()}: got {actual.tolist()}, expected {expected.tolist()}"
        )
        return
    error = (actual.double() - expected).abs()
    assert bool((error <= bound).all()), (
        f"rank {cl.rank()}: {dtype} result off by up to {error.max().item():.3g} "
        f"(allowed {bound.max().item():.3g}): got {actual.tolist()}, expected {expected.tolist()}"
    )


def block_rows(dim0: int, size: int) -> list[int]:
    """Rows of dim 0 each rank gets from reducescatter: the first dim0 % size get one extra."""
    return [dim0 // size + (1 if r < dim0 % size else 0) for r in range(size)]


def gather_rows(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's ``tensor`` flattened, one row per rank (to compare results across ranks)."""
    return cl.allgather(tensor.detach().reshape(1, -1), name=name)


def assert_same_on_every_rank(rows: torch.Tensor) -> None:
    """Every row of ``gather_rows``'s result is bitwise equal to this rank's."""
    raw = rows.contiguous().view(torch.uint8)  # bits, so -0.0 != 0.0 and NaN == NaN
    differ = [r for r in range(raw.shape[0]) if not torch.equal(raw[r], raw[cl.rank()])]
    assert not differ, f"rank {cl.rank()}: ranks {differ} hold a different result"
