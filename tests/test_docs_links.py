"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and a
`#anchor` names a heading of that file (GitHub's slugs). A section moved between guides
breaks the links into it; this finds them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(CODE.sub("", FENCE.sub("", page.read_text()))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    bad = {p.relative_to(ROOT).as_posix(): broken_links(p) for p in pages()}
    assert {page: links for page, links in bad.items() if links} == {}


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "guide.md").write_text("# A guide\n\n## Two words\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](guide.md#two-words) [self](#top) ![img](missing.png)\n"
                    "[gone](guide.md#three-words) `[code](nowhere.md)`\n```\n[x](fenced.md)\n```\n# Top\n")
    assert broken_links(page) == ["missing.png: no such file", "guide.md#three-words: no such heading"]
