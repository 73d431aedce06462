"""Compressors on one process: registry and specs, round trips on odd sizes and every float
dtype, QSGD's unbiasedness and variance bound, top-k against torch.topk, bit packing, error
feedback, the per-tensor policy, and malformed payloads refused with PayloadError."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from commlayer import compression
from commlayer.common.errors import PayloadError
from commlayer.compression import (
    Compressed,
    ErrorFeedback,
    Policy,
    PowerSGDCompressor,
    QSGDCompressor,
    RandomKCompressor,
    TopKCompressor,
    bitpack,
)
from commlayer.compression import base as compression_base
from commlayer.compression import topk as topk_module
from commlayer.compression.base import _REGISTRY, Compressor
from commlayer.core import wire

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ODD_SIZES = [1, 7, 513, 4099]
# Every built-in, as a spec; error feedback off so a round trip is one compress/decompress.
SPECS = [
    "none",
    "fp16",
    "bf16",
    "qsgd:levels=127",
    "qsgd:levels=7,bucket=64",
    "qsgd:levels=1000",
    "topk:ratio=0.1,ef=0",
    "topk:ratio=0.1,mode=sampled,ef=0",
    "randomk:ratio=0.3,ef=0",
    "efsignsgd:ef=0",
    "onebit:ef=0",
    "powersgd:rank=2,ef=0",
]


def _round_trip(compressor: Compressor, tensor: torch.Tensor, name: str = "t") -> torch.Tensor:
    """Compress, run the further rounds with the payload as its own reduction, decompress."""
    compressed = compressor.compress(tensor, name)
    while not compressed.final:
        compressed = compressor.next_round(compressed, name)  # type: ignore[attr-defined]
    return compressor.decompress(compressed)


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# -- registry and specs ------------------------------------------------------------------------
def test_builtins_are_available() -> None:
    names = {"none", "fp16", "bf16", "qsgd", "topk", "randomk", "efsignsgd", "onebit", "powersgd"}
    assert names <= set(compression.available())


def test_spec_parameters_reach_the_compressor() -> None:
    qsgd = compression.create("qsgd:levels=7,bucket=128")
    assert isinstance(qsgd, QSGDCompressor) and (qsgd.levels, qsgd.bucket, qsgd.bits) == (7, 128, 4)
    topk = compression.create("topk: ratio=0.05 , mode=sampled")
    assert isinstance(topk, ErrorFeedback) and isinstance(topk.inner, TopKCompressor)
    assert (topk.inner.ratio, topk.inner.mode) == (0.05, "sampled")


@pytest.mark.parametrize("spec", ["topk", "randomk", "efsignsgd", "onebit", "powersgd"])
def test_biased_compressors_get_error_feedback_by_default(spec: str) -> None:
    assert isinstance(compression.create(spec), ErrorFeedback)
    assert not isinstance(compression.create(spec + ":ef=0"), ErrorFeedback)


@pytest.mark.parametrize("spec", ["none", "fp16", "qsgd"])
def test_unbiased_compressors_have_no_error_feedback_unless_asked(spec: str) -> None:
    assert not isinstance(compression.create(spec), ErrorFeedback)
    assert isinstance(compression.create(spec + ":ef=1"), ErrorFeedback)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zip", r"unknown compressor 'zip'; available: .*qsgd.*topk"),
        ("topk:ratio=0", r"ratio must be a number in \(0, 1\], got 0"),
        ("topk:ratio=1.5", r"ratio must be a number in \(0, 1\], got 1.5"),
        ("topk:ratio=-0.1", r"ratio must be a number in \(0, 1\]"),
        ("randomk:ratio=2", r"ratio must be a number in \(0, 1\]"),
        ("topk:ratio=abc", r"ratio must be a number in \(0, 1\], got 'abc'"),
        ("qsgd:levels=0", r"levels must be an integer >= 1, got 0"),
        ("qsgd:levels=2.5", r"levels must be an integer >= 1, got 2.5"),
        ("qsgd:levels=40000", r"levels must be <= 32767"),
        ("qsgd:bucket=0", r"bucket must be an integer >= 1"),
        ("powersgd:rank=0", r"rank must be an integer >= 1"),
        ("topk:mode=fast", r"topk mode must be one of exact, sampled, got 'fast'"),
        ("topk:k=10", r"does not take parameter\(s\) \['k'\]; allowed: ratio, mode, seed, ef"),
        ("qsgd:level=3", r"allowed: levels, bucket, seed, ef"),
        ("topk:0.01", r"must be key=value"),
        ("topk:ef=2", r"ef=2 .* allowed 0 \(off\) or 1 \(on\)"),
    ],
)
def test_bad_spec_is_a_value_error_saying_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compression.create(spec)


def test_register_a_user_compressor() -> None:
    @compression.register("test_negate")
    class Negate:
        name = "test_negate"
        summable = True

        def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
            return Compressed([-tensor])

        def decompress(self, compressed: Compressed) -> torch.Tensor:
            return -compressed.payload[0]

    try:
        assert "test_negate" in compression.available()
        x = _randn((5,))
        assert torch.equal(_round_trip(compression.create("test_negate"), x), x)
        with pytest.raises(ValueError, match="already registered"):
            compression.register("test_negate")(type("Other", (), {}))
    finally:
        del _REGISTRY["test_negate"]


class _EntryPoint:
    """What importlib.metadata.entry_points yields, for a plug-in package not installed here."""

    def __init__(self, name: str, target: Any) -> None:
        self.name, self.value, self._target = name, "plugin:factory", target

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def test_entry_points_register_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    groups: list[str] = []

    def entry_points(group: str) -> list[_EntryPoint]:
        groups.append(group)
        return [
            _EntryPoint("test_plugin", compression.NoneCompressor),
            _EntryPoint("test_broken", ImportError("no module named plugin")),
        ]

    monkeypatch.setattr(compression.base.importlib.metadata, "entry_points", entry_points)
    try:
        assert isinstance(compression.create("test_plugin"), compression.NoneCompressor)
        assert groups[0] == "commlayer.compressors"
        assert "test_plugin" in compression.available()
        assert "test_broken" not in compression.available()  # logged and skipped
    finally:
        _REGISTRY.pop("test_plugin", None)


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", ODD_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_keeps_shape_and_dtype_and_bounds_the_error(
    spec: str, dtype: torch.dtype, size: int
) -> None:
    shape = (size,) if "powersgd" not in spec else (size, 3)
    x = _randn(shape, dtype, seed=size)
    y = _round_trip(compression.create(spec), x)
    assert y.shape == x.shape and y.dtype == x.dtype
    error = float((y.double() - x.double()).norm() / x.double().norm())
    # Each compressor's worst relative error at these sizes, by its math: qsgd's bound is
    # sqrt(min(b/s^2, sqrt(b)/s)); a sparsifier keeping a fraction r loses at most sqrt(1 - r)
    # of the norm; signs lose sqrt(1 - 2/pi) ~ 0.6 on Gaussian data; powersgd keeps >= 2 of 3
    # columns (or all of a 1-row matrix).
    bound = {
        "none": 0.0,
        "fp16": 1e-3,
        "bf16": 8e-3,
        "qsgd:levels=127": 0.3,
        "qsgd:levels=7,bucket=64": 1.7,
        "qsgd:levels=1000": 0.1,
        "randomk:ratio=0.3,ef=0": 1.0,
        "powersgd:rank=2,ef=0": 0.85,
    }.get(spec, 0.97)
    if size == 1 and spec.startswith(("topk", "efsignsgd", "onebit")):
        bound = 1e-2  # one element: kept exactly (up to the dtype), or its sign and magnitude
    half = dtype in (torch.float16, torch.bfloat16)
    assert error <= bound + (1e-2 if half else 1e-6), f"relative error {error:.3g}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_topk_keeps_exactly_the_largest_and_zeroes_the_rest(dtype: torch.dtype) -> None:
    x = _randn((4099,), dtype)
    k = math.ceil(0.05 * 4099)
    y = _round_trip(TopKCompressor(0.05), x)
    kept = torch.topk(x.float().abs(), k).indices
    assert set(torch.nonzero(y).view(-1).tolist()) == set(kept.tolist())
    assert torch.equal(y[kept], x[kept])


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 1.0])
@pytest.mark.parametrize("mode", ["exact", "sampled"])
def test_topk_selection_equals_torch_topk(mode: str, ratio: float) -> None:
    x = _randn((300_007,), seed=int(ratio * 1000))
    compressor = TopKCompressor(ratio, mode=mode)
    values, indices = compressor.compress(x, "t").payload
    k = math.ceil(ratio * x.numel())
    want = torch.topk(x.abs(), k)
    assert indices.dtype == torch.int32 and indices.numel() == values.numel() == k
    assert set(indices.tolist()) == set(want.indices.tolist())
    assert torch.equal(values.abs().sort().values, want.values.sort().values)
    assert compressor.fallbacks == 0


def test_topk_sampled_falls_back_to_exact_when_too_few_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A threshold from the sample that lets fewer than k through: exact top-k instead."""
    monkeypatch.setattr(topk_module, "_MARGIN", 0.5)  # threshold at ~k/2 candidates
    x = _randn((200_000,))
    want = set(torch.topk(x.abs(), 2000).indices.tolist())
    retried = TopKCompressor(0.01, mode="sampled")  # 0.5 -> 1.0 -> 2.0: the last lets k pass
    assert set(retried.select(x, 2000).tolist()) == want
    assert retried.retries >= 1 and retried.fallbacks == 0
    monkeypatch.setattr(topk_module, "_RETRIES", 0)
    compressor = TopKCompressor(0.01, mode="sampled")
    indices = compressor.select(x.abs(), 2000)
    assert compressor.fallbacks == 1
    assert set(indices.tolist()) == want


def test_randomk_positions_are_shared_per_name_and_step() -> None:
    ranks = [RandomKCompressor(0.01, seed=3) for _ in range(3)]  # one instance per "rank"
    x = _randn((50_000,))
    first = [r.indices("grad.w", x.numel()) for r in ranks]
    second = [r.indices("grad.w", x.numel()) for r in ranks]
    other = ranks[0].indices("grad.b", x.numel())
    assert all(torch.equal(first[0], f) for f in first) and torch.equal(second[0], second[1])
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[0][:400], other[:400])
    assert 0.99 * 500 <= first[0].numel() <= 500
    assert torch.equal(first[0], first[0].unique())


def test_randomk_payloads_sum_to_the_sparsified_sum() -> None:
    a, b = _randn((9000,), seed=1), _randn((9000,), seed=2)
    ca, cb = RandomKCompressor(0.1), RandomKCompressor(0.1)
    pa, pb = ca.compress(a, "w"), cb.compress(b, "w")
    pa.payload[0] += pb.payload[0]  # what the allreduce does in place
    summed = ca.decompress(pa)
    positions = pa.ctx[1]
    assert torch.allclose(summed[positions], (a + b)[positions])
    assert not summed[torch.ones(9000, dtype=torch.bool).index_fill_(0, positions, False)].any()


# -- QSGD ------------------------------------------------------------------------------------------
def _within_rounding_noise(
    draws: torch.Tensor, x: torch.Tensor, levels: int, bucket: int
) -> torch.Tensor:
    """Per element: is the mean of the draws within 6 standard errors of x? QSGD rounds
    |x_i| s / ||v|| up with probability p (its fractional part), so a draw's variance is
    (||v|| / s)^2 p (1 - p): zero where x_i sits on a level, tiny where p is."""
    padded = torch.cat([x, x.new_zeros(-x.numel() % bucket)]).view(-1, bucket)
    step = (padded.norm(dim=1, keepdim=True) / levels).expand_as(padded).reshape(-1)[: x.numel()]
    scaled = x.abs() / step
    p = scaled - scaled.floor()
    std_error = step * (p * (1 - p)).sqrt() / math.sqrt(draws.shape[0])
    return (draws.mean(dim=0) - x).abs() <= 6 * std_error + 1e-6


@pytest.mark.parametrize(("levels", "bucket"), [(1, 512), (7, 64), (127, 512)])
def test_qsgd_is_unbiased_and_within_its_variance_bound(levels: int, bucket: int) -> None:
    x = _randn((1000,), torch.float64, seed=levels)
    compressor = QSGDCompressor(levels=levels, bucket=bucket, seed=1)
    draws = torch.stack([compressor.decompress(compressor.compress(x, "x")) for _ in range(4000)])
    # Alistarh et al. Lemma 3.1, per bucket: E||Q(v) - v||^2 <= min(b/s^2, sqrt(b)/s) ||v||^2.
    padded = torch.cat([x, x.new_zeros(-x.numel() % bucket)]).view(-1, bucket)
    bound = sum(
        min(v.numel() / levels**2, math.sqrt(v.numel()) / levels) * float(v.norm()) ** 2
        for v in padded
    )
    mse = float(((draws - x) ** 2).sum(dim=1).mean())
    assert mse <= bound, f"mean squared error {mse:.4g} above the bound {bound:.4g}"
    assert _within_rounding_noise(draws, x, levels, bucket).all()


def test_the_unbiasedness_check_fails_for_round_to_nearest() -> None:
    """The check above can fail: rounding to the nearest level instead is biased."""
    x = _randn((1000,), torch.float64, seed=7)
    step = x.norm() / 7
    nearest = torch.round(x.abs() / step) * torch.sign(x) * step
    draws = nearest.expand(4000, -1)
    assert not _within_rounding_noise(draws, x, levels=7, bucket=1000).all()


@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (7, 4), (127, 8), (128, 16), (32767, 16)])
def test_qsgd_packs_into_the_fewest_bits(levels: int, bits: int) -> None:
    x = _randn((4096,))
    packed, norms = QSGDCompressor(levels=levels, bucket=512).compress(x, "x").payload
    assert packed.numel() * packed.element_size() == 4096 * bits // 8
    assert norms.dtype == torch.float32 and norms.numel() == 8


def test_qsgd_zero_bucket_decodes_to_zero() -> None:
    x = torch.zeros(1024)
    x[600] = 3.0
    y = _round_trip(QSGDCompressor(bucket=512), x)
    assert not y[:512].any() and y[600] == 3.0


# -- PowerSGD ------------------------------------------------------------------------------------
def test_powersgd_recovers_a_low_rank_matrix_exactly() -> None:
    u, v = _randn((40, 2), seed=1), _randn((2, 30), seed=2)
    m = u @ v
    y = _round_trip(PowerSGDCompressor(rank=2), m)
    assert torch.allclose(y, m, atol=1e-4)


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    m = _randn((60, 50), torch.float64, seed=3)
    compressor = PowerSGDCompressor(rank=4)
    errors = [float((_round_trip(compressor, m, "w") - m).norm()) for _ in range(30)]
    s = torch.linalg.svdvals(m)
    best = float(s[4:].pow(2).sum().sqrt())
    assert errors[-1] < errors[0] and errors[-1] <= 1.01 * best


def test_powersgd_next_rounds_of_a_bucket_equal_one_next_round_each() -> None:
    """The batched QR of a bucket's Ps (one shape twice, another once, a vector) gives the
    payloads, warm starts and error-feedback residuals of one next_round per tensor."""
    shapes = [(40, 30), (40, 30), (20, 50), (70,)]
    grads = [_randn(shape, torch.float64, seed=j) for j, shape in enumerate(shapes)]
    names = [f"g{j}" for j in range(len(shapes))]
    results = []
    for batched in (False, True):
        compressor = compression.create("powersgd:rank=3")
        for step in range(2):  # the second step starts from the warm starts and residuals
            firsts = [compressor.compress(g * (step + 1), n) for g, n in zip(grads, names)]
            rounds = list(zip(firsts, names))
            if batched:
                seconds = compressor.next_rounds(rounds)  # type: ignore[attr-defined]
            else:
                seconds = [compressor.next_round(c, n) for c, n in rounds]  # type: ignore[attr-defined]
        results.append(([None if c is None else c.payload[0] for c in seconds],
                        dict(compressor.residuals)))  # type: ignore[attr-defined]  # fmt: skip
    (one, one_residuals), (batch, batch_residuals) = results
    assert one[3] is None and batch[3] is None  # the vector travels in one round
    assert all(torch.equal(a, b) for a, b in zip(one[:3], batch[:3]))
    assert one_residuals.keys() == batch_residuals.keys()
    assert all(torch.equal(one_residuals[n], batch_residuals[n]) for n in one_residuals)


def test_powersgd_sends_vectors_and_small_matrices_as_they_are() -> None:
    compressor = PowerSGDCompressor(rank=4)
    for shape in [(100,), (3, 5)]:
        x = _randn(shape)
        compressed = compressor.compress(x, "v")
        assert compressed.final and compressed.payload[0] is x
    conv = _randn((16, 8, 3, 3))
    first = compressor.compress(conv, "conv")
    assert not first.final and first.payload[0].shape == (16, 4)
    second = compressor.next_round(first, "conv")
    assert second is not None and second.payload[0].shape == (72, 4)
    assert compressor.decompress(second).shape == conv.shape


# -- bit packing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 3, 8, 1001])
def test_bit_packing_round_trip(bits: int, count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    codes = torch.randint(0, 2**bits, (count,), generator=gen, dtype=torch.uint8)
    packed = bitpack.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(bitpack.unpack_bits(packed, bits, count), codes)


def test_bit_packing_layout_is_little_endian_within_a_byte() -> None:
    codes = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert bitpack.pack_bits(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4]


@pytest.mark.parametrize("count", [1, 31, 32, 33, 1000])
def test_signs_pack_32_to_an_int32(count: int) -> None:
    x = _randn((count,), seed=count)
    x[0] = 0.0  # zero counts as non-negative
    words = bitpack.pack_signs(x)
    assert words.dtype == torch.int32 and words.numel() == math.ceil(count / 32)
    assert torch.equal(bitpack.unpack_signs(words, count), x >= 0)


def test_sign_compressors_scale_by_their_means() -> None:
    x = torch.tensor([3.0, -1.0, 1.0, -3.0, 2.0])
    ef = _round_trip(compression.create("efsignsgd:ef=0"), x)
    assert torch.allclose(ef, torch.sign(x) * x.abs().mean())
    onebit = _round_trip(compression.create("onebit:ef=0"), x)
    assert torch.allclose(onebit, torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0]))


# -- error feedback ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.01", "randomk:ratio=0.05", "efsignsgd", "onebit", "powersgd:rank=1"]
)
def test_error_feedback_loses_nothing_only_delays_it(spec: str) -> None:
    """sum_t D(C(g_t + e_t)) + e_T = sum_t g_t: what was dropped is still in the residual."""
    compressor = compression.create(spec)
    assert isinstance(compressor, ErrorFeedback)
    sent, total = torch.zeros(64, 48, dtype=torch.float64), torch.zeros(64, 48, dtype=torch.float64)
    for step in range(20):
        g = _randn((64, 48), torch.float64, seed=step)
        sent += _round_trip(compressor, g, "w")
        total += g
    residual = compressor.residuals["w"]
    assert residual.abs().max() > 0
    torch.testing.assert_close(sent + residual, total, rtol=1e-9, atol=1e-9)


def test_error_feedback_beats_no_feedback_on_a_fixed_gradient() -> None:
    """Top-1% of a constant gradient: without feedback the same 1% is sent forever."""
    g = _randn((10_000,))
    with_ef, without = (
        compression.create("topk:ratio=0.01"),
        compression.create("topk:ratio=0.01,ef=0"),
    )
    sums = [torch.zeros_like(g), torch.zeros_like(g)]
    steps = 1000
    for _ in range(steps):
        sums[0] += _round_trip(with_ef, g, "g")
        sums[1] += _round_trip(without, g, "g")
    # With feedback the mean sent is g up to the bounded residual / steps (measured 0.04);
    # without, it is g's top 1% only (relative error sqrt(1 - top-1% share of the norm), 0.96).
    errors = [float((s / steps - g).norm() / g.norm()) for s in sums]
    assert errors[0] < 0.1 and errors[1] > 0.9, errors


def test_error_feedback_state_dict_round_trip() -> None:
    a = compression.create("topk:ratio=0.1")
    assert isinstance(a, ErrorFeedback)
    _round_trip(a, _randn((100,)), "w")
    state = a.state_dict()
    b = ErrorFeedback(TopKCompressor(0.1))
    b.load_state_dict(state)
    assert torch.equal(b.residuals["w"], a.residuals["w"])
    g = _randn((100,), seed=5)
    assert torch.equal(_round_trip(a, g, "w"), _round_trip(b, g, "w"))
    with pytest.raises(ValueError, match="already on"):
        ErrorFeedback(a)


# -- policy --------------------------------------------------------------------------------------
def test_policy_skips_small_and_non_float_tensors_but_casts_everything() -> None:
    policy = Policy("topk:ratio=0.1", per_parameter={"head.weight": "qsgd"}, min_numel=1024)
    big, small = torch.zeros(1024), torch.zeros(1023)
    assert isinstance(policy.choose("w", big), ErrorFeedback)
    assert policy.choose("w", small).name == "none"
    assert policy.choose("w", torch.zeros(4096, dtype=torch.int64)).name == "none"
    assert policy.choose("head.weight", big).name == "qsgd"
    assert Policy("fp16").choose("bias", torch.zeros(3)).name == "fp16"
    with pytest.raises(ValueError, match="min_numel"):
        Policy("none", min_numel=-1)


# -- malformed payloads ----------------------------------------------------------------------------
def _payload(spec: str, size: int = 2000) -> tuple[Compressor, Compressed]:
    compressor = compression.create(spec)
    return compressor, compressor.compress(_randn((size,)), "t")


def _decode(compressor: Compressor, compressed: Compressed, payload: list[torch.Tensor]) -> None:
    compressor.decompress(Compressed(payload, compressed.ctx))


@pytest.mark.parametrize(
    ("spec", "corrupt", "message"),
    [
        ("topk:ratio=0.1,ef=0", lambda p: [p[0][:-1], p[1]], "topk values has 199 elements"),
        ("topk:ratio=0.1,ef=0", lambda p: [p[0], p[1][:-1]], "topk indices has 199 elements"),
        ("topk:ratio=0.1,ef=0", lambda p: [p[0], p[1].clone().fill_(2000)], r"index 2000 out of"),
        ("topk:ratio=0.1,ef=0", lambda p: [p[0], p[1].clone().fill_(-1)], r"index -1 out of"),
        ("topk:ratio=0.1,ef=0", lambda p: [p[0], p[1].long()], "expected torch.int32"),
        ("qsgd", lambda p: [p[0], p[1].clone().fill_(float("nan"))], "qsgd norm holds nan"),
        ("qsgd", lambda p: [p[0], -p[1]], r"qsgd norm holds -.* >= 0"),
        (
            "qsgd",
            lambda p: [p[0][:-1], p[1]],
            "qsgd packed levels has 2047 elements, expected 2048",
        ),
        ("qsgd", lambda p: [p[0].clone().fill_(255), p[1]], "level 128 exceeds levels=127"),
        ("qsgd", lambda p: [p[0], p[1][:-1]], "qsgd norms has 3 elements, expected 4"),
        ("efsignsgd:ef=0", lambda p: [p[0][:-1], p[1]], "efsignsgd sign words has 62"),
        ("efsignsgd:ef=0", lambda p: [p[0], p[1] * float("inf")], "efsignsgd scale holds inf"),
        ("onebit:ef=0", lambda p: [p[0], p[1].flip(0)], "wrong signs"),
        ("onebit:ef=0", lambda p: [p[0], p[1][:1]], "onebit reconstruction values has 1"),
    ],
)
def test_malformed_payload_is_refused(spec: str, corrupt: Any, message: str) -> None:
    compressor, compressed = _payload(spec)
    _decode(compressor, compressed, compressed.payload)  # the intact payload decodes
    with pytest.raises(PayloadError, match=message):
        _decode(compressor, compressed, corrupt(compressed.payload))


def test_wire_records_round_trip_and_name_the_bad_rank() -> None:
    payloads = [[_randn((n,)), torch.arange(n, dtype=torch.int32)] for n in (5, 0, 3)]
    gathered = torch.cat([wire.pack(p) for p in payloads])
    records = wire.split(gathered, [torch.float32, torch.int32])
    assert len(records) == 3
    for got, want in zip(records, payloads):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(PayloadError, match="from rank 2: record of .* bytes overruns"):
        wire.split(gathered[:-8], [torch.float32, torch.int32])
    bad = torch.cat([wire.pack(payloads[0]), wire.pack(payloads[2])])
    bad[len(wire.pack(payloads[0])) + 8] = 7  # rank 1's first numel: header inconsistent
    with pytest.raises(PayloadError, match="from rank 1: record header"):
        wire.split(bad, [torch.float32, torch.int32])
    with pytest.raises(PayloadError, match="from rank 1: 8 bytes, shorter than a header"):
        wire.split(torch.cat([wire.pack(payloads[0]), bad[:8]]), [torch.float32, torch.int32])


@pytest.mark.parametrize(
    ("index_dtype", "index_shape", "value_dtype", "value_shape"),
    [
        (torch.int32, (), torch.float32, ()),  # top-k entries (the sparse reduction's)
        (torch.int64, (2,), torch.float16, (3, 4)),  # a hybrid COO tensor's (ops')
    ],
)
def test_wire_rows_round_trip_and_concatenate_by_entry(
    index_dtype: torch.dtype,
    index_shape: tuple[int, ...],
    value_dtype: torch.dtype,
    value_shape: tuple[int, ...],
) -> None:
    entries = []
    for nnz in (4, 0, 3):  # three ranks' entries
        indices = torch.randint(0, 1000, (nnz, *index_shape), dtype=index_dtype)
        entries.append((indices, _randn((nnz, *value_shape), value_dtype, seed=nnz)))
    rows = [wire.pack_rows(i, v) for i, v in entries]
    index_bytes = index_dtype.itemsize * math.prod(index_shape)
    value_bytes = value_dtype.itemsize * math.prod(value_shape)
    assert all(r.dtype == torch.uint8 and r.shape[1] == index_bytes + value_bytes for r in rows)
    # an allgather concatenates rows: the entries come back in rank order, each index with its value
    indices, values = wire.split_rows(
        torch.cat(rows), index_dtype, index_shape, value_dtype, value_shape
    )
    assert torch.equal(indices, torch.cat([i for i, _ in entries]))
    assert torch.equal(values, torch.cat([v for _, v in entries]))


def test_host_work_is_logged_once_per_reason_and_never_for_cpu_tensors(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # host_work only reads a device's type, so a CUDA device object needs no GPU here;
    # tests/gpu/test_compressors_cuda.py checks QSGD's own record on a real one.
    monkeypatch.setattr(compression_base, "_host_work_logged", set())
    with caplog.at_level("INFO", logger="commlayer"):
        for _ in range(3):
            compression_base.host_work("qsgd", torch.device("cpu"), "draws on the CPU")
            compression_base.host_work("qsgd", torch.device("cuda", 0), "draws on the CPU")
            compression_base.host_work("randomk", torch.device("cuda", 0), "positions")
    assert [r.getMessage() for r in caplog.records] == [
        "compressor qsgd on cuda:0: draws on the CPU",
        "compressor randomk on cuda:0: positions",
    ]


# -- issue 39: the cheaper paths give the generic results ----------------------------------------
def test_topk_default_is_the_sampled_threshold_and_error_feedback_keeps_the_rest() -> None:
    """Sampled top-k (the default) sends k entries; with error feedback what it did not send is
    the residual, exactly p - D(C(p)), built in place (ErrorFeedback + drop_sent_)."""
    compressor = compression.create("topk:ratio=0.01")
    assert isinstance(compressor, ErrorFeedback) and compressor.inner.mode == "sampled"
    first, second = _randn((200_000,), seed=1), _randn((200_000,), seed=2)
    compressor.compress(first, "g")
    residual = compressor.residuals["g"].clone()
    corrected = second + residual
    sent = compressor.compress(second, "g")
    values, indices = sent.payload
    k = math.ceil(0.01 * 200_000)
    assert values.numel() == indices.numel() == k  # k, not about k: the threshold only filters
    local = compressor.decompress(sent)
    torch.testing.assert_close(compressor.residuals["g"], corrected - local, rtol=0, atol=0)
    # what was sent plus what was kept back is every bit of the corrected gradient
    torch.testing.assert_close(local + compressor.residuals["g"], corrected, rtol=0, atol=0)
    assert compressor.inner.fallbacks == 0


@pytest.mark.parametrize("spec", ["randomk:ratio=0.05", "powersgd:rank=2", "topk:ratio=0.05"])
def test_fast_error_feedback_paths_equal_the_generic_one(spec: str) -> None:
    """drop_sent_ (top-k, random-k) and local_error (PowerSGD) against residual = p - D(C(p))."""
    fast = compression.create(spec, seed=4)
    generic = compression.create(spec, seed=4)
    assert isinstance(fast, ErrorFeedback) and isinstance(generic, ErrorFeedback)
    for step in range(3):
        g = _randn((96, 80), seed=10 + step)
        a = fast.compress(g, "w")
        corrected = g + generic.residuals["w"] if step else g
        b = generic.inner.compress(corrected, "w")
        while not a.final:
            a, b = fast.next_round(a, "w"), generic.inner.next_round(b, "w")  # type: ignore[attr-defined]
        generic.residuals["w"] = corrected - generic.inner.decompress(b)
        torch.testing.assert_close(fast.residuals["w"], generic.residuals["w"])


@pytest.mark.parametrize("spec", ["fp16", "bf16", "powersgd:rank=2"])
def test_decompress_into_writes_what_decompress_returns(spec: str) -> None:
    compressor = compression.create(spec)
    g = _randn((64, 50), seed=3)
    c = compressor.compress(g, "w")
    while not c.final:
        c = compressor.next_round(c, "w")  # type: ignore[attr-defined]
    out = torch.full_like(g, 7.0)
    compressor.decompress_into(c, out)  # type: ignore[attr-defined]
    torch.testing.assert_close(out, compressor.decompress(c).to(g.dtype).view(g.shape))


def test_topk_decompress_add_sums_scaled_records_and_checks_them() -> None:
    compressor = TopKCompressor(0.1)
    a, b = _randn((1000,), seed=1), _randn((1000,), seed=2)
    ca, cb = compressor.compress(a, "a"), compressor.compress(b, "b")
    out = torch.zeros(1000)
    compressor.decompress_add_(ca, out, 0.5)
    compressor.decompress_add_(cb, out, 0.5)
    want = (compressor.decompress(ca) + compressor.decompress(cb)) / 2
    torch.testing.assert_close(out, want)
    bad = Compressed([ca.payload[0], ca.payload[1].clone().fill_(5000)], ca.ctx)
    with pytest.raises(PayloadError, match="out of range"):
        compressor.decompress_add_(bad, out, 1.0)
