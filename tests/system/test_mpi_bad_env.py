"""Bad COMMLAYER_* environment variables: ConfigError (a ValueError) naming the variable, the
value and what is allowed, from config.load() and from commlayer.init() on every rank (under
mpiexec and under torchrun)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from commlayer import ConfigError
from commlayer.common import config

if TYPE_CHECKING:
    from conftest import RunMPI

# variable -> (bad value, words of what is allowed)
BAD = {
    "COMMLAYER_FUSION_THRESHOLD": ("abc", "number of bytes, optionally with K/M/G suffix"),
    "COMMLAYER_CYCLE_TIME": ("-1", "a finite number > 0"),
    "COMMLAYER_LOG_LEVEL": ("loud", "one of trace, debug, info, warning, error"),
}
UNKNOWN = ("COMMLAYER_BOGUS", "1")


def _check_message(message: str, variable: str, value: str, allowed: str) -> None:
    assert variable in message, message
    assert repr(value) in message, message
    assert allowed in message, message


@pytest.mark.parametrize("variable", list(BAD))
def test_config_load_rejects_bad_value(variable: str) -> None:
    value, allowed = BAD[variable]
    with pytest.raises(ConfigError) as caught:
        config.load(environ={variable: value})
    assert isinstance(caught.value, ValueError)
    _check_message(str(caught.value), variable, value, allowed)


def test_config_load_rejects_unknown_variable() -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(environ=dict([UNKNOWN]))
    message = str(caught.value)
    assert repr(UNKNOWN[0]) in message, message
    for known, _ in config.variables():  # what is allowed
        assert known in message, message


@pytest.mark.parametrize("torchrun", [False, True], ids=["mpiexec", "torchrun"])
def test_init_raises_config_error_on_every_rank(run_mpi: RunMPI, torchrun: bool) -> None:
    env = {variable: value for variable, (value, _) in BAD.items()}
    env[UNKNOWN[0]] = UNKNOWN[1]
    job = run_mpi("bad_env.py", 2, json.dumps(env), torchrun=torchrun)
    assert job.returncode == 0, job.output()
    for rank in range(2):
        records = job.find("init", rank)
        assert [r["variable"] for r in records] == list(env), job.output()
        for record in records:
            assert record["error"] == "ConfigError", job.output()
            assert "ValueError" in record["classes"]
            variable = record["variable"]
            if variable in BAD:
                value, allowed = BAD[variable]
                _check_message(record["message"], variable, value, allowed)
            else:
                assert repr(variable) in record["message"], record["message"]
        assert job.one("init_clean", rank)["error"] is None, job.output()
        assert job.one("allreduce", rank)["result"] == [2.0, 2.0], job.output()
