"""``commlayer --help`` shows its whole description, not its first line cut mid-sentence; every
command and sub-command has one; a command that needs an optional package checks for it before
it works."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from commlayer import cli, oracle
from commlayer.launch import launcher


def test_help_shows_the_whole_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ask the oracle which parallelism strategy to use." in text, text
    assert "commlayer COMMAND --help describes each." in text, text
    assert "``" not in text  # reStructuredText quotes are for the docstring, not the terminal


def _parsers(
    parser: argparse.ArgumentParser, words: list[str]
) -> list[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of ``parser`` and each of its sub-commands, depth first."""
    found = [(" ".join(words), parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, [*words, name])
    return found


def test_every_command_and_subcommand_has_a_description() -> None:
    """``commlayer calibrate --help`` said only its options: each command says what it does
    and when to run it, above its options, as --help shows it."""
    commands = _parsers(cli.parser(), ["commlayer"]) + _parsers(
        launcher._parser(), ["commlayerrun"]
    )
    assert {c for c, _ in commands} >= {"commlayer calibrate", "commlayer oracle", "commlayerrun"}
    for command, parser in commands:
        assert parser.description and len(parser.description.split()) >= 8, command
        assert parser.description.split()[0] in parser.format_help(), command


def test_oracle_plot_without_matplotlib_fails_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot drew last, so a missing matplotlib was found after every table (260 s on a loaded
    machine); now before the inputs are even read."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the oracle predicted before checking for matplotlib")

    monkeypatch.setattr(oracle, "predict", no_work)
    code = cli.main(["oracle", "--net", "no.net", "--plat", "no.plat", "--plot", "out.png"])
    assert code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
