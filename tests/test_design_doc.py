"""The design document ships with the code that cites it.

Why: the README, the settings, the code's docstrings and the benchmarks point at ``DESIGN.md §N`` (and at the steps
of §2) for the rules they implement; someone with only a clone must find each one. This fails when the file is
missing or a cited section or step is not there: renumbered, removed, or cited wrongly.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "DESIGN.md"
CITATION = re.compile(r"DESIGN(?:\.md)?,? §(\d+)(?:\.(\d+)|[–-](\d+)|,? steps? (\d+))?")
"""``DESIGN.md §3``, ``§3–4`` (a range), ``§2.5`` and ``§2, step 5`` (a numbered step of a section)."""


def sections(text: str) -> dict[int, str]:
    """Each ``## N. Title`` section's number and its text."""
    parts = re.split(r"^## (\d+)\. .*$", text, flags=re.MULTILINE)
    return {int(number): body for number, body in zip(parts[1::2], parts[2::2], strict=True)}


def steps(body: str) -> set[int]:
    """The numbers of a section's numbered list (``1. …`` at the start of a line)."""
    return {int(n) for n in re.findall(r"^(\d+)\. ", body, flags=re.MULTILINE)}


def citations() -> list[tuple[str, int, int | None]]:
    """(where, section, step) of every citation in the tracked text files but this one."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False).stdout
    files = [ROOT / name for name in listed.split()] or sorted(ROOT.rglob("*.py"))
    found = []
    for path in files:
        if path.suffix not in {".py", ".md", ".toml"} or path == Path(__file__) or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITATION.finditer(line):
                where, section = f"{path.relative_to(ROOT)}:{n}", int(m[1])
                found.append((where, section, int(m[2] or m[4]) if (m[2] or m[4]) else None))
                if m[3]:
                    found.append((where, int(m[3]), None))
    return found


def test_the_sections_and_steps_cited_are_in_the_design_document() -> None:
    known = sections(DESIGN.read_text(encoding="utf-8"))
    cited = citations()
    assert len(cited) >= 20, "the citations are no longer found: the pattern or the listing broke"
    missing = [(where, section, step) for where, section, step in cited
               if section not in known or (step is not None and step not in steps(known[section]))]
    assert missing == []


def test_the_sections_are_numbered_in_order() -> None:
    assert list(sections(DESIGN.read_text(encoding="utf-8"))) == list(range(1, 10))


def test_a_citation_of_a_missing_step_is_caught() -> None:
    known = sections("## 1. One\n\n1. a\n2. b\n\n## 2. Two\n")
    assert steps(known[1]) == {1, 2} and steps(known[2]) == set()
    assert [(int(m[1]), m[2] or m[4]) for m in CITATION.finditer("DESIGN.md §1.3 and DESIGN §2, step 4")] == [
        (1, "3"), (2, "4")]
