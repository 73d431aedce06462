"""Host lists: the one parser of ``host:slots`` entries, for commlayerrun's ``-H`` and
``--hostfile``, and for the elastic driver's ``-H`` and host discovery script.

An entry is ``host`` (``default_slots`` slots), ``host:N`` or, as in Open MPI's hostfiles,
``host slots=N`` (``max_slots=M`` is accepted and ignored). Entries are separated by commas or
lines; '#' starts a comment; a blank line is skipped, an empty entry between commas is an error
(``-H a:1,,b:1`` is a typo, not a host). A host named twice gets the sum of its slots. Slots are
ASCII digits (``str.isdigit`` takes '²', which ``int`` refuses) in 1..``MAX_SLOTS``.
"""

from __future__ import annotations

import re

# Slots of one host: above the cores of any one machine (2 sockets x 192 cores x 2 threads is
# 768), low enough that a typo (localhost:99999999999999999999) is an error here instead of a
# launcher placing ranks on slots no machine has.
MAX_SLOTS = 4096
_DIGITS = re.compile(r"[0-9]+")
# Letters, digits, '-', '.', '_': host names and IPv4 addresses (RFC 1123, with the '_' that
# some clusters' names have).
_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _slots(text: str, entry: str, what: str) -> int:
    if not _DIGITS.fullmatch(text) or not 1 <= int(text) <= MAX_SLOTS:
        raise ValueError(_bad(entry, what, f"slots {text!r} is not an integer 1..{MAX_SLOTS}"))
    return int(text)


def _bad(entry: str, what: str, why: str) -> str:
    return (
        f"{what}: bad entry {entry!r} ({why}); expected host:slots entries (host1:N,host2:M, a "
        f"bare host for its default slots, or 'host slots=N' lines), slots 1..{MAX_SLOTS}"
    )


def _entry(entry: str, default_slots: int, what: str) -> tuple[str, int]:
    words = entry.split()
    name, colon, count = words[0].partition(":")
    slots = _slots(count, entry, what) if colon else default_slots
    for word in words[1:]:
        key, equals, value = word.partition("=")
        if not equals or key not in ("slots", "max_slots") or colon:
            raise ValueError(_bad(entry, what, f"unexpected {word!r}"))
        number = _slots(value, entry, what)
        slots = number if key == "slots" else slots
    if not name:
        raise ValueError(_bad(entry, what, "no host name"))
    if not _NAME.fullmatch(name):
        raise ValueError(
            _bad(entry, what, "a host name has ASCII letters, digits, '-', '.' and '_' only")
        )
    return name, slots


def parse(text: str, what: str, default_slots: int = 1) -> dict[str, int]:
    """``{host: slots}`` in the order the hosts first appear (module docstring); {} for a text
    with no entry (a discovery script that found no host). ValueError naming ``what`` (the
    option or file it came from) and the bad entry."""
    if not 1 <= default_slots <= MAX_SLOTS:
        raise ValueError(f"{what}: default slots {default_slots} is not in 1..{MAX_SLOTS}")
    hosts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        for entry in line.split(","):
            entry = entry.strip()
            if not entry:
                raise ValueError(_bad(line, what, "an empty entry"))
            name, slots = _entry(entry, default_slots, what)
            hosts[name] = hosts.get(name, 0) + slots
    return hosts
