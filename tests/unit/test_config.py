"""Configuration: defaults, every COMMLAYER_* variable, errors that name variable, value and
what is allowed, unknown variables, explicit arguments over the environment, override()."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from commlayer.common import config
from commlayer.common.config import Config
from commlayer.common.errors import ConfigError

SIM_TABLE = Path(__file__).with_name("sim_table_one_node.jsonl")
DEFAULTS = {
    "fusion_threshold_bytes": 64 * 1024 * 1024,
    "min_bucket_bytes": 1024 * 1024,
    "cycle_time_ms": 1.0,
    "cache_capacity": 1024,
    "compression": "none",
    "compression_hierarchy": "auto",
    "timeline_path": "",
    "stall_check_time_s": 60.0,
    "stall_shutdown_time_s": 600.0,  # 10 minutes: a stall is an error by default (issue 38)
    "log_level": "info",  # rank 0's start-up line shows by default
    "allreduce_algorithm": "auto",
    "topology": "",
    "sparse_algorithm": "allgather",
    "kernels": "auto",
    "cuda_ptx_dir": "",
    "wait_policy": "auto",
    "malloc_tuning": True,
    "auto_tuning": True,
    "join_mode": "horovod",
    "init_timeout_s": 60.0,
    "collective_timeout_s": 60.0,
    "backend": "auto",
    "cuda_aware_mpi": None,
    "nccl": None,
    "sim_table": "",
    "force_full_path": False,
    "window_buckets": False,
    "line_output": False,
    "planned_skip_negotiation": False,
}

# (variable, text, Config field, parsed value)
GOOD = [
    ("COMMLAYER_FUSION_THRESHOLD", "0", "fusion_threshold_bytes", 0),
    ("COMMLAYER_MIN_BUCKET_BYTES", "0", "min_bucket_bytes", 0),
    ("COMMLAYER_MIN_BUCKET_BYTES", "4MiB", "min_bucket_bytes", 4 << 20),
    ("COMMLAYER_FUSION_THRESHOLD", "1000", "fusion_threshold_bytes", 1000),
    ("COMMLAYER_FUSION_THRESHOLD", "5b", "fusion_threshold_bytes", 5),
    ("COMMLAYER_FUSION_THRESHOLD", "4K", "fusion_threshold_bytes", 4 << 10),
    ("COMMLAYER_FUSION_THRESHOLD", "4k", "fusion_threshold_bytes", 4 << 10),
    ("COMMLAYER_FUSION_THRESHOLD", "4KB", "fusion_threshold_bytes", 4 << 10),
    ("COMMLAYER_FUSION_THRESHOLD", "4KiB", "fusion_threshold_bytes", 4 << 10),
    ("COMMLAYER_FUSION_THRESHOLD", "32M", "fusion_threshold_bytes", 32 << 20),
    ("COMMLAYER_FUSION_THRESHOLD", "32mb", "fusion_threshold_bytes", 32 << 20),
    ("COMMLAYER_FUSION_THRESHOLD", " 32 MiB ", "fusion_threshold_bytes", 32 << 20),
    ("COMMLAYER_FUSION_THRESHOLD", "2G", "fusion_threshold_bytes", 2 << 30),
    ("COMMLAYER_FUSION_THRESHOLD", "2GiB", "fusion_threshold_bytes", 2 << 30),
    ("COMMLAYER_CYCLE_TIME", "5", "cycle_time_ms", 5.0),
    ("COMMLAYER_CYCLE_TIME", "0.25", "cycle_time_ms", 0.25),
    ("COMMLAYER_CYCLE_TIME", "1e-3", "cycle_time_ms", 1e-3),
    ("COMMLAYER_CACHE_CAPACITY", "0", "cache_capacity", 0),
    ("COMMLAYER_CACHE_CAPACITY", "4096", "cache_capacity", 4096),
    ("COMMLAYER_CACHE_CAPACITY", "1048576", "cache_capacity", 1 << 20),  # the most
    ("COMMLAYER_CYCLE_TIME", "1000", "cycle_time_ms", 1000.0),  # the most
    ("COMMLAYER_COMPRESSION", " fp16 ", "compression", "fp16"),
    ("COMMLAYER_COMPRESSION", "qsgd:levels=7,bucket=8", "compression", "qsgd:levels=7,bucket=8"),
    ("COMMLAYER_COMPRESSION", "topk:ratio=0.01", "compression", "topk:ratio=0.01"),
    ("COMMLAYER_TIMELINE", "/tmp/trace.json", "timeline_path", "/tmp/trace.json"),
    ("COMMLAYER_TIMELINE", "/tmp/trace.{rank}.json", "timeline_path", "/tmp/trace.{rank}.json"),
    ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "0", "stall_check_time_s", 0.0),
    ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "2.5", "stall_check_time_s", 2.5),
    ("COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS", "0", "stall_shutdown_time_s", 0.0),
    ("COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS", "30", "stall_shutdown_time_s", 30.0),
    ("COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS", "604800", "stall_shutdown_time_s", 604800.0),
    ("COMMLAYER_LINE_OUTPUT", "on", "line_output", True),
    ("COMMLAYER_LINE_OUTPUT", "off", "line_output", False),
    ("COMMLAYER_LOG_LEVEL", "trace", "log_level", "trace"),
    ("COMMLAYER_LOG_LEVEL", "debug", "log_level", "debug"),
    ("COMMLAYER_LOG_LEVEL", "INFO", "log_level", "info"),
    ("COMMLAYER_LOG_LEVEL", " Warning ", "log_level", "warning"),
    ("COMMLAYER_LOG_LEVEL", "error", "log_level", "error"),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", "auto", "allreduce_algorithm", "auto"),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", " Ring ", "allreduce_algorithm", "ring"),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", "shm", "allreduce_algorithm", "shm"),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", "rabenseifner", "allreduce_algorithm", "rabenseifner"),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", "shd", "allreduce_algorithm", "shd"),
    ("COMMLAYER_TOPOLOGY", " nodes=2,local=2 ", "topology", "nodes=2,local=2"),
    ("COMMLAYER_TOPOLOGY", "torus=2x3", "topology", "torus=2x3"),
    ("COMMLAYER_SPARSE_ALGORITHM", "auto", "sparse_algorithm", "auto"),
    ("COMMLAYER_SPARSE_ALGORITHM", " DSAR ", "sparse_algorithm", "dsar"),
    ("COMMLAYER_SPARSE_ALGORITHM", "topo_sparse", "sparse_algorithm", "topo_sparse"),
    ("COMMLAYER_SPARSE_ALGORITHM", "allgather", "sparse_algorithm", "allgather"),
    ("COMMLAYER_COMPRESSION_HIERARCHY", " Host ", "compression_hierarchy", "host"),
    ("COMMLAYER_COMPRESSION_HIERARCHY", "flat", "compression_hierarchy", "flat"),
    ("COMMLAYER_KERNELS", "torch", "kernels", "torch"),
    ("COMMLAYER_KERNELS", " Numba ", "kernels", "numba"),
    ("COMMLAYER_KERNELS", "auto", "kernels", "auto"),
    ("COMMLAYER_CUDA_PTX_DIR", "/opt/ptx", "cuda_ptx_dir", "/opt/ptx"),
    ("COMMLAYER_WAIT_POLICY", " Passive ", "wait_policy", "passive"),
    ("COMMLAYER_WAIT_POLICY", "active", "wait_policy", "active"),
    ("COMMLAYER_WAIT_POLICY", "auto", "wait_policy", "auto"),
    ("COMMLAYER_MALLOC_TUNING", " OFF ", "malloc_tuning", False),
    ("COMMLAYER_MALLOC_TUNING", "on", "malloc_tuning", True),
    ("COMMLAYER_AUTO_TUNING", "Off", "auto_tuning", False),
    ("COMMLAYER_JOIN_MODE", " Active", "join_mode", "active"),
    ("COMMLAYER_JOIN_MODE", "horovod", "join_mode", "horovod"),
    ("COMMLAYER_INIT_TIMEOUT_SECONDS", "2.5", "init_timeout_s", 2.5),
    ("COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS", "5", "collective_timeout_s", 5.0),
    ("COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS", "0", "collective_timeout_s", 0.0),
    ("COMMLAYER_BACKEND", " Torch ", "backend", "torch"),
    ("COMMLAYER_BACKEND", "mpi", "backend", "mpi"),
    ("COMMLAYER_CUDA_AWARE_MPI", " 1", "cuda_aware_mpi", True),
    ("COMMLAYER_CUDA_AWARE_MPI", "AUTO", "cuda_aware_mpi", None),
    ("COMMLAYER_NCCL", "0", "nccl", False),
    ("COMMLAYER_FORCE_FULL_PATH", "1", "force_full_path", True),
    ("COMMLAYER_FORCE_FULL_PATH", " 0 ", "force_full_path", False),
    ("COMMLAYER_WINDOW_BUCKETS", "on", "window_buckets", True),
    ("COMMLAYER_WINDOW_BUCKETS", "0", "window_buckets", False),
    # one vocabulary for every boolean: 1/0, true/false, on/off, yes/no, any case
    ("COMMLAYER_FORCE_FULL_PATH", "True", "force_full_path", True),
    ("COMMLAYER_PLANNED_SKIP_NEGOTIATION", "on", "planned_skip_negotiation", True),
    ("COMMLAYER_LINE_OUTPUT", " YES", "line_output", True),
    ("COMMLAYER_AUTO_TUNING", "no", "auto_tuning", False),
    ("COMMLAYER_MALLOC_TUNING", "0", "malloc_tuning", False),
    ("COMMLAYER_NCCL", "On", "nccl", True),
    ("COMMLAYER_CUDA_AWARE_MPI", "false", "cuda_aware_mpi", False),
    ("COMMLAYER_SIM_TABLE", str(SIM_TABLE), "sim_table", str(SIM_TABLE)),
]

_BYTES = "a non-negative integer number of bytes, optionally with K/M/G suffix"
_POSITIVE = "a finite number > 0"
_NONNEG_INT = "an integer >= 0"
_NONNEG = "a finite number >= 0 (0 disables)"
_CACHE_RANGE = "an integer >= 0 and at most 1048576 (0 disables)"
_WEEK = "at most 604800 (7 days), in seconds"
_LEVELS = "one of trace, debug, info, warning, error"
_ALGORITHM = "one of auto, native, shm, hierarchical, rabenseifner, recursive_doubling, ring, shd"
_TOPOLOGY = "comma-separated nodes=N, local=L, torus=RxC"
_SPARSE = "one of auto, allgather, dsar, gtopk, ssar_recursive_doubling, ssar_split_allgather"
_KERNELS = "one of auto, cupy, numba, torch"
_WAIT = "one of auto, active, passive"
_BOOL = "a boolean: 1, true, on, yes or 0, false, off, no (any case)"
_AUTO_BOOL = "auto or " + _BOOL
_COMPRESSOR = "a compressor 'name' or 'name:key=value,...' with a valid name (none, fp16, bf16"

# (variable, text, what the message says is allowed)
BAD = [
    ("COMMLAYER_FUSION_THRESHOLD", "abc", _BYTES),
    ("COMMLAYER_FUSION_THRESHOLD", "-1", _BYTES),
    ("COMMLAYER_FUSION_THRESHOLD", "1.5M", _BYTES),
    ("COMMLAYER_FUSION_THRESHOLD", "10T", _BYTES),
    ("COMMLAYER_FUSION_THRESHOLD", "M", _BYTES),
    ("COMMLAYER_FUSION_THRESHOLD", " ", _BYTES),
    ("COMMLAYER_CYCLE_TIME", "-1", _POSITIVE),
    ("COMMLAYER_CYCLE_TIME", "0", _POSITIVE),
    ("COMMLAYER_CYCLE_TIME", "nan", _POSITIVE),
    ("COMMLAYER_CYCLE_TIME", "inf", _POSITIVE),
    ("COMMLAYER_CYCLE_TIME", "1ms", _POSITIVE),
    ("COMMLAYER_CACHE_CAPACITY", "-1", _NONNEG_INT),
    ("COMMLAYER_CACHE_CAPACITY", "1.5", _NONNEG_INT),
    ("COMMLAYER_CACHE_CAPACITY", "lots", _NONNEG_INT),
    # allocated whole at init(): 200000000 took 9.6 GB a rank, 1e23 a raw OverflowError
    ("COMMLAYER_CACHE_CAPACITY", "200000000", _CACHE_RANGE),
    ("COMMLAYER_CACHE_CAPACITY", "1048577", _CACHE_RANGE),
    ("COMMLAYER_CACHE_CAPACITY", "1e23", _CACHE_RANGE),
    ("COMMLAYER_CACHE_CAPACITY", "1" + "0" * 23, _CACHE_RANGE),
    ("COMMLAYER_CYCLE_TIME", "1000.5", "a finite number > 0, at most 1000"),
    # accepted once, then failing inside torch (timedelta) or at exit (threading.TIMEOUT_MAX)
    ("COMMLAYER_INIT_TIMEOUT_SECONDS", "1e308", _WEEK),
    ("COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS", "1e308", _WEEK),
    ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "1e308", _WEEK),
    ("COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS", "604801", _WEEK),
    ("COMMLAYER_COMPRESSION", "zip", _COMPRESSOR),
    ("COMMLAYER_COMPRESSION", "topk:ratio=0", _COMPRESSOR),
    ("COMMLAYER_COMPRESSION", "topk:ratio=1.5", _COMPRESSOR),
    ("COMMLAYER_COMPRESSION", "topk:k=10", _COMPRESSOR),
    ("COMMLAYER_COMPRESSION", "qsgd:levels=0", _COMPRESSOR),
    ("COMMLAYER_COMPRESSION", "topk:0.01", _COMPRESSOR),
    ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "-1", _NONNEG),
    ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "nan", _NONNEG),
    ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "inf", _NONNEG),
    ("COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS", "-0.5", _NONNEG),
    ("COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS", "soon", _NONNEG),
    ("COMMLAYER_LOG_LEVEL", "loud", _LEVELS),
    ("COMMLAYER_LOG_LEVEL", "critical", _LEVELS),
    ("COMMLAYER_LOG_LEVEL", "10", _LEVELS),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", "nccl", _ALGORITHM),
    ("COMMLAYER_ALLREDUCE_ALGORITHM", "ring,tree", _ALGORITHM),
    ("COMMLAYER_TOPOLOGY", "nodes=0", _TOPOLOGY),
    ("COMMLAYER_TOPOLOGY", "nodes=2,nodes=2", _TOPOLOGY),
    ("COMMLAYER_TOPOLOGY", "torus=4", _TOPOLOGY),
    ("COMMLAYER_TOPOLOGY", "local=2x2", _TOPOLOGY),
    ("COMMLAYER_TOPOLOGY", "racks=2", _TOPOLOGY),
    ("COMMLAYER_SPARSE_ALGORITHM", "ring", _SPARSE),
    ("COMMLAYER_SPARSE_ALGORITHM", "dsar,gtopk", _SPARSE),
    ("COMMLAYER_COMPRESSION_HIERARCHY", "node", "one of auto, flat, host"),
    ("COMMLAYER_COMPRESSION_HIERARCHY", "1", "one of auto, flat, host"),
    ("COMMLAYER_KERNELS", "triton", _KERNELS),
    ("COMMLAYER_KERNELS", "cuda", _KERNELS),
    ("COMMLAYER_WAIT_POLICY", "spin", _WAIT),
    ("COMMLAYER_WAIT_POLICY", "1", _WAIT),
    ("COMMLAYER_MALLOC_TUNING", "2", _BOOL),
    ("COMMLAYER_MALLOC_TUNING", "jemalloc", _BOOL),
    ("COMMLAYER_AUTO_TUNING", "maybe", _BOOL),
    ("COMMLAYER_LINE_OUTPUT", "enable", _BOOL),
    ("COMMLAYER_JOIN_MODE", "exact", "one of horovod, active"),
    ("COMMLAYER_INIT_TIMEOUT_SECONDS", "0", _POSITIVE),
    ("COMMLAYER_INIT_TIMEOUT_SECONDS", "forever", _POSITIVE),
    ("COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS", "-1", "a finite number >= 0 (0 disables)"),
    ("COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS", "inf", "a finite number >= 0 (0 disables)"),
    ("COMMLAYER_BACKEND", "nccl", "one of auto, mpi, torch"),
    ("COMMLAYER_CUDA_AWARE_MPI", "maybe", _AUTO_BOOL),
    ("COMMLAYER_CUDA_AWARE_MPI", "2", _AUTO_BOOL),
    ("COMMLAYER_NCCL", "enabled", _AUTO_BOOL),
    ("COMMLAYER_FORCE_FULL_PATH", "y", _BOOL),
    ("COMMLAYER_FORCE_FULL_PATH", "auto", _BOOL),
    ("COMMLAYER_SIM_TABLE", "/no/such/table.jsonl", "/no/such/table.jsonl: cannot read"),
]


def test_defaults() -> None:
    assert dataclasses.asdict(Config()) == DEFAULTS
    assert config.load(environ={}) == Config()


def test_defaults_from_a_clean_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, _ in config.variables():
        monkeypatch.delenv(name, raising=False)
    assert config.load() == Config()


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().cycle_time_ms = 2.0  # type: ignore[misc]


def test_idle_cycle_time_is_100_cycles_but_at_least_5_ms() -> None:
    assert Config(cycle_time_ms=1.0).idle_cycle_time_ms == 100.0
    assert Config(cycle_time_ms=0.01).idle_cycle_time_ms == 5.0


@pytest.mark.parametrize(("variable", "text", "field", "value"), GOOD)
def test_variable_is_parsed(variable: str, text: str, field: str, value: Any) -> None:
    loaded = config.load(environ={variable: text})
    assert getattr(loaded, field) == value
    if DEFAULTS[field] is not None:  # None: an auto boolean's auto, else a bool
        assert type(getattr(loaded, field)) is type(DEFAULTS[field])
    others = {k: v for k, v in dataclasses.asdict(loaded).items() if k != field}
    assert others == {k: v for k, v in DEFAULTS.items() if k != field}


def test_every_variable_is_tested_and_sets_its_own_field() -> None:
    tested = {variable for variable, *_ in GOOD}
    assert tested == {name for name, _ in config.variables()}
    assert {field for _, _, field, _ in GOOD} == set(DEFAULTS)


def test_variable_read_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMLAYER_CYCLE_TIME", "7")
    monkeypatch.setenv("COMMLAYER_FUSION_THRESHOLD", "1M")
    loaded = config.load()
    assert (loaded.cycle_time_ms, loaded.fusion_threshold_bytes) == (7.0, 1 << 20)


def test_all_variables_together() -> None:
    environ = {variable: text for variable, text, *_ in GOOD}  # the last text of each wins
    loaded = config.load(environ=environ)
    for variable, text, field, value in GOOD:
        if environ[variable] == text:
            assert getattr(loaded, field) == value


@pytest.mark.parametrize("variable", [name for name, _ in config.variables()])
def test_empty_value_means_default(variable: str) -> None:
    assert config.load(environ={variable: ""}) == Config()


@pytest.mark.parametrize(("variable", "text", "allowed"), BAD)
def test_bad_value_names_variable_value_and_allowed(variable: str, text: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(environ={variable: text})
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert variable in message and repr(text) in message and allowed in message, message


@pytest.mark.parametrize(("variable", "text", "allowed"), BAD)
def test_parse_variable_rejects_the_same(variable: str, text: str, allowed: str) -> None:
    with pytest.raises(ConfigError, match=allowed.replace("(", r"\(").replace(")", r"\)")):
        config.parse_variable(variable, text)


def test_unknown_variable_like_none_lists_every_known_one_on_lines_of_their_own() -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(environ={"COMMLAYER_BOGUS": "1", "COMMLAYER_CYCLE_TIME": "2"})
    message = str(caught.value)
    assert repr("COMMLAYER_BOGUS") in message and "did you mean" not in message
    for known, _ in config.variables():
        assert known in message, f"the known variables belong in the message: {message}"
    assert max(len(line) for line in message.splitlines()) <= 100, message


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        ("COMMLAYER_FUSION_THRESHOLD_BYTES", "COMMLAYER_FUSION_THRESHOLD"),
        ("COMMLAYER_CYCLE_TIME_MS", "COMMLAYER_CYCLE_TIME"),
    ],
)
def test_unknown_variable_with_a_guess_names_the_guess_not_all_26(
    variable: str, meant: str
) -> None:
    """The guess was lost at the head of a line of 26 names: with one, the message points to
    the reference instead."""
    with pytest.raises(ConfigError) as caught:
        config.load(environ={variable: "1", "COMMLAYER_CYCLE_TIME": "2"})
    message = str(caught.value)
    assert repr(variable) in message and f"did you mean {meant}?" in message, message
    assert "COMMLAYER_WAIT_POLICY" not in message and "Configuration page" in message, message


def test_unknown_variables_are_all_named_and_others_ignored() -> None:
    environ = {"COMMLAYER_B": "1", "COMMLAYER_A": "1", "HOROVOD_FUSION_THRESHOLD": "x", "PATH": "/"}
    with pytest.raises(ConfigError, match="'COMMLAYER_A', 'COMMLAYER_B'"):
        config.load(environ=environ)
    assert config.load(environ={"HOROVOD_CYCLE_TIME": "-1", "COMMLAYERX": "1"}) == Config()


def test_parse_variable_unknown_name() -> None:
    with pytest.raises(ConfigError, match="COMMLAYER_NOPE"):
        config.parse_variable("COMMLAYER_NOPE", "1")


def test_variables_have_help_text() -> None:
    for name, help_text in config.variables():
        assert name.startswith("COMMLAYER_") and help_text.strip()


def test_launcher_environ_is_the_environment_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMLAYER_CYCLE_TIME", "3")
    monkeypatch.setenv("NOT_COMMLAYER_X", "1")
    passed = config.launcher_environ()
    assert passed["COMMLAYER_CYCLE_TIME"] == "3" and passed["NOT_COMMLAYER_X"] == "1"
    monkeypatch.setenv("COMMLAYER_CYCLE_TIME", "-3")
    with pytest.raises(ConfigError, match="COMMLAYER_CYCLE_TIME='-3'"):
        config.launcher_environ()


# -- explicit arguments ----------------------------------------------------------------------
def test_explicit_arguments_win_over_the_environment() -> None:
    environ = {"COMMLAYER_CYCLE_TIME": "5", "COMMLAYER_FUSION_THRESHOLD": "1M"}
    loaded = config.load(environ=environ, cycle_time_ms=2.0, fusion_threshold_bytes=0)
    assert (loaded.cycle_time_ms, loaded.fusion_threshold_bytes) == (2.0, 0)


def test_explicit_none_leaves_the_environment_in_charge() -> None:
    loaded = config.load(environ={"COMMLAYER_CYCLE_TIME": "5"}, cycle_time_ms=None)
    assert loaded.cycle_time_ms == 5.0


def test_unknown_explicit_setting_is_rejected() -> None:
    with pytest.raises(ConfigError, match="cycle_time"):
        config.load(environ={}, cycle_time=2.0)


@pytest.mark.parametrize(
    ("how", "setting"),
    [
        ("load", {"cycle_time_ms": -1.0}),
        ("load", {"fusion_threshold_bytes": "abc"}),
        ("load", {"cache_capacity": -3}),
        ("load", {"cache_capacity": 10**23}),
        ("load", {"collective_timeout_s": 1e308}),
        ("load", {"log_level": "loud"}),
        ("override", {"cycle_time_ms": -1.0}),
        ("override", {"stall_check_time_s": float("nan")}),
    ],
    ids=lambda p: p if isinstance(p, str) else next(iter(p)),
)
def test_bad_explicit_setting_raises_config_error(setting: dict[str, Any], how: str) -> None:
    ((field, value),) = setting.items()
    with pytest.raises(ConfigError) as caught:
        if how == "load":
            config.load(environ={}, **setting)
        else:
            with config.override(**setting):
                config.load(environ={})
    message = str(caught.value)
    assert field in message and repr(value) in message, message


def test_a_launcher_timeout_is_checked_by_the_same_bound() -> None:
    """commlayerrun's --elastic-timeout and --heartbeat-timeout (config.check_timeout_s)."""
    assert config.check_timeout_s("--elastic-timeout", 600.0) == 600.0
    assert config.check_timeout_s("--elastic-timeout", config.MAX_TIMEOUT_S) == 604800.0
    assert config.check_timeout_s("--stall", 0.0, zero_disables=True) == 0.0
    for value in (1e308, float("inf"), float("nan"), 0.0, -1.0, 604800.5):
        with pytest.raises(ConfigError) as caught:
            config.check_timeout_s("--heartbeat-timeout", value)
        assert str(caught.value) == (
            f"--heartbeat-timeout {value!r} is not valid: expected a finite number of seconds "
            "> 0, at most 604800 (7 days)"
        )


# -- override() ------------------------------------------------------------------------------
def test_override_applies_and_is_undone() -> None:
    with config.override(cycle_time_ms=0.5):
        assert config.load(environ={}).cycle_time_ms == 0.5
    assert config.load(environ={}) == Config()


def test_override_wins_over_environment_and_explicit_wins_over_override() -> None:
    environ = {"COMMLAYER_CYCLE_TIME": "5", "COMMLAYER_CACHE_CAPACITY": "7"}
    with config.override(cycle_time_ms=0.5):
        loaded = config.load(environ=environ)
        assert (loaded.cycle_time_ms, loaded.cache_capacity) == (0.5, 7)
        assert config.load(environ=environ, cycle_time_ms=3.0).cycle_time_ms == 3.0


def test_overrides_nest() -> None:
    with config.override(cycle_time_ms=0.5, cache_capacity=8):
        with config.override(cycle_time_ms=0.25):
            inner = config.load(environ={})
            assert (inner.cycle_time_ms, inner.cache_capacity) == (0.25, 8)
        outer = config.load(environ={})
        assert (outer.cycle_time_ms, outer.cache_capacity) == (0.5, 8)
    assert config.load(environ={}) == Config()


def test_overrides_closed_out_of_order_leave_the_rest() -> None:
    first, second = config.override(cycle_time_ms=0.5), config.override(cache_capacity=8)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    loaded = config.load(environ={})
    assert (loaded.cycle_time_ms, loaded.cache_capacity) == (1.0, 8)
    second.__exit__(None, None, None)
    assert config.load(environ={}) == Config()


def test_override_is_undone_when_the_block_raises() -> None:
    with pytest.raises(KeyError):
        with config.override(log_level="debug"):
            raise KeyError("boom")
    assert config.load(environ={}).log_level == "info"


def test_override_rejects_unknown_setting_on_entry() -> None:
    with pytest.raises(ConfigError, match="cycle_time"):
        with config.override(cycle_time=2.0):
            pytest.fail("the block must not run")
    assert config.load(environ={}) == Config()


def test_override_is_seen_by_other_threads() -> None:
    """The engine thread reads the config: an override in the test's thread must reach it."""
    seen: list[float] = []
    with config.override(cycle_time_ms=0.5):
        thread = threading.Thread(target=lambda: seen.append(config.load(environ={}).cycle_time_ms))
        thread.start()
        thread.join()
    assert seen == [0.5]


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        ("COMMLAYER_COMPRESION", "COMMLAYER_COMPRESSION"),
        ("COMMLAYER_CYCLE_TIME_MS", "COMMLAYER_CYCLE_TIME"),
        ("COMMLAYER_STALL_CHECK_TIME", "COMMLAYER_STALL_CHECK_TIME_SECONDS"),
        # by words: every variable with the word, not the one difflib found most alike
        ("COMMLAYER_ALGORITHM", "COMMLAYER_ALLREDUCE_ALGORITHM or COMMLAYER_SPARSE_ALGORITHM"),
        ("COMMLAYER_TIMEOUT",
         "COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS or COMMLAYER_INIT_TIMEOUT_SECONDS"),
        ("COMMLAYER_THRESHOLD_FUSION", "COMMLAYER_FUSION_THRESHOLD"),  # words swapped
        ("COMMLAYER_FUSIONTHRESHOLD", "COMMLAYER_FUSION_THRESHOLD"),  # run together
        ("COMMLAYER_ALGO", "COMMLAYER_ALLREDUCE_ALGORITHM or COMMLAYER_SPARSE_ALGORITHM"),
    ],
)  # fmt: skip
def test_misspelled_variable_suggests_the_known_one(variable: str, meant: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(environ={variable: "1"})
    assert f"did you mean {meant}?" in str(caught.value), caught.value
    with pytest.raises(ConfigError, match=f"did you mean {meant}"):
        config.parse_variable(variable, "1")


def test_unrelated_variable_suggests_nothing() -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(environ={"COMMLAYER_BOGUS": "1"})
    assert "did you mean" not in str(caught.value)


def test_misspelled_init_keyword_suggests_the_field() -> None:
    with pytest.raises(ConfigError, match=r"did you mean cycle_time_ms\?"):
        config.load(environ={}, cycle_time=2)


@pytest.mark.parametrize(
    ("variable", "text", "said"),
    [
        ("COMMLAYER_CYCLE_TIME", "1ms", "in milliseconds (the unit is fixed: write 1, not 1ms)"),
        ("COMMLAYER_CYCLE_TIME", "-1", "a finite number > 0, at most 1000, in milliseconds"),
        ("COMMLAYER_STALL_CHECK_TIME_SECONDS", "30s", "in seconds (the unit is fixed: write 30"),
        ("COMMLAYER_INIT_TIMEOUT_SECONDS", "2 min", "in seconds (the unit is fixed: write 2,"),
    ],
)
def test_bad_time_names_its_unit(variable: str, text: str, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(environ={variable: text})
    assert said in str(caught.value), caught.value


def test_bad_keyword_value_names_its_unit() -> None:
    with pytest.raises(ConfigError, match="in seconds"):
        config.load(environ={}, collective_timeout_s="1m")


def test_units_come_from_the_field_names() -> None:
    units = {v.field: v.unit for v in config.describe()}
    assert units["cycle_time_ms"] == "milliseconds"
    assert units["stall_shutdown_time_s"] == "seconds"
    assert units["min_bucket_bytes"] == "bytes"
    assert units["compression"] == ""


def test_describe_gives_each_default_as_a_user_writes_it() -> None:
    shown = {v.name: config.show_default(v) for v in config.describe()}
    assert shown["COMMLAYER_FUSION_THRESHOLD"] == "64 MiB"
    assert shown["COMMLAYER_MIN_BUCKET_BYTES"] == "1 MiB"
    assert shown["COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS"] == "60"
    assert shown["COMMLAYER_CYCLE_TIME"] == "1"
    assert shown["COMMLAYER_SIM_TABLE"] == "none"
    for variable in config.describe():
        assert variable.default == getattr(Config(), variable.field)
        assert variable.allowed  # the registered ones come from the installed registries too


# -- the elastic driver's job key ------------------------------------------------------------


def test_the_job_key_leaves_the_environment_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's children (DataLoader workers, any subprocess) do not inherit the job key;
    the worker keeps it for a re-init after the world re-formed."""
    monkeypatch.setattr(config, "_elastic_key", None)
    key = "ab" * 32
    monkeypatch.setenv("COMMLAYER_ELASTIC_DRIVER", "127.0.0.1:5")
    monkeypatch.setenv("COMMLAYER_ELASTIC_WORKER", "localhost:0:1")
    monkeypatch.setenv("COMMLAYER_ELASTIC_KEY", key)
    worker = config.elastic_worker()
    assert worker is not None and worker.key == bytes.fromhex(key)
    assert "COMMLAYER_ELASTIC_KEY" not in os.environ
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('COMMLAYER_ELASTIC_KEY'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout == "None\n"
    assert config.elastic_worker() == worker  # the next init(): the key kept in memory
    # an environment passed in is read, never changed
    given = {
        "COMMLAYER_ELASTIC_DRIVER": "h:1",
        "COMMLAYER_ELASTIC_WORKER": "w",
        "COMMLAYER_ELASTIC_KEY": "cd" * 16,
    }
    assert config.elastic_worker(given) == config.ElasticWorker("h:1", b"\xcd" * 16, "w")
    assert given["COMMLAYER_ELASTIC_KEY"] == "cd" * 16


def test_a_worker_without_its_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_elastic_key", None)
    monkeypatch.delenv("COMMLAYER_ELASTIC_KEY", raising=False)
    monkeypatch.setenv("COMMLAYER_ELASTIC_DRIVER", "127.0.0.1:5")
    monkeypatch.setenv("COMMLAYER_ELASTIC_WORKER", "localhost:0:1")
    with pytest.raises(ConfigError, match="COMMLAYER_ELASTIC_KEY"):
        config.elastic_worker()
