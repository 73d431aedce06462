"""Every on/off setting is read by one parser (config.parse_bool): 1/0, true/false, on/off,
yes/no in any case, a bool in Config; an auto one (config.parse_auto_bool) is None for auto.
A bad value is a ConfigError naming the variable (or the keyword) and the value."""

from __future__ import annotations

import dataclasses

import pytest

from commlayer.common import config
from commlayer.common.errors import ConfigError

BOOLEANS = ("COMMLAYER_MALLOC_TUNING", "COMMLAYER_LINE_OUTPUT", "COMMLAYER_AUTO_TUNING",
            "COMMLAYER_FORCE_FULL_PATH", "COMMLAYER_PLANNED_SKIP_NEGOTIATION",
            "COMMLAYER_WINDOW_BUCKETS")  # fmt: skip
AUTO_BOOLEANS = ("COMMLAYER_CUDA_AWARE_MPI", "COMMLAYER_NCCL")
FIELDS = {name: field for name, field in (v[:2] for v in config._VARIABLES)}


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "On", " yes ", "Yes"])
def test_true_words(text: str) -> None:
    assert config.parse_bool(text) is True
    assert config.parse_auto_bool(text) is True


@pytest.mark.parametrize("text", ["0", "false", "False", "OFF", "no", " NO"])
def test_false_words(text: str) -> None:
    assert config.parse_bool(text) is False
    assert config.parse_auto_bool(text) is False


def test_auto_is_none_and_only_for_auto_booleans() -> None:
    assert config.parse_auto_bool(" AUTO ") is None
    with pytest.raises(ValueError):
        config.parse_bool("auto")


@pytest.mark.parametrize("name", BOOLEANS + AUTO_BOOLEANS)
def test_each_boolean_setting_takes_both_vocabularies(name: str) -> None:
    field = FIELDS[name]
    default = getattr(config.Config(), field)
    assert default is None or isinstance(default, bool)
    for text, value in (("on", True), ("0", False), ("Yes", True), ("false", False)):
        assert getattr(config.load(environ={name: text}), field) is value
        assert config.parse_variable(name, text) is value
        # as keywords (init(), override()): a bool, an int 0/1 or a word
        given: object
        for given in (value, int(value), text):
            assert getattr(config.load(environ={}, **{field: given}), field) is value


@pytest.mark.parametrize("name", BOOLEANS + AUTO_BOOLEANS)
def test_a_bad_value_names_the_variable_and_the_value(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}='maybe' is not valid: expected .*a boolean"):
        config.load(environ={name: "maybe"})
    field = FIELDS[name]
    with pytest.raises(ConfigError, match=rf"setting {field}='maybe' \(or {name}\) is not valid"):
        config.load(environ={}, **{field: "maybe"})


def test_a_bool_is_refused_where_the_setting_is_not_a_boolean() -> None:
    with pytest.raises(ConfigError, match="setting cache_capacity=True"):
        config.load(environ={}, cache_capacity=True)


def test_the_types_are_declared_bool() -> None:
    types = {f.name: f.type for f in dataclasses.fields(config.Config)}
    for name in BOOLEANS:
        assert types[FIELDS[name]] == "bool"
    for name in AUTO_BOOLEANS:
        assert types[FIELDS[name]] == "bool | None"


def test_the_reference_shows_boolean_defaults_as_words() -> None:
    shown = {v.name: config.show_default(v) for v in config.describe()}
    assert shown["COMMLAYER_MALLOC_TUNING"] == "on" and shown["COMMLAYER_LINE_OUTPUT"] == "off"
    assert shown["COMMLAYER_NCCL"] == "auto"
