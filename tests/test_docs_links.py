"""CPU: every relative link in README.md and docs/*.md names a file that exists and, with a
``#fragment`` into a markdown file, a heading there (GitHub's anchors: lower case, spaces
to hyphens, punctuation but ``-`` and ``_`` dropped, ``-1``, ``-2`` for repeats)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str, code_spans: bool = False) -> list[str]:
    """The lines outside fenced code blocks; their inline code spans removed unless
    ``code_spans`` (a heading's anchor keeps their text)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line if code_spans else re.sub(r"`[^`]*`", "", line))
    return lines


def anchors(page: Path):
    seen: dict[str, int] = {}
    for line in prose(page.read_text(), code_spans=True):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
            yield s if seen[s] == 0 else f"{s}-{seen[s]}"


def links(page: Path):
    for line in prose(page.read_text()):
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", m.group(1)):
                yield m.group(1)


def test_slug_is_githubs():
    assert slug("The wgmma producer: the plan's above 8 rows on sm_90 (issue 33, H200)") == (
        "the-wgmma-producer-the-plans-above-8-rows-on-sm_90-issue-33-h200"
    )
    assert slug("`bench_kda.py` rows, T = 1") == "bench_kdapy-rows-t--1"


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in set(anchors(dest)):
            bad.append(f"{target}: no such heading")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert not broken(page), f"{page.name}: {broken(page)}"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading\n\n[ok](#a-code-heading) [bad](#a-heading) [x](nope.md)\n")
    assert set(anchors(page)) == {"a-code-heading"}
    assert list(links(page)) == ["#a-code-heading", "#a-heading", "nope.md"]
    assert broken(page) == ["#a-heading: no such heading", "nope.md: no such file"]
