"""Design notes cited in code live in the repository: every ``docs/*.md`` a source file names
exists, and nothing cites a document a reader of the repository cannot open."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("services", "tests", "bench", "protos", "scripts") for p in (ROOT / d).rglob("*")
           if p.suffix in {".py", ".proto", ".c", ".h", ".sh"} and "pb" not in p.relative_to(ROOT).parts]


def test_cited_docs_exist() -> None:
    missing = []
    for path in SOURCES:
        for name in set(re.findall(r"docs/([\w-]+\.md)", path.read_text())):
            if not (ROOT / "docs" / name).is_file():
                missing.append(f"{path.relative_to(ROOT)} cites docs/{name}")
    assert not missing, missing


def test_no_citation_outside_the_repository() -> None:
    spec = re.compile("SP" + r"EC\s*§|shared/" + "SPEC")  # split so this file does not match itself
    found = [str(p.relative_to(ROOT)) for p in SOURCES if spec.search(p.read_text())]
    assert not found, found
