"""Every relative link in README.md and docs/*.md reaches a file of the repository, and every
`#anchor` a heading of its target page (GitHub's heading ids: lower case, punctuation other
than `-` and `_` dropped, spaces as `-`, a repeated heading numbered `-1`, `-2`, ...).

The docs move sections between pages (docs/planner.md's older records to docs/history.md);
a link left behind breaks silently on GitHub, so this test reads them all."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(page: Path):
    """(line number, line) of `page` outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield i, line


def heading_ids(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page` (fenced code blocks skipped)."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose(page):
        m = HEADING.match(line)
        if m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def test_heading_ids_follow_githubs_rule(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A page\n## Shared cores: the replay (2026-12-07, 3fa34aa)\n"
                    "```\n# not a heading\n```\n## `tuner estimate` flags\n## Notes\n## Notes\n")
    assert heading_ids(page) == {"a-page", "shared-cores-the-replay-2026-12-07-3fa34aa",
                                 "tuner-estimate-flags", "notes", "notes-1"}


def _links(page: Path) -> list[tuple[int, str]]:
    return [(i, t) for i, line in _prose(page) for t in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    ids: dict[Path, set[str]] = {}
    broken = []
    for line, target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.name}:{line}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md":
            if dest not in ids:
                ids[dest] = heading_ids(dest)
            if anchor not in ids[dest]:
                broken.append(f"{page.name}:{line}: {target} (no heading with that id)")
    assert not broken, "broken links:\n" + "\n".join(broken)
