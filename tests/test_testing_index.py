"""docs/testing.md's index of the test files lists every ``tests/test_*.py``
once, one line each, grouped by feature: a test file added without its line
(or a line left for a file that is gone) fails here, naming the file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Index of the test files"
#: a row of the index: | `tests/test_NAME.py` | what it checks |
ROW = re.compile(r"^\| `tests/(test_\w+\.py)` \| \S", re.MULTILINE)


def _index() -> str:
    """The index section of docs/testing.md (up to the next ``## `` heading)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    assert HEADING in text, f"docs/testing.md has no section {HEADING!r}"
    start = text.index(HEADING) + len(HEADING)
    end = text.find("\n## ", start)
    return text[start:] if end == -1 else text[start:end]


def test_every_test_file_has_exactly_one_line_in_the_index() -> None:
    rows = ROW.findall(_index())
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    missing = sorted(files - set(rows))
    assert not missing, f"docs/testing.md, {HEADING[3:]!r}: add one line (| `tests/NAME` | what it checks |) " \
                        f"for {missing}"
    gone = sorted(set(rows) - files)
    assert not gone, f"docs/testing.md, {HEADING[3:]!r} lists files that do not exist: {gone}"
    twice = sorted({r for r in rows if rows.count(r) > 1})
    assert not twice, f"docs/testing.md, {HEADING[3:]!r} lists these more than once: {twice}"

