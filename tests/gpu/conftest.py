"""tests/gpu: device tensors and CUDA kernels (DESIGN.md, Tests). Without a CUDA device every
test here is skipped with the reason printed (``pytest tests/gpu -rs``), so CI, which has no
GPU, collects them and reports them skipped instead of failing or hiding them.

The hook below marks every item collected under this folder. It cannot help a module that
fails to import without CUDA, so modules that need CUDA at import time also skip themselves
first, with the same reason (``pytest.skip(NO_CUDA, allow_module_level=True)``).

These tests run one process on one GPU: DistributedOptimizer and the DDP hook take their whole
path there all the same (``COMMLAYER_FORCE_FULL_PATH``: else they are the identity over one
rank), in this process and in the jobs the tests start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from commlayer.common import config

NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests when torch sees no CUDA device (this hook sees the whole
    session's items, so only those under tests/gpu are marked)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _full_path() -> Iterator[None]:
    with config.override(force_full_path=1):
        yield
