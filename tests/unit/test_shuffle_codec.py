"""The shard store's sample codec (commlayer/data/codec.py): arrays, tensors and numbers, alone
or in a tuple or list, stored as their raw bytes behind a few bytes of header; anything else
pickled; pickles written before the codec still decode; ``own_bytes`` is the arrays' nbytes
and 8 per number."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch

from commlayer.data.codec import COMPACT, decode, encode, header_size, own_bytes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


DIGITS = torch.arange(64, dtype=torch.float32).reshape(-1, 1, 8, 8)


@pytest.mark.parametrize(
    "sample",
    [
        (DIGITS[0][0], 7),  # a view of a bigger tensor: only its elements
        [np.arange(6, dtype=np.int16).reshape(2, 3), 1.5, -(2**63)],
        torch.tensor(3, dtype=torch.int64),
        np.zeros((0, 4), dtype=np.complex64),
        (torch.ones(3, dtype=torch.bool), np.array([1, 2], dtype=">i4").astype("<i4")),
        torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # not contiguous
    ],
)
def test_compact_samples_round_trip(sample: Any) -> None:
    data = encode(sample)
    assert data[0] == COMPACT
    back = decode(data)
    assert _same(sample, back), (sample, back)
    if isinstance(back, torch.Tensor):
        back.add_(1)  # writable: no warning, no shared buffer


def test_a_digits_sample_takes_its_own_bytes_and_ten_more() -> None:
    data = encode((DIGITS[0], 5))
    assert own_bytes(data) == 256 + 8
    assert header_size(data) == 10 and len(data) == 274
    assert len(pickle.dumps((DIGITS[0].numpy(), 5), protocol=5)) > 380  # what it was


@pytest.mark.parametrize(
    "sample",
    [
        "text",
        {"x": torch.ones(2)},
        ((torch.ones(2), 1), 2),  # nested
        2**70,
        np.array(["a", "b"]),
        np.array([1.0], dtype=">f8"),  # not native byte order
        torch.ones(2, requires_grad=True),
    ],
)
def test_other_samples_are_pickled_and_count_whole(sample: Any) -> None:
    data = encode(sample)
    assert data[0] == 0x80, "a pickle"
    assert own_bytes(data) == len(data) and header_size(data) == 0
    back = decode(data)
    if isinstance(sample, torch.Tensor):
        assert torch.equal(back, sample.detach())
    elif isinstance(sample, np.ndarray):
        assert np.array_equal(back, sample)
    elif not isinstance(sample, dict | tuple):
        assert back == sample


def test_a_sample_pickled_before_the_codec_still_decodes() -> None:
    old = pickle.dumps((np.arange(4, dtype=np.float32), 3), protocol=pickle.HIGHEST_PROTOCOL)
    array, label = decode(old)
    assert label == 3 and np.array_equal(array, np.arange(4, dtype=np.float32))


def test_a_cut_compact_sample_is_an_error() -> None:
    data = encode((DIGITS[0], 5))
    with pytest.raises((ValueError, IndexError)):
        decode(data[:-3])
