"""Convergence with each compressor: 2-rank training on scikit-learn's digits (issue #4).

The demo's CNN (examples/train_digits.py: its model and data split) trained with SGD momentum
for ``EPOCHS`` epochs on 2 ranks, once per compressor, and scored on the whole test set (360
images: one image is 0.28 points). Top-k at 1% with error feedback and 8-bit QSGD must land
within 1.5 points of uncompressed training; top-k without error feedback must be visibly worse,
which is why error feedback is on by default. Those three and the baseline are averaged over
``SEEDS`` (one seed's accuracy moves by ~1 point between seeds); the other compressors train
once and must reach ``FLOOR``.

Runs at 2 ranks only (about 30 s on 2 cores) and under mpiexec only; at other sizes and under
torchrun the tests skip, on every rank. Accuracy is the compressors', not the backend's:
test_compression.py checks under both launchers that each compressor's reduced gradient equals
that of the simulated job.
``benchmarks/compression.py`` imports ``train_digits`` to print the same table.
"""

from __future__ import annotations

import os
import statistics
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from launch import under_torchrun

import commlayer as cl

# trains the digits CNN once per compressor in a module fixture: ~40 s at 2 ranks on 2 cores
pytestmark = pytest.mark.slow

EPOCHS = 10
SEEDS = (0, 1, 2)
BATCH = 32  # per rank
LR = 0.05
FLOOR = 0.85  # 10 classes: chance is 0.10; uncompressed reaches ~0.99
AVERAGED = ["none", "topk:ratio=0.01", "topk:ratio=0.01,ef=0", "qsgd:levels=127"]
ONCE = [
    "fp16",
    "bf16",
    "qsgd:levels=7",
    "topk:ratio=0.01,mode=sampled",
    "randomk:ratio=0.01",
    "efsignsgd",
    "onebit",
    "powersgd:rank=2",
]
_EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _demo() -> tuple[type, object]:
    """The demo's model class and data split (importing it needs scikit-learn and tqdm)."""
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    sys.path.insert(0, os.path.abspath(_EXAMPLES))
    try:
        from train_digits import DigitsCNN, load_split
    finally:
        sys.path.pop(0)
    return DigitsCNN, load_split


def train_digits(spec: str, seed: int = 0, epochs: int = EPOCHS) -> float:
    """Test accuracy after ``epochs`` of data-parallel training with compression ``spec``."""
    digits_cnn, load_split = _demo()
    x_train, y_train, x_test, y_test = load_split(0)  # type: ignore[operator]
    torch.manual_seed(seed)  # same initial weights on every rank
    model = digits_cnn()
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=spec,
    )
    for epoch in range(epochs):
        order = torch.randperm(
            len(y_train), generator=torch.Generator().manual_seed(epoch + 100 * seed)
        )
        mine = order[cl.rank() :: cl.size()]
        for begin in range(0, len(mine) - BATCH + 1, BATCH):
            index = mine[begin : begin + BATCH]
            opt.zero_grad()
            F.cross_entropy(model(x_train[index]), y_train[index]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():  # every rank holds the same model: score the whole test set
        return float((model(x_test).argmax(1) == y_test).float().mean())


@pytest.fixture(scope="module")
def accuracy() -> dict[str, float]:
    """Test accuracy per compressor spec (the mean over SEEDS for AVERAGED)."""
    if cl.size() != 2:
        pytest.skip("the convergence runs are 2-rank runs")
    if under_torchrun():
        pytest.skip("the convergence runs once, under mpiexec (module docstring)")
    _demo()
    result = {
        spec: statistics.mean(train_digits(spec, seed) for seed in SEEDS) for spec in AVERAGED
    }
    result.update({spec: train_digits(spec) for spec in ONCE})
    return result


def test_topk_with_error_feedback_and_qsgd_8bit_match_uncompressed(
    accuracy: dict[str, float],
) -> None:
    baseline = accuracy["none"]
    assert baseline > 0.97, f"uncompressed training reached only {baseline:.2%}"
    for spec in ("topk:ratio=0.01", "qsgd:levels=127"):
        assert accuracy[spec] >= baseline - 0.015, f"{spec}: {accuracy[spec]:.2%} vs {baseline:.2%}"


def test_topk_without_error_feedback_is_visibly_worse(accuracy: dict[str, float]) -> None:
    without, with_ef = accuracy["topk:ratio=0.01,ef=0"], accuracy["topk:ratio=0.01"]
    assert without < accuracy["none"] - 0.015 and without < with_ef - 0.01, accuracy


@pytest.mark.parametrize("spec", ONCE)
def test_every_compressor_trains(accuracy: dict[str, float], spec: str) -> None:
    assert accuracy[spec] >= FLOOR, f"{spec}: {accuracy[spec]:.2%}"
