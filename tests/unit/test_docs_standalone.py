"""The docs stand alone: nothing under ``docs/``, ``leasekit/`` or in ``README.md`` points at material
outside this repository (the ``../shared`` directory, DESIGN.md, CASES.md) or at issue-tracker items
("issue 6", "#12", "(stop 11)", "(point 3)", also in headings). A reference to another project's
issue qualified by its repository (``owner/repo#426``) is fine: it stands alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN = (
    (re.compile(r"\.\./shared\b"), "the ../shared directory is not part of the repository"),
    (re.compile(r"\bDESIGN\.md\b"), "DESIGN.md is not part of the repository"),
    (re.compile(r"\bCASES\.md\b"), "CASES.md is not part of the repository (the incident classes are tests/sim/test_cases_*.py)"),
    (re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE), "an issue number"),
    (re.compile(r"(?<![\w/&#.-])#\d{1,2}\b"), "an issue or pull-request number"),
    (re.compile(r"\((?:points?|stops?)\s+\d", re.IGNORECASE), "a point or stop of an issue"),
)
"""(pattern, why) of each kind of reference that does not stand alone."""

PENDING: dict[tuple[str, str], str] = {
    # (file relative to the repository, text of the offending line) -> why it is still allowed. Only for
    # files another change is editing at the same time; each entry is removed by the fix.
}


def checked_files(root: Path) -> list[Path]:
    """README.md, every file under docs/, and every text file under leasekit/ (no caches)."""
    files = [root / "README.md"] if (root / "README.md").exists() else []
    for top in ("docs", "leasekit"):
        files += [p for p in sorted((root / top).rglob("*"))
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".png", ".so")]
    return files


def references(root: Path) -> list[tuple[str, int, str, str, str]]:
    """``(file, line number, the matched text, why, the whole line)`` of each reference that does
    not stand alone in :func:`checked_files`, in file, line and pattern order."""
    found = []
    for path in checked_files(root):
        rel = str(path.relative_to(root))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            taken: list[tuple[int, int]] = []  # one reference, one report ("issue #12" is not also "#12")
            for pattern, why in FORBIDDEN:
                for match in pattern.finditer(line):
                    if not any(a < match.end() and match.start() < b for a, b in taken):
                        taken.append(match.span())
                        found.append((rel, number, match.group(0), why, line))
    return found


def _pending(rel: str, line: str) -> tuple[str, str] | None:
    return next((key for key in PENDING if key[0] == rel and key[1] in line), None)


def test_docs_readme_and_code_stand_alone():
    found = references(REPO)
    problems = [f"{rel}:{number}: {text!r}: {why}; the docs must stand alone"
                for rel, number, text, why, line in found if _pending(rel, line) is None]
    assert not problems, "\n".join(problems)
    used = {_pending(rel, line) for rel, _, _, _, line in found}
    stale = sorted(set(PENDING) - used)
    assert not stale, f"PENDING entries that no longer occur (remove them): {stale}"


@pytest.mark.parametrize("text, hits", [
    ("see ../shared/notes for details", ["../shared"]),
    ("as DESIGN.md says", ["DESIGN.md"]),
    ("the tie of CASES.md K08", ["CASES.md"]),
    ("# Holding firm (issue 6)", ["issue 6"]),
    ("fixed in Issue #12, see also #7", ["Issue #12", "#7"]),
    ("### Discovery and compatibility (point 3)", ["(point 3"]),
    ("built and removed (stops 9-11)", ["(stops 9"]),
    ("bypassing libfaketime (wolfcw/libfaketime#426)", []),
    ("colour #1f77b4, entity &#39;, url http://h/#12, D issues heartbeats", []),
    ("#include <time.h>  # 3 retries", []),
])
def test_patterns_catch_references_and_spare_the_rest(tmp_path, text, hits):
    (tmp_path / "docs").mkdir()
    (tmp_path / "leasekit").mkdir()
    (tmp_path / "docs" / "page.md").write_text(f"intro\n{text}\n", encoding="utf-8")
    found = references(tmp_path)
    assert [t for _, _, t, _, _ in found] == hits
    assert all(rel == "docs/page.md" and number == 2 for rel, number, _, _, _ in found)
