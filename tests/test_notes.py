"""CONTRIBUTING.md's NOTE table lists every NOTE block of the package, and nothing else.

A NOTE block is defined by a line that is its title alone, ``NOTE [ Title ]`` (in a comment or
a docstring), or its title and a colon; every other mention (``See NOTE [Title]``) refers to one.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "chunk_offload"
DEFINITION = re.compile(r"^\s*(?:#\s*)?NOTE \[\s*([^\]]+?)\s*\](?::.*)?$")
MENTION = re.compile(r"NOTE \[\s*([^\]]+?)\s*\]")
ROW = re.compile(r"^\| ([^|`]+?) \| `([^`]+)`")


def defined_notes() -> set[tuple[str, str]]:
    """(title, file relative to chunk_offload/) of every NOTE block in the package."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            match = DEFINITION.match(line)
            if match:
                found.add((match.group(1), path.relative_to(PACKAGE).as_posix()))
    return found


def table_notes() -> set[tuple[str, str]]:
    """(title, file) of every row of CONTRIBUTING.md's NOTE table (several titles to a row allowed)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("| NOTE | where |") :].split("\n\n")[0]
    rows = set()
    for line in table.splitlines()[2:]:
        match = ROW.match(line)
        assert match, f"CONTRIBUTING.md: a NOTE table row must read '| Title, Title | `file` ... |': {line!r}"
        rows.update((title.strip(), match.group(2)) for title in match.group(1).split(","))
    return rows


def test_the_note_table_lists_every_note_block() -> None:
    defined, listed = defined_notes(), table_notes()
    missing = sorted(defined - listed)
    stale = sorted(listed - defined)
    assert not missing and not stale, f"CONTRIBUTING.md's NOTE table: missing rows {missing}; stale rows {stale}"


def test_every_note_mention_names_a_defined_block() -> None:
    titles = {title for title, _ in defined_notes()}
    unknown = sorted(
        {
            f"{path.relative_to(PACKAGE)}: {title}"
            for path in PACKAGE.rglob("*.py")
            for title in (" ".join(t.split()) for t in MENTION.findall(path.read_text()))
            if title not in titles
        }
    )
    assert not unknown, f"NOTE mentions without a NOTE block: {unknown}"


def test_the_parsers_see_definitions_and_rows() -> None:
    """The checks can fail: both sides hold known entries, and a mention is no definition."""
    assert ("Reload order", "core/ordering.py") in defined_notes()
    assert ("Reload allocation", "core/copies.py") in table_notes()
    assert DEFINITION.match("        # NOTE [ Reload order ]")
    assert not DEFINITION.match("copy_stream.wait_stream(compute)  # See NOTE [ Reload order ]")
    assert not DEFINITION.match("# NOTE [Deferred exchanges] (exchange.py): auto iterations close late.")
