"""``commlayer --help`` shows its whole description, not its first line cut mid-sentence."""

from __future__ import annotations

import pytest

from commlayer import cli


def test_help_shows_the_whole_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ask the oracle which parallelism strategy to use." in text, text
    assert "commlayer COMMAND --help describes each." in text, text
    assert "``" not in text  # reStructuredText quotes are for the docstring, not the terminal
