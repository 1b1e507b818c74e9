"""The documentation's links: every relative link and ``#anchor`` in README.md and docs/*.md
resolves (issue 31).

A link's target is a file relative to the page that links it (a folder or a file, as GitHub
resolves it), and its anchor one of the target page's headings, slugged as GitHub slugs them:
the heading's text as rendered (inline code and emphasis marks gone), lower-cased, every
character other than a letter, a digit, ``-``, ``_`` or a space dropped, spaces made ``-``, and
a repeated slug numbered ``-1``, ``-2``... Links inside fenced code blocks and inline code are
text, not links. External links (``http:``, ``https:``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target), the target up to the first space or closing parenthesis
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text."""
    parts = re.split(r"(`+[^`]*`+)", heading)  # odd parts: inline code, kept as its text
    text = ""
    for i, part in enumerate(parts):
        if i % 2:
            text += part.strip("`")
        else:
            part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)  # links: their text
            text += re.sub(r"(\*\*|__|\*|(?<!\w)_(?=\w)|(?<=\w)_(?!\w))", "", part)  # emphasis marks, not snake_case
    text = "".join(ch for ch in text.strip().lower() if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines(page.read_text()):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((number, m.group(1)))
    return out


def test_slugs_follow_githubs_rules():
    assert slug("Pools: what memory shmreduce keeps, and why") == "pools-what-memory-shmreduce-keeps-and-why"
    assert slug("Python 3.14 and free-threaded builds") == "python-314-and-free-threaded-builds"
    assert slug("DataLoader with `pin_memory=True` and `persistent_workers=True`") == (
        "dataloader-with-pin_memorytrue-and-persistent_workerstrue"
    )
    assert slug("Guarantees (the same as torch.multiprocessing unless noted)") == (
        "guarantees-the-same-as-torchmultiprocessing-unless-noted"
    )
    assert slug("Actor–learner loops") == "actorlearner-loops"
    assert slug("The native core (`shmreduce/_native/`)") == "the-native-core-shmreduce_native"
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/design.md", "docs/compatibility.md", "docs/migrating.md"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for number, target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            broken.append(f"{where}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{where}: no heading with that anchor in {resolved.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_a_broken_anchor_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Part one\n\n[ok](#part-one) [bad](#part-two) `[code](#not-a-link)`\n\n```\n[fenced](#nope)\n```\n")
    assert anchors(page) == {"title", "part-one"}
    assert [t for _, t in links(page)] == ["#part-one", "#part-two"]
