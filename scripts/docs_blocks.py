"""The code blocks of README.md and docs/: each says what it is, in an HTML comment on the line
before it (a blank line between), which the tests act on; Markdown renders the comment as
nothing.

    <!-- run: 3 ranks -->                 python: a whole program, run under mpiexec -n 3
    <!-- run: 2 ranks under torchrun -->  ... under torchrun --standalone --nproc_per_node 2
    <!-- run -->                          bash: each command run as typed, in a directory with
                                          examples/ and the others of RUN_FOLDERS in it
    <!-- output -->                       text: what the block before it prints on stdout
    <!-- output of: COMMAND -->           text: what COMMAND, an example's documented command,
                                          prints (the test that runs it compares)
    <!-- fragment of: PATH -->            its lines are lines of PATH, in order ("..." and
                                          "# ..." lines elide), a file a test runs or the code
    <!-- commands of: PATH -->            bash: each command is one of PATH's docstring
                                          commands, which a test runs verbatim
    <!-- not run: WHY -->                 said why (several hosts, root, a download, hours);
                                          its commlayer and commlayerrun lines still parse

tests/unit/test_docs.py checks every block has one and what can be checked without running;
tests/system/test_docs_blocks.py runs the ``run`` blocks and compares their ``output`` blocks.
In an output block, ``...`` stands for any text within a line (a time, a path, a digit that
differs between machines), and a line that is only ``...`` for any lines.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What a ``run`` bash block finds in its directory, as in a clone of the repository.
RUN_FOLDERS = ("examples", "data", "benchmarks", "scripts", "integrations")

KINDS = ("run", "output", "output of", "fragment of", "commands of", "not run")
_MARKER = re.compile(
    r"^<!-- (run|output of|output|fragment of|commands of|not run)(?:: (.+?))? -->$"
)
_FENCE = re.compile(r"^\s*(`{3,})(\w*)\s*$")
_RANKS = re.compile(r"^(\d+) ranks?( under torchrun)?$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where, its language and text, and what its marker says."""

    path: str  # relative to the repository
    line: int  # of the opening fence, from 1
    language: str
    text: str
    kind: str  # one of KINDS; "" where the block has no marker
    argument: str  # after the marker's colon

    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def launch(self) -> tuple[int, bool]:
        """(ranks, under torchrun) of a ``run`` python block; ValueError if it says neither."""
        found = _RANKS.match(self.argument)
        if found is None:
            raise ValueError(f"{self.where()}: run: {self.argument!r}; write 'N ranks' or "
                             "'N ranks under torchrun'")  # fmt: skip
        return int(found.group(1)), bool(found.group(2))


def documents() -> list[Path]:
    """README.md and every page of docs/ (the generated pages come from the code)."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the marker on the last non-blank line before it."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        end = next(
            (i for i in range(index + 1, len(lines)) if lines[i].strip() == fence.group(1)),
            len(lines),
        )
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = _MARKER.match(before.strip())
        found.append(
            Block(
                str(path.relative_to(REPO)),
                index + 1,
                fence.group(2),
                "\n".join(lines[index + 1 : end]) + "\n",
                marker.group(1) if marker else "",
                (marker.group(2) or "") if marker else "",
            )
        )
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks(path)]


def commands(text: str) -> list[str]:
    """The commands of a bash block: comment lines dropped, continuation lines joined."""
    found: list[str] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        pending = f"{pending} {stripped}".strip() if pending else stripped
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        found.append(pending)
        pending = ""
    if pending:
        found.append(pending)
    return found


def words(command: str) -> list[str]:
    """``command`` split as the shell does, its ``# comment`` dropped."""
    return shlex.split(command, comments=True)


def _elided(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#") or stripped.split("#")[0].strip() == "..."


def missing_line(fragment: str, source: str) -> str | None:
    """The first line of ``fragment`` that is not a line of ``source`` after the previous one's
    (both stripped of indentation, the source's also of a comment at its end, such as a
    ``# noqa``; blank, "..." and comment-only lines of the fragment elide), None if all are,
    in order."""
    lines = [line.strip() for line in source.splitlines()]
    bare = [line.split("  #")[0].rstrip() for line in lines]
    at = 0
    for line in fragment.splitlines():
        if _elided(line):
            continue
        wanted = line.strip()
        found = [i for i in range(at, len(lines)) if wanted in (lines[i], bare[i])]
        if not found:
            return line
        at = found[0] + 1
    return None


def _line_pattern(expected: str) -> re.Pattern[str]:
    parts = (re.escape(part) for part in expected.split("..."))
    return re.compile(".*".join(parts) + r"\Z")


def output_mismatch(expected: str, printed: str) -> str | None:
    """Where ``printed`` differs from the documented ``expected`` output (``...`` within a line:
    any text; a line of only ``...``: any lines, none included), None where it matches."""
    want = [line.rstrip() for line in expected.strip("\n").splitlines()]
    got = [line.rstrip() for line in printed.strip("\n").splitlines()]

    def match(w: int, g: int) -> bool:
        if w == len(want):
            return g == len(got)
        if want[w] == "...":
            return any(match(w + 1, k) for k in range(g, len(got) + 1))
        return g < len(got) and bool(_line_pattern(want[w]).match(got[g])) and match(w + 1, g + 1)

    if match(0, 0):
        return None
    return "documented:\n" + "\n".join(want) + "\nprinted:\n" + "\n".join(got)


def outputs_of(command: str) -> list[Block]:
    """The documented outputs of ``command`` (``<!-- output of: COMMAND -->`` blocks)."""
    return [b for b in all_blocks() if b.kind == "output of" and b.argument == command]
