"""Every ``run`` block of README.md and docs/ runs as a reader would run it, and prints what the
``output`` block after it shows (the markers: scripts/docs_blocks.py).

- A python block is a program of its own, saved as a file and started as the marker says:
  ``mpiexec -n N python FILE`` or ``torchrun --standalone --nproc_per_node N FILE``.
- A bash block's commands run one by one through bash, as typed, in a directory that holds the
  repository's folders a command may name (examples/, data/, ...) and ``train.py``, the script
  README's one-line change shows (examples/minimal.py). A command several pages show runs once.

Each must exit 0; its standard output must match the output block (``...``: any text). The
blocks of the other kinds are checked without running them (tests/unit/test_docs.py), or by the
test that runs the command they name (test_examples.py, test_launcher_demo.py).

The jobs are a few ranks importing torch, 6-15 s each on the loaded 2-core machine, 3 ranks
longer; ``commlayer oracle`` and ``commlayer algorithms`` import their models (5-15 s).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0


def _docs_blocks() -> ModuleType:
    """scripts/docs_blocks.py, at collection (the parameters); conftest's ``docs_blocks`` is
    the same for the tests that reach it through ``harness``."""
    spec = importlib.util.spec_from_file_location("docs_blocks", REPO / "scripts/docs_blocks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_blocks"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BLOCKS = _docs_blocks()
RUNS = [b for b in BLOCKS.all_blocks() if b.kind == "run"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reader's directory: the repository's folders the commands name, and train.py."""
    where = tmp_path_factory.mktemp("reader")
    for name in BLOCKS.RUN_FOLDERS:
        (where / name).symlink_to(REPO / name)
    shutil.copy(REPO / "examples" / "minimal.py", where / "train.py")
    return where


_ran: dict[str, subprocess.CompletedProcess[str]] = {}


def _run(harness: ModuleType, command: str, where: Path) -> subprocess.CompletedProcess[str]:
    """``command`` as typed in ``where``, once a session (README and a guide may show it, with
    another comment)."""
    key = " ".join(BLOCKS.words(command))
    if key not in _ran:
        _ran[key] = harness.run_as_typed(command, where, TIMEOUT_S)
    done = _ran[key]
    assert done.returncode == 0, (
        f"$ {command}\nexit code {done.returncode}\n--- stdout ---\n{done.stdout}\n"
        f"--- stderr ---\n{done.stderr}"
    )
    return done


def _output_after(block: Any) -> Any:
    """The ``output`` block right after ``block`` on its page, or None."""
    found = BLOCKS.blocks(REPO / block.path)
    following = [b for b in found if b.line > block.line]
    return following[0] if following and following[0].kind == "output" else None


@pytest.mark.parametrize("block", RUNS, ids=[b.where() for b in RUNS])
def test_a_run_block_runs_and_prints_what_the_page_shows(
    harness: ModuleType, workdir: Path, block: Any
) -> None:
    if block.language == "python":
        script = workdir / f"{Path(block.path).stem}_{block.line}.py"
        script.write_text(block.text)
        ranks, torchrun = block.launch()
        command = (
            f"torchrun --standalone --nproc_per_node {ranks} {script.name}"
            if torchrun
            else f"mpiexec -n {ranks} python {script.name}"
        )
        printed = _run(harness, command, workdir).stdout
    else:
        printed = "".join(_run(harness, c, workdir).stdout for c in BLOCKS.commands(block.text))
    shown = _output_after(block)
    if shown is not None:
        problem = BLOCKS.output_mismatch(shown.text, printed)
        assert problem is None, f"{shown.where()}: {problem}"


def test_every_page_with_runs_is_covered() -> None:
    """The reference pages' examples are among the blocks run here."""
    pages = {b.path for b in RUNS}
    for page in ("optimizer", "ddp-hook", "collectives", "commlayerrun"):
        assert f"docs/reference/{page}.md" in pages, page
    assert "README.md" in pages
