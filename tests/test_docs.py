"""The README and the pages of docs/ lead somewhere: every relative link names a file the project holds, and every
`#anchor` a heading of the page it points into (as GitHub makes anchors from headings)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation left out, spaces as hyphens, a repeated
    one numbered -1, -2, …"""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(text):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of `page` whose file is missing (or lies outside `root`) or whose anchor no heading of
    that file makes."""
    problems = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or root.resolve() not in dest.parents:
                problems.append(f"{page.name}: {target}: no such file in the project")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
                problems.append(f"{page.name}: {target}: no heading #{anchor} in {dest.name}")
    return problems


def test_every_link_of_the_readme_and_the_docs_leads_somewhere():
    assert len(PAGES) > 1, "docs/ holds no page"
    problems = [problem for page in PAGES for problem in broken_links(page)]
    assert problems == []


def test_the_readme_links_into_every_page_of_the_docs():
    readme = ROOT / "README.md"
    linked = {(readme.parent / target.partition("#")[0]).resolve()
              for line in _prose(readme.read_text()) for target in LINK.findall(line)}
    assert [page.name for page in PAGES[1:] if page.resolve() not in linked] == []


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Exit codes (every command)\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#exit-codes-every-command) [gone](missing.md) [bad](other.md#not-a-heading)\n"
                    "`[in code](nowhere.md)` [self](#page) [web](https://example.com/x)\n\n# Page\n")
    assert broken_links(page, tmp_path) == ["page.md: missing.md: no such file in the project",
                                  "page.md: other.md#not-a-heading: no heading #not-a-heading in other.md"]
