"""The documentation's generated pages (scripts/docs_hooks.py): the configuration reference
lists every variable with its default and unit from commlayer.core.config, the CLI page every
command's --help, the examples page every example. (scripts/docs.sh builds the whole site with
warnings as errors; scripts/test.sh runs it.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from commlayer.core import config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install .[docs])")
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_hooks"] = module
    spec.loader.exec_module(module)
    return module


def _row(page: str, name: str) -> list[str]:
    rows = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, (name, rows)
    return [cell.strip() for cell in rows[0].strip("|").split(" | ")]


def test_configuration_page_has_every_variable_with_default_and_unit(hooks: ModuleType) -> None:
    page = hooks.configuration_page()
    described = config.describe()
    assert [v.name for v in described] == [name for name, _ in config.variables()]
    for variable in described:
        name, keyword, default, unit, allowed, _ = _row(page, variable.name)
        assert keyword == f"`{variable.field}`"
        assert default == f"`{config.show_default(variable)}`"
        assert unit == (variable.unit or "-")
        assert allowed
    # spot checks against Config's own defaults, as a user reads them
    assert _row(page, "COMMLAYER_FUSION_THRESHOLD")[2:4] == ["`64 MiB`", "bytes"]
    assert _row(page, "COMMLAYER_CYCLE_TIME")[2:4] == ["`1`", "milliseconds"]
    assert _row(page, "COMMLAYER_STALL_CHECK_TIME_SECONDS")[2:4] == ["`60`", "seconds"]
    assert _row(page, "COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS")[2:4] == ["`600`", "seconds"]
    assert _row(page, "COMMLAYER_TIMELINE")[2:4] == ["`none`", "-"]


def test_cli_page_has_every_command(hooks: ModuleType) -> None:
    page = hooks.cli_page()
    for command in ("commlayerrun", "commlayer", "commlayer calibrate", "commlayer algorithms",
                    "commlayer simulate", "commlayer oracle"):  # fmt: skip
        assert f"## `{command}`" in page, command
    assert "--check-build" in page and "--sim-table" in page


def test_examples_page_has_every_example(hooks: ModuleType) -> None:
    page = hooks.examples_page()
    for path in sorted((REPO / "examples").glob("*.py")):
        assert f"## `{path.name}`" in page
        assert path.read_text().rstrip() in page


def test_readme_code_is_the_runnable_example() -> None:
    """README's one-line-change code is examples/minimal.py's, which the system tests run."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## The one-line change\n\n```python\n") + len(
        "## The one-line change\n\n```python\n"
    )
    snippet = readme[start : readme.index("```", start)]
    assert "hvd.DistributedOptimizer(" in snippet
    assert snippet in (REPO / "examples" / "minimal.py").read_text()


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh\n" in ci
    assert "```bash\nbash scripts/test.sh\n```" in readme
