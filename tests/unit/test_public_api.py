"""``from commlayer import *`` gives the public API (issue 49): Horovod's names, and the two
subpackages its users reach through hvd (elastic, compression), not the internal modules that
commlayer's own imports leave as attributes (runtime, config, ops, core, ...), which still
import by their paths."""

from __future__ import annotations

import types

import commlayer


def test_all_lists_the_public_api_and_no_internal_module() -> None:
    modules = {n for n in commlayer.__all__ if isinstance(getattr(commlayer, n), types.ModuleType)}
    assert modules == {"elastic", "compression"}
    horovod = ["init", "allreduce", "allreduce_async_", "DistributedOptimizer", "Compression",
               "broadcast_parameters", "ProcessSet", "Average", "HorovodInternalError"]  # fmt: skip
    assert set(horovod) <= set(commlayer.__all__)
    assert not [n for n in commlayer.__all__ if n.startswith("_")]


def test_the_internal_modules_still_import_by_their_paths() -> None:
    from commlayer.common import config
    from commlayer.core import runtime

    assert commlayer.runtime is runtime and commlayer.config is config
