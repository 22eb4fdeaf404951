"""The contract lives in the repository (issue 13 item 13): nothing cites a file outside the clone, and
every "SPEC N" / "SPEC N.M" cited in code or docs is a section of docs/spec.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    p
    for d in (
        "backends",
        "conformance",
        "glm5",
        "quant",
        "kernels_cuda",
        "kernels_ascend",
        "bench",
        "docs",
        "tests",
    )
    for p in (ROOT / d).rglob("*")
    if p.suffix in (".py", ".md", ".yaml")
]
SOURCES += [ROOT / "README.md", ROOT / "tox.ini", ROOT / "pyproject.toml"]


def test_nothing_cites_the_contract_outside_the_repository():
    bad = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        if p != Path(__file__) and re.search(r"\.\./(shared/)?SPEC\.md", p.read_text(errors="replace"))
    ]
    assert bad == []


def test_every_cited_section_exists():
    headings = set()
    for line in (ROOT / "docs" / "spec.md").read_text().splitlines():
        m = re.match(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", line)
        if m:
            headings.add(m.group(1))
    assert {"1", "2", "2.4", "4", "7.7", "8", "9", "10"} <= headings
    cited = set()
    for p in SOURCES:
        for m in re.finditer(r"\bSPEC (\d+(?:\.\d+)?)", p.read_text(errors="replace")):
            cited.add((m.group(1), str(p.relative_to(ROOT))))
    missing = sorted((sec, f) for sec, f in cited if sec not in headings)
    assert missing == []
