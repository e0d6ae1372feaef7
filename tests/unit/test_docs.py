"""The docs a newcomer reads: a README short enough to read in ten minutes, and no link that leads nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_bytes()) <= 8000


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_benchmarks_is_a_reference_not_a_notebook():
    """At most 15,000 characters, a summary first, no host or run letters (a CPU is named by its model and
    ISA), and the runtime does not cite it (figures move; code comments should not)."""
    md = (ROOT / "BENCHMARKS.md").read_text()
    assert len(md.encode()) <= 15000  # bytes: what `wc -c` and a reader's tools count
    assert md.split("\n## ", 2)[1].startswith("Summary")
    assert not re.findall(r"\b(?:[Hh]ost|[Rr]un) [A-Z]\b", md)
    citing = [str(f.relative_to(ROOT)) for f in (ROOT / "src").rglob("*.py") if "BENCHMARKS" in f.read_text()]
    assert not citing, citing
