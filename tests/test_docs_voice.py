"""The documentation speaks to the user of today: the pages (docs/, but the changelog), the README and the package's
docstrings and comments (freqopt/) cite no issue numbers, no commit ids and no dates of past work. What changed and
when belongs in docs/changelog.md; a figure is stated as what it is now, with the command that re-makes it.

A few look-alikes are allowed, each by file and text with its reason (ALLOWED), so that a new one is a decision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "docs" / "changelog.md"

# "issue 35", "Issue 23", "issues 22", "(issue\n    51)" and "issue #29": an issue cited, also across a line break
# (a docstring's indent or a comment's "#"). An external tracker is cited as owner/repo#N, which this does not match.
ISSUE = re.compile(r"\bissues?[\s#]+\d+", re.IGNORECASE)
# A commit id: 7-40 lowercase hex digits with at least one letter and one digit (so neither a number nor a word),
# standing alone or in a file name ("residuals_cd5ee2c.json": "_" is a boundary here), not a colour ("#1f77b4ff").
COMMIT = re.compile(r"(?<![0-9A-Za-z#])(?=[0-9]*[a-f])(?=[a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z])")
# An ISO date: in these files only ever the date of a past run.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")

# (path relative to the root, the matched text) -> why it may stay.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/search.md", "1a2b3c4d"): "an example study name's hash (gpt3-xl-h100-sxm-1a2b3c4d), not a commit",
    ("freqopt/gpu/calibration/zeus.py", "75a8b93"): "the ml-energy/zeus commit the Zeus data were copied from",
    ("freqopt/gpu/calibration/deepbench.py", "da81ba7"): "the baidu-research/DeepBench commit of its results",
    ("freqopt/gpu/calibration/fidelity.py", "da81ba7"): "the baidu-research/DeepBench commit of its results",
    ("freqopt/gpu/calibration/h200.py", "2026-11-28"): "the day the real H200's kernels were measured",
}


def _files() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".py") and p != CHANGELOG]
    package = [p for p in (ROOT / "freqopt").rglob("*") if p.suffix in (".md", ".py")]
    return sorted(docs + package) + [ROOT / "README.md"]


def hits(path: Path, text: str) -> list[str]:
    """Each citation of an issue, commit id or date in ``text`` (the file at ``path``) not in ALLOWED, as
    "path:line: match"."""
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for kind in (ISSUE, COMMIT, DATE):
        for m in kind.finditer(text):
            if (rel, m.group()) not in ALLOWED:
                found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group().split())}")
    return found


def test_no_page_docstring_or_comment_cites_an_issue_a_commit_or_a_date():
    found = [hit for path in _files() for hit in hits(path, path.read_text(encoding="utf-8"))]
    assert not found, "history belongs in docs/changelog.md; say what is true now:\n" + "\n".join(found)


def test_every_allowed_look_alike_is_still_there():
    """An allowance whose text has gone is removed, so that the list stays the reasons of what is there."""
    for rel, text in ALLOWED:
        assert text in (ROOT / rel).read_text(encoding="utf-8"), (rel, text)


@pytest.mark.parametrize("text,expected", [
    ("a step (issue 35, item 1).", ["issue 35"]),
    ("Issue 23 carries the floor", ["Issue 23"]),
    ("at confidence (issue\n        35, item 1)", ["issue 35"]),
    ("# the bracket (issue\n# 50) stays", ["issue # 50"]),
    ("set calls block (ml-energy/zeus issue #29)", ["issue #29"]),
    ("the simulated GPU of cd5ee2c", ["cd5ee2c"]),
    ("h100_whole_steps_residuals_cd5ee2c.json", ["cd5ee2c"]),
    ("a fresh clone of 6fa0dcb4e1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6", ["6fa0dcb4e1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6"]),
    ("on 2 cores, 2026-11-28)", ["2026-11-28"]),
    # Look-alikes that are not citations.
    ("ml-energy/zeus#29; the runtime thread can issue\n        (GPUSpec.max_switches_per_s)", []),
    ("13.87606831909865 J; 1,016 s; colour #1f77b4ff; a decade, effaced", []),
    ("sha of a study name gpt3-xl-deadbeef", []),
])
def test_the_patterns_find_citations_and_only_them(text, expected):
    found = [" ".join(m.group().split()) for kind in (ISSUE, COMMIT, DATE) for m in kind.finditer(text)]
    assert found == [" ".join(e.split()) for e in expected]
