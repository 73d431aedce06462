"""MkDocs hooks (mkdocs.yml ``hooks:``): the pages that are generated from the code when the site
is built, so that they cannot drift from it.

- ``reference/configuration.md``: every COMMLAYER_* variable from ``config.describe()``
  (name, init() keyword, default, unit, what is allowed, meaning);
- ``reference/cli.md``: ``--help`` of ``commlayer`` and each of its commands, and of
  ``commlayerrun``, from their argparse parsers;
- ``examples.md``: each script of examples/ with its docstring and its source;
- ``benchmarks/results/*.png``: the plots the performance page shows, copied from the repository;
- ``css/pygments.css``: the colours of the code blocks, which Pygments marks up when the site is
  built (the theme's own highlight.js would come from a CDN).

And it checks each page as built: a list written without a blank line before it renders as one
paragraph ("...; - wraps any torch.optim ...; - gradients travel ..."), which fails the build.
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parent.parent
# A warning under "mkdocs." fails the strict build (scripts/docs.sh).
log = logging.getLogger("mkdocs.hooks.commlayer")
# Pygments' style for the code blocks: dark keywords and green strings on the theme's grey.
PYGMENTS_STYLE = "friendly"


def _cell(text: str) -> str:
    """Text that fits in one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def configuration_page() -> str:
    from commlayer.common import config
    from commlayer.core.registries import REGISTRIES

    lines = [
        "# Configuration",
        "",
        "<!-- generated when the site is built: scripts/docs_hooks.py, config.describe() -->",
        "",
        "Every `COMMLAYER_*` variable is read once, by `commlayer.init()`; a keyword argument of",
        "`init()` (the *keyword* column) wins over the variable, and nothing reads the environment",
        "again after `init()`. An unknown variable (with the closest known name when one is close)",
        "or a bad value is a `ConfigError` naming the variable, the value, what is allowed and its",
        "unit. `commlayerrun` checks them before it starts any rank and passes them to every rank.",
        "",
        "Sizes in bytes take `K`, `M`, `G` suffixes (`COMMLAYER_FUSION_THRESHOLD=64M`); times are",
        "plain numbers in the unit shown (`COMMLAYER_CYCLE_TIME=1` is one millisecond; `1ms` is",
        "refused).",
        "",
        "| variable | `init()` keyword | default | unit | allowed | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for var in config.describe(REGISTRIES):
        lines.append(
            f"| `{var.name}` | `{var.field}` | `{_cell(config.show_default(var))}` | "
            f"{var.unit or '-'} | {_cell(var.allowed)} | {_cell(var.help)} |"
        )
    lines.append("")
    return "\n".join(lines)


def _helps(parser: argparse.ArgumentParser, words: list[str]) -> list[tuple[str, str]]:
    """(command line, help text) of ``parser`` and of each of its sub-commands, depth first."""
    found = [(" ".join(words), parser.format_help())]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _helps(sub, [*words, name])
    return found


def cli_page() -> str:
    from commlayer import cli
    from commlayer.launch import launcher

    os.environ["COLUMNS"] = "100"  # argparse wraps to this width
    lines = [
        "# Command line",
        "",
        "<!-- generated at build time by scripts/docs_hooks.py from the argparse parsers -->",
        "",
        "Two commands come with the package: `commlayerrun` starts a job (see",
        "[Launching](../guides/launching.md)), `commlayer` runs the tools",
        "([calibrate](../tools/calibrate.md), [simulate](../tools/simulate.md),",
        "[oracle](../tools/oracle.md)). Below is each one's `--help`.",
        "",
    ]
    helps = _helps(launcher._parser(), ["commlayerrun"]) + _helps(cli.parser(), ["commlayer"])
    for command, text in helps:
        lines += [f"## `{command}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


def examples_page() -> str:
    lines = [
        "# Examples",
        "",
        "<!-- generated at build time by scripts/docs_hooks.py from examples/*.py -->",
        "",
        "Each script in `examples/` runs as it is, on synthetic or bundled data (no download),",
        "and the test suite runs each at 2 ranks (`tests/system/test_examples.py`). Start one with",
        "`commlayerrun -np 2 python examples/NAME.py` (or `torchrun --nproc_per_node 2 ...`).",
        "",
    ]
    for path in sorted((REPO / "examples").glob("*.py")):
        source = path.read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        lines += [f"## `{path.name}`", "", doc, "", "```python", source.rstrip(), "```", ""]
    # an example of several files in a folder of its own (examples/elastic/): its train.py's
    # docstring says how to run it, then every file
    for folder in sorted(p for p in (REPO / "examples").iterdir() if (p / "train.py").is_file()):
        doc = ast.get_docstring(ast.parse((folder / "train.py").read_text())) or ""
        lines += [f"## `{folder.name}/`", "", doc, ""]
        for path in sorted(f for f in folder.iterdir() if f.suffix in (".py", ".sh")):
            language = "python" if path.suffix == ".py" else "sh"
            lines += [f"`{folder.name}/{path.name}`:", "", f"```{language}"]
            lines += [path.read_text().rstrip(), "```", ""]
    return "\n".join(lines)


GENERATED = {
    "reference/configuration.md": configuration_page,
    "reference/cli.md": cli_page,
    "examples.md": examples_page,
}


def pygments_css() -> str:
    from pygments.formatters import HtmlFormatter

    return str(HtmlFormatter(style=PYGMENTS_STYLE).get_style_defs(".highlight"))


_PARAGRAPH = re.compile(r"<p>(.*?)</p>", re.S)
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")


def inline_lists(html: str) -> list[str]:
    """The start of each paragraph of ``html`` that holds a line beginning like a list item
    ("- ", "* ", "1. "): Markdown took the list for the paragraph's text, because no blank line
    came before it, and the page shows it run together."""
    found = []
    for paragraph in _PARAGRAPH.findall(html):
        lines = paragraph.split("\n")
        if any(_LIST_ITEM.match(line) for line in lines[1:]):
            found.append(" ".join(paragraph.split())[:80])
    return found


def on_page_content(html: str, page: Page, **_: Any) -> str:
    for start in inline_lists(html):
        log.warning(
            "%s: a list renders inside a paragraph (put a blank line before it): %r",
            page.file.src_uri,
            start,
        )
    return html


def on_files(files: Files, config: Any) -> Files:
    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    files.append(File.generated(config, "css/pygments.css", content=pygments_css()))
    for png in sorted((REPO / "benchmarks" / "results").glob("*.png")):
        uri = f"benchmarks/results/{png.name}"
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files
