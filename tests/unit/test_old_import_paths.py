"""The import paths scripts used before the layers became folders (README's
``commlayer.config.describe``, ``from commlayer.errors import ...``) give the same module
objects as the new ones, by every spelling of an import."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import commlayer
from commlayer import core

OLD = ("config", "errors", "future", "process_sets", "reduce_ops", "runtime")


@pytest.mark.parametrize("name", OLD)
def test_an_old_path_is_the_new_module(name: str) -> None:
    new = importlib.import_module(f"commlayer.core.{name}")
    assert importlib.import_module(f"commlayer.{name}") is new
    assert getattr(commlayer, name) is new is getattr(core, name)


def test_old_paths_work_in_a_fresh_interpreter() -> None:
    code = (
        "import commlayer.config, commlayer.errors\n"
        "from commlayer.config import describe\n"
        "from commlayer.errors import TensorMismatchError\n"
        "from commlayer.reduce_ops import ReduceOp\n"
        "from commlayer.process_sets import ProcessSet\n"
        "from commlayer.core import config, errors\n"
        "assert commlayer.config is config and describe is config.describe\n"
        "assert TensorMismatchError is errors.TensorMismatchError\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
