"""Every path the documentation and commlayer's docstrings and comments name exists (issue 49):
a file moved or renamed without its mentions leaves readers looking for what is not there
(``compression/communicator.py`` was named in four docstrings a restructuring after it moved).

Checked: names with a folder whose first part is a folder of this repository or a package of
commlayer (``core/engine.py``, ``commlayer/core/wire.py``, ``benchmarks/train.py``), relative
to the repository, to commlayer/, to the naming file's folder, or to docs/; and the bare
``name.py`` of a module in commlayer's docstrings. Not checked: files a command writes
(``out.png``), the generated documentation pages, and other projects' files, listed below.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "commlayer"
_EXT = r"(?:py|md|sh|json|jsonl|yml|yaml|toml|xml|cu|png)"
_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\." + _EXT + r")(?![\w/])")
_MODULE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*\.py)\b")
# Written or generated, not in the tree: the docs hooks' pages, and other projects' files.
NOT_HERE = {
    "reference/configuration.md",
    "reference/cli.md",
    "examples.md",
    "test/integration/elastic_common.py",  # Horovod's
    "test/integration/data/elastic_torch_main.py",  # Horovod's
    "elastic_torch_main.py",  # Horovod's
    "test_torch.py",  # Horovod's test/parallel/test_torch.py
    "parallel_analysis.py",  # ParaDL's
    "setup.py",
}


def _top_folders() -> set[str]:
    tops = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return tops | {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}


def _comments_and_docstrings(path: Path) -> str:
    source = path.read_text()
    found = re.findall(r"#[^\n]*", source)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append(docstring)
    return "\n".join(found)


def _exists(name: str, where: Path) -> bool:
    for base in (REPO, PACKAGE, where.parent, REPO / "docs"):
        if (base / name).exists():
            return True
    return False


def _missing() -> list[str]:
    tops = _top_folders()
    modules = {p.name for p in REPO.rglob("*.py") if ".venv" not in str(p)}
    sources = [(p, p.read_text()) for p in [REPO / "README.md", *REPO.glob("docs/**/*.md")]]
    sources += [(p, _comments_and_docstrings(p)) for p in sorted(PACKAGE.rglob("*.py"))]
    missing = []
    for path, text in sources:
        where = path.relative_to(REPO)
        for name in set(_PATH.findall(text)):
            if name.startswith("./"):
                continue  # a user's own file, in the folder a command runs in
            if name.startswith("../"):  # a link between pages of the site
                name = str(((REPO / where).parent / name).resolve().relative_to(REPO / "docs"))
            if name in NOT_HERE or name.split("/")[0] not in tops:
                continue
            if not _exists(name, path):
                missing.append(f"{where}: {name}")
        if path.suffix == ".py":
            for name in set(_MODULE.findall(text)) - modules - NOT_HERE:
                missing.append(f"{where}: {name}")
    return sorted(missing)


def test_every_path_named_exists() -> None:
    missing = _missing()
    assert not missing, "paths named but not in the tree:\n" + "\n".join(missing)


def test_the_check_finds_a_stale_path(tmp_path: Path, monkeypatch: object) -> None:
    """The checker itself: a moved module's old path is reported."""
    assert _PATH.findall("see compression/communicator.py and core/engine.py.") == [
        "compression/communicator.py",
        "core/engine.py",
    ]
    assert not _exists("compression/communicator.py", PACKAGE / "optimizer.py")
    assert _exists("core/engine.py", PACKAGE / "optimizer.py")
