"""The import paths scripts used before the layers became folders (README's
``commlayer.config.describe``, ``from commlayer.errors import ...``), and the core/ paths of the
modules that moved down to common/ (``commlayer.core.errors``), give the same module objects as
the new ones, by every spelling of an import."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import commlayer
from commlayer import common, core

# the old path commlayer.<name> -> where the module is now
OLD = {
    "config": "commlayer.common.config",
    "errors": "commlayer.common.errors",
    "reduce_ops": "commlayer.common.reduce_ops",
    "future": "commlayer.core.future",
    "process_sets": "commlayer.core.process_sets",
    "runtime": "commlayer.core.runtime",
}
MOVED_DOWN = ("config", "errors", "reduce_ops", "topology")  # from core/ to common/


@pytest.mark.parametrize("name", sorted(OLD))
def test_an_old_path_is_the_new_module(name: str) -> None:
    new = importlib.import_module(OLD[name])
    assert importlib.import_module(f"commlayer.{name}") is new
    assert getattr(commlayer, name) is new


@pytest.mark.parametrize("name", MOVED_DOWN)
def test_a_core_path_of_a_module_moved_to_common_is_the_module(name: str) -> None:
    new = importlib.import_module(f"commlayer.common.{name}")
    assert importlib.import_module(f"commlayer.core.{name}") is new
    assert getattr(core, name) is new is getattr(common, name)


def test_old_paths_work_in_a_fresh_interpreter() -> None:
    code = (
        "import commlayer.config, commlayer.errors\n"
        "from commlayer.config import describe\n"
        "from commlayer.errors import TensorMismatchError\n"
        "from commlayer.reduce_ops import ReduceOp\n"
        "from commlayer.process_sets import ProcessSet\n"
        "from commlayer.core import config, errors\n"
        "import commlayer.core.topology\n"
        "from commlayer.common import config as moved, topology\n"
        "assert commlayer.config is config is moved and describe is config.describe\n"
        "assert TensorMismatchError is errors.TensorMismatchError\n"
        "assert commlayer.core.topology is topology\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_launchers_old_path_is_its_module() -> None:
    """commlayer.launcher (commlayerrun's module before commlayer/launch/) is that module, and
    ``python -m commlayer.launcher`` still runs commlayerrun."""
    code = (
        "import commlayer.launcher\n"
        "from commlayer import launcher\n"
        "from commlayer.launch import launcher as moved\n"
        "assert commlayer.launcher is launcher is moved and launcher._parser\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    run = subprocess.run(
        [sys.executable, "-m", "commlayer.launcher", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and "commlayerrun" in run.stdout, run.stderr
