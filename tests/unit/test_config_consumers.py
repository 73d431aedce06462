"""Config resolved once (issue 19): every init() keyword reaches its consumer, an environment
change after init() changes nothing, config.py imports no module it configures (names are
checked by registries passed in), and compressors get rank and seed passed in."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import commlayer
from commlayer import compression, kernels
from commlayer.common import config
from commlayer.common.config import Validator
from commlayer.common.errors import ConfigError, NotInitializedError
from commlayer.compression import ErrorFeedback, Policy, QSGDCompressor
from commlayer.core import runtime
from commlayer.core.registries import REGISTRIES
from commlayer.kernels import reference

PACKAGE = Path(commlayer.__file__).parent
# Not the defaults (auto, none, allgather, auto), and each one a consumer can show.
SETTINGS = {
    "kernels": "torch",
    "compression": "fp16",
    "sparse_algorithm": "dsar",
    "allreduce_algorithm": "ring",
}


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """commlayer.init(**SETTINGS) on this one process (a 1-rank job), with the environment
    saying otherwise: init()'s keywords win."""
    monkeypatch.setenv("COMMLAYER_KERNELS", "numba")
    monkeypatch.setenv("COMMLAYER_COMPRESSION", "efsignsgd")
    monkeypatch.setenv("COMMLAYER_SPARSE_ALGORITHM", "gtopk")
    monkeypatch.setenv("COMMLAYER_ALLREDUCE_ALGORITHM", "tree")
    before = kernels.configured()
    commlayer.init(**SETTINGS)
    try:
        yield
    finally:
        commlayer.shutdown()
        kernels.use(before)


def _consumers() -> dict[str, str]:
    """What each consumer runs with, as the setting's name."""
    return {
        "kernels": kernels.configured(),
        "compression": runtime.config().compression,  # the optimizer's default compressor
        "sparse_algorithm": runtime.config().sparse_algorithm,
        "allreduce_algorithm": runtime.engine()._allreduce.algorithm,
    }


def test_every_init_keyword_reaches_its_consumer(started: None) -> None:
    assert _consumers() == SETTINGS
    assert runtime.config() == config.load(environ={}, **SETTINGS)
    x = torch.zeros(8)
    assert kernels.implementation("merge_sum", x) is reference  # numba under auto


def test_an_environment_change_after_init_changes_nothing(
    started: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved = runtime.config()
    monkeypatch.setenv("COMMLAYER_KERNELS", "auto")
    monkeypatch.setenv("COMMLAYER_COMPRESSION", "topk:ratio=0.5")
    monkeypatch.setenv("COMMLAYER_SPARSE_ALGORITHM", "allgather")
    monkeypatch.setenv("COMMLAYER_CYCLE_TIME", "9")
    assert _consumers() == SETTINGS
    assert runtime.config() is resolved


def test_override_is_seen_after_init_and_undone(started: None) -> None:
    with config.override(kernels="numba", sparse_algorithm="gtopk"):
        assert kernels.configured() == "numba"
        assert runtime.config().sparse_algorithm == "gtopk"
    assert _consumers() == SETTINGS


def test_config_before_init_and_after_shutdown_is_an_error() -> None:
    assert not runtime.is_initialized()
    with pytest.raises(NotInitializedError, match="init"):
        runtime.config()


def test_kernels_use_sets_the_choice_once() -> None:
    before = kernels.configured()
    try:
        kernels.use("torch")
        assert kernels.configured() == "torch"
        assert kernels.implementation("merge_sum", torch.zeros(4)) is reference
        with pytest.raises(ValueError, match="allowed: auto, cupy, numba, torch"):
            kernels.use("triton")
        assert kernels.configured() == "torch"
    finally:
        kernels.use(before)


# -- config.py and its registries --------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_config_imports_no_commlayer_module_but_errors() -> None:
    imported = _imports(PACKAGE / "common" / "config.py")
    ours = {name for name in imported if name.startswith("commlayer")}
    assert ours <= {"commlayer.common.errors", "commlayer.common.errors.ConfigError"}, ours


def test_kernels_and_compressors_do_not_import_the_runtime() -> None:
    compressors = list((PACKAGE / "compression").glob("*.py"))
    for path in [PACKAGE / "kernels" / "__init__.py", *compressors]:
        names = _imports(path)
        above = ("commlayer.core.runtime", "commlayer.core.engine", "commlayer.ops")
        assert not any(n.startswith(above) for n in names), (path, names)


def test_compression_base_does_not_import_error_feedback() -> None:
    base = _imports(PACKAGE / "compression" / "base.py")
    assert not any("error_feedback" in name or "factory" in name for name in base), base


def test_there_is_one_registry_per_registered_field() -> None:
    assert set(REGISTRIES) == set(config.REGISTERED_FIELDS)


def test_load_checks_names_against_the_registries_passed() -> None:
    only_ring = dict(REGISTRIES, allreduce_algorithm=Validator(lambda t: t, lambda: "anything"))
    loaded = config.load(environ={"COMMLAYER_ALLREDUCE_ALGORITHM": "made_up"}, registries=only_ring)
    assert loaded.allreduce_algorithm == "made_up"
    with pytest.raises(ConfigError, match=r"COMMLAYER_ALLREDUCE_ALGORITHM='made_up'.*one of auto"):
        config.load(environ={"COMMLAYER_ALLREDUCE_ALGORITHM": "made_up"}, registries=REGISTRIES)


def test_a_registered_name_without_its_registry_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="registries"):
        config.load(environ={"COMMLAYER_KERNELS": "torch"}, registries={})
    assert config.load(environ={"COMMLAYER_CYCLE_TIME": "2"}, registries={}).cycle_time_ms == 2.0


# -- compressors get rank and seed passed in ---------------------------------------------------
def _qsgd_payload(compressor: compression.Compressor) -> torch.Tensor:
    x = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    return compressor.compress(x, "w").payload[0]


def test_create_passes_rank_to_qsgd_so_ranks_round_differently() -> None:
    spec = "qsgd:levels=3,bucket=64"
    rank0, again, rank1, unknown = (compression.create(spec, rank=r) for r in (0, 0, 1, None))
    first = _qsgd_payload(rank0)
    assert torch.equal(first, _qsgd_payload(again))
    assert not torch.equal(first, _qsgd_payload(rank1))
    assert torch.equal(first, _qsgd_payload(unknown))  # no rank given: as rank 0


def test_create_binds_rank_to_a_compressor_made_without_one() -> None:
    made = QSGDCompressor(levels=3, bucket=64)
    assert compression.create(made, rank=1) is made and made.process_rank == 1
    compression.create(made, rank=2)  # already bound: kept
    assert made.process_rank == 1
    wrapped = ErrorFeedback(QSGDCompressor())
    compression.create(wrapped, rank=3)
    assert wrapped.inner.process_rank == 3  # type: ignore[attr-defined]


def test_create_passes_seed_unless_the_spec_sets_one() -> None:
    assert compression.create("qsgd", seed=5)._seed == 5  # type: ignore[attr-defined]
    assert compression.create("qsgd:seed=2", seed=5)._seed == 2  # type: ignore[attr-defined]
    assert compression.create("randomk:ratio=0.1,ef=0", seed=5).seed == 5  # type: ignore[attr-defined]
    assert compression.create("fp16", rank=1, seed=5).name == "fp16"  # takes neither


def test_a_spec_may_not_set_the_rank() -> None:
    with pytest.raises(ValueError, match=r"\['process_rank'\]; allowed: levels, bucket, seed, ef"):
        compression.create("qsgd:process_rank=1")


def test_policy_passes_rank_and_seed_to_every_compressor() -> None:
    policy = Policy("qsgd", per_parameter={"w": "qsgd:levels=7"}, rank=2, seed=9)
    for compressor in policy.compressors().values():
        assert compressor.process_rank == 2 and compressor._seed == 9  # type: ignore[attr-defined]
