"""The documentation's generated pages (scripts/docs_hooks.py): the configuration reference
lists every variable with its default and unit from commlayer.common.config, the CLI page every
command's --help, the examples page every example. The build's own checks: the code's colours,
a list that would render inline fails it. Every code block of README.md and docs/ says what it
is (scripts/docs_blocks.py), and what can be checked without running it is: a fragment's lines
are its file's, a documented command is an example's, a command that is not run parses. The
reference pages share one shape. (scripts/docs.sh builds the whole site with warnings as
errors; scripts/test.sh runs it; tests/system/test_docs_blocks.py runs the blocks.)"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import commlayer
from commlayer import cli
from commlayer.common import config
from commlayer.integrations import ddp
from commlayer.launch import launcher

REPO = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


blocks = _load("docs_blocks")


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install .[docs])")
    return _load("docs_hooks")


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
    """README's one-line-change code is examples/minimal.py's first part, whole: the system
    tests run it."""
    readme = (REPO / "README.md").read_text()
    head = "## The one-line change\n\n<!-- fragment of: examples/minimal.py -->\n\n```python\n"
    start = readme.index(head) + len(head)
    snippet = readme[start : readme.index("```", start)]
    assert "hvd.DistributedOptimizer(" in snippet
    assert snippet in (REPO / "examples" / "minimal.py").read_text()


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh\n" in ci
    assert "```bash\nbash scripts/test.sh\n```" in readme


# -- the build's checks -------------------------------------------------------------------------
def test_a_list_without_a_blank_line_before_it_is_found(hooks: ModuleType) -> None:
    """Python-Markdown takes such a list for the paragraph's text: the DistributedOptimizer
    page showed "...; - wraps any torch.optim ...; - gradients travel ..." in one paragraph."""
    import markdown

    def html(text: str) -> str:
        return str(markdown.markdown(text, extensions=["tables", "pymdownx.superfences"]))

    inline = "The wrapper:\n- wraps any optimizer;\n- sends buckets.\n"
    assert hooks.inline_lists(html(inline)) == [
        "The wrapper: - wraps any optimizer; - sends buckets."
    ]
    numbered = "Steps:\n1. init\n2. wrap\n"
    assert len(hooks.inline_lists(html(numbered))) == 1
    assert (
        hooks.inline_lists(html("The wrapper:\n\n- wraps any optimizer;\n- sends buckets.\n")) == []
    )
    # a dash inside a sentence is no list
    assert hooks.inline_lists(html("a - b and\nc - d\n")) == []


def test_code_is_coloured_without_a_cdn(hooks: ModuleType) -> None:
    css = hooks.pygments_css()
    assert ".highlight .k " in css and "color" in css  # keywords have a colour
    site = (REPO / "mkdocs.yml").read_text()
    assert "highlightjs: false" in site and "pymdownx.highlight" in site
    assert "css/pygments.css" in site


# -- every code block of README.md and docs/ -------------------------------------------------------
ALL = blocks.all_blocks()
# A documented command of these files is run verbatim by the test named.
RUN_ELSEWHERE = {
    **{
        f"examples/{p.name}": "tests/system/test_examples.py"
        for p in (REPO / "examples").glob("*.py")
    },
    "examples/elastic/train.py": "tests/system/test_elastic_example.py",
    "integrations/accelerate/train.py": "tests/system/test_integrations_accelerate.py",
}


def _ids(found: list[Any]) -> list[str]:
    return [b.where() for b in found]


def test_every_block_says_what_it_is() -> None:
    assert len(ALL) > 40  # README's and the pages' (the generated pages come from the code)
    unmarked = [b.where() for b in ALL if not b.kind]
    assert unmarked == [], f"blocks without a marker (scripts/docs_blocks.py): {unmarked}"
    for block in ALL:
        if block.kind == "not run":
            assert len(block.argument.split()) >= 3, f"{block.where()}: say why it is not run"
        if block.kind == "run" and block.language == "python":
            block.launch()  # says how many ranks, or raises
        assert block.kind != "run" or block.language in ("python", "bash"), block.where()


def test_every_output_follows_a_block_that_prints_it() -> None:
    by_path: dict[str, list[Any]] = {}
    for block in ALL:
        by_path.setdefault(block.path, []).append(block)
    for found in by_path.values():
        for before, block in zip([None, *found], found):
            if block.kind == "output":
                assert before is not None and before.kind == "run", block.where()


FRAGMENTS = [b for b in ALL if b.kind == "fragment of"]


@pytest.mark.parametrize("block", FRAGMENTS, ids=_ids(FRAGMENTS))
def test_a_fragment_is_its_files_lines_in_order(block: Any) -> None:
    path = REPO / block.argument
    assert path.is_file(), f"{block.where()}: no file {block.argument}"
    assert block.argument.split("/")[0] in ("examples", "integrations", "commlayer"), block.where()
    missing = blocks.missing_line(block.text, path.read_text())
    assert missing is None, f"{block.where()}: not a line of {block.argument}: {missing!r}"


COMMANDS = [b for b in ALL if b.kind in ("commands of", "output of")]


@pytest.mark.parametrize("block", COMMANDS, ids=_ids(COMMANDS))
def test_a_documented_command_is_one_a_test_runs(
    harness_commands: Callable[[Path], list[str]], block: Any
) -> None:
    """``commands of: FILE``: each is one of FILE's docstring commands, which the test named in
    RUN_ELSEWHERE runs verbatim; ``output of: COMMAND``: COMMAND is an example's."""
    if block.kind == "commands of":
        assert block.argument in RUN_ELSEWHERE, (
            f"{block.where()}: no test runs {block.argument}'s commands"
        )
        # as the shell reads them: the words, without a comment
        documented = [blocks.words(c) for c in harness_commands(REPO / block.argument)]
        for command in blocks.commands(block.text):
            assert blocks.words(command) in documented, (
                f"{block.where()}: {command!r} is not in {block.argument}'s docstring"
            )
    else:
        examples = [
            c for p in sorted((REPO / "examples").glob("*.py")) for c in harness_commands(p)
        ]
        assert block.argument in examples, f"{block.where()}: {block.argument!r} is no example's"


@pytest.fixture(scope="module")
def harness_commands() -> Callable[[Path], list[str]]:
    """tests/system/conftest.py's reader of an example's docstring commands."""
    spec = importlib.util.spec_from_file_location(
        "system_conftest", REPO / "tests" / "system" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["system_conftest"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.docstring_commands  # type: ignore[no-any-return]


def _parses(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    try:
        parser.parse_args(words)
    except SystemExit:
        return parser.format_usage()
    return None


NOT_RUN = [b for b in ALL if b.kind == "not run" and b.language == "bash"]


@pytest.mark.parametrize("block", NOT_RUN, ids=_ids(NOT_RUN))
def test_a_command_that_is_not_run_still_parses(block: Any) -> None:
    """commlayerrun and commlayer lines go through their own parsers (a synopsis, with [...]
    or ..., is left out); a repository file a line names exists."""
    for command in blocks.commands(block.text):
        words = blocks.words(command)
        # the command itself: up to a redirection or the next command
        cut = [i for i, w in enumerate(words) if w in (">", ">>", "|", "&&", ";", "&")]
        words = words[: cut[0]] if cut else words
        for before, word in zip(["", *words], words):
            written = before in ("--out", "--plot")  # what the command makes
            if not written and re.fullmatch(r"(examples|scripts|benchmarks|data)/[\w./-]+", word):
                assert (REPO / word).exists(), f"{block.where()}: {word} does not exist"
        if "[" in command or "..." in command:
            continue
        for program, parser in (("commlayerrun", launcher._parser()), ("commlayer", cli.parser())):
            if program in words:
                problem = _parses(parser, words[words.index(program) + 1 :])
                assert problem is None, f"{block.where()}: {command!r} does not parse: {problem}"


def test_output_matching_reads_dots_as_any_text() -> None:
    assert blocks.output_mismatch("loss ... -> 0.1\ndone", "loss 2.3 -> 0.1\ndone\n") is None
    assert blocks.output_mismatch("a\n...\nz", "a\nb\nc\nz") is None
    assert blocks.output_mismatch("a\n...\nz", "a\nz") is None
    assert blocks.output_mismatch("loss ... -> 0.1", "loss 2.3 -> 0.2") is not None
    assert blocks.output_mismatch("a\nb", "a\nb\nc") is not None


def test_a_fragment_may_elide_but_not_change_a_line() -> None:
    source = "def f(x):\n    y = x + 1\n    z = y * 2\n    return z\n"
    assert blocks.missing_line("def f(x):\n    ...\n    return z\n", source) is None
    assert blocks.missing_line("    return z\ndef f(x):\n", source) == "def f(x):"  # order
    assert blocks.missing_line("    y = x + 2\n", source) == "    y = x + 2"


# -- the reference pages ---------------------------------------------------------------------------
# One shape for every API reference page, as Horovod's and PyTorch's: what it is, then these
# sections in this order. A new reference page follows it and joins REFERENCE.
SECTIONS = ["## Signature", "## Parameters", "## Returns", "## Raises", "## Example", "## Notes"]
REFERENCE: dict[str, list[Callable[..., Any]]] = {
    "docs/reference/optimizer.md": [commlayer.DistributedOptimizer],
    "docs/reference/ddp-hook.md": [ddp.CommState.__init__],
    "docs/reference/collectives.md": [
        commlayer.allreduce,
        commlayer.allgather,
        commlayer.broadcast,
        commlayer.alltoall,
        commlayer.reducescatter,
    ],
    "docs/reference/commlayerrun.md": [],
    "docs/reference/elastic.md": [
        commlayer.elastic.run,
        commlayer.elastic.TorchState.__init__,
        commlayer.elastic.ElasticSampler.__init__,
    ],
}


@pytest.mark.parametrize("page", list(REFERENCE))
def test_a_reference_page_has_every_section_in_order(page: str) -> None:
    text = (REPO / page).read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == SECTIONS, f"{page}: {headings}"
    example = text[text.index("## Example") : text.index("## Notes")]
    found = [b for b in blocks.blocks(REPO / page) if f"{b.line}" and b.text in example]
    assert any(b.kind in ("run", "commands of") for b in found), f"{page}: no runnable example"


def _table(text: str, section: str) -> dict[str, list[str]]:
    """The first column's code names -> the row's cells, of the table under ``section``."""
    part = text[text.index(section) :]
    part = part[: part.index("\n## ", 1)] if "\n## " in part[1:] else part
    rows: dict[str, list[str]] = {}
    for line in part.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells
    return rows


def _shown(default: Any) -> str:
    """A default as the pages write it."""
    if default is commlayer.global_process_set:
        return "`global_process_set`"
    if isinstance(default, commlayer.ReduceOp):
        return f"`{default.name}`"
    if type(default).__name__ == "NoneCompressor":
        return "`Compression.none`"
    if isinstance(default, str):
        return f'`"{default}"`'
    return f"`{default!r}`"


@pytest.mark.parametrize("page", [p for p, calls in REFERENCE.items() if calls])
def test_a_reference_page_has_every_parameter_with_its_default(page: str) -> None:
    rows = _table((REPO / page).read_text(), "## Parameters")
    for call in REFERENCE[page]:
        for name, parameter in inspect.signature(call).parameters.items():
            if name == "self":
                continue
            assert name in rows, f"{page}: parameter {name!r} of {call.__qualname__} is missing"
            default = rows[name][2]
            variadic = parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
            want = (
                "none"
                if variadic
                else "required"
                if parameter.default is inspect.Parameter.empty
                else _shown(parameter.default)
            )
            assert default == want, f"{page}: {name}: {default} (the code: {want})"


def test_the_launcher_page_has_every_option() -> None:
    rows = _table((REPO / "docs/reference/commlayerrun.md").read_text(), "## Parameters")
    for action in launcher._parser()._actions:
        if action.dest == "help":
            continue
        names = action.option_strings or [action.dest]
        assert any(n in rows for n in names), f"commlayerrun {names} is not on its page"
