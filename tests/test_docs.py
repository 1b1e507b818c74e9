"""The documentation says only what the program does, and its links
resolve.

Links: every relative link and ``#anchor`` in README.md and docs/*.md resolves.

A link's target is a file relative to the page that links it (a folder or a file, as GitHub
resolves it), and its anchor one of the target page's headings, slugged as GitHub slugs them:
the heading's text as rendered (inline code and emphasis marks gone), lower-cased, every
character other than a letter, a digit, ``-``, ``_`` or a space dropped, spaces made ``-``, and
a repeated slug numbered ``-1``, ``-2``... Links inside fenced code blocks and inline code are
text, not links. External links (``http:``, ``https:``, ``mailto:``) are not fetched.

Words: the user pages (README.md and docs/*.md but docs/contributing.md) speak of the user's
machine: no issue numbers, nothing of the project's own machines, and no ``make`` target but
``test`` and ``bench`` described there (the others are in docs/contributing.md, which they link).

Examples: what an example's docstring (and the README) says it prints is what a run prints, in
shape (the numbers vary with timing); what ``custom_transport.py`` says of its bytes (they load
again, in another process) is run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTRIBUTING = ROOT / "docs" / "contributing.md"
USER_PAGES = [p for p in PAGES if p != CONTRIBUTING]
EXAMPLES = ROOT / "examples"

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


# -- words: the user's machine, not the project's ----------------------------------------

# What a user page must not say: an issue by number, the project's own machines and their
# package indexes. docs/contributing.md is where that belongs.
PROJECT_WORDS = [
    re.compile(r"\bissues?\s*#?\d+", re.I),
    re.compile(r"\b(dev|CI)( and CI| or CI)? machines?\b", re.I),
    re.compile(r"\bthese machines\b", re.I),
    re.compile(r"\bour machines?\b", re.I),
    re.compile(r"\bthis project's CI\b", re.I),
    re.compile(r"\bpip is capped\b", re.I),
    re.compile(r"download\.pytorch\.org"),
    re.compile(r"file:///|/opt/pypi"),
]
DEV_TARGETS = ("asan", "tsan", "stress", "pythons", "suite-python", "suite-torch", "bench-chart", "lint", "format", "typecheck", "clean")


def test_project_words_are_caught():
    said = "See issue 38, Issue 30's goals, the dev and CI machines, pip is capped at 2.14.1."
    assert sum(bool(p.search(said)) for p in PROJECT_WORDS) == 3
    assert not any(p.search("a Python issue with the GIL; the user's machine; 64 issued refs") for p in PROJECT_WORDS)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_user_pages_speak_of_the_users_machine(page):
    text = page.read_text()
    flat = text.replace("\n", " ")  # a phrase may wrap: "the dev and CI" / "machines"
    found = [
        f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for pattern in PROJECT_WORDS
        for m in pattern.finditer(flat)
    ]
    for number, line in enumerate(text.splitlines(), 1):
        # a row of a table that describes a development target: docs/contributing.md's
        m = re.match(r"\|\s*`make ([\w-]+)", line)
        if m and m.group(1) in DEV_TARGETS:
            found.append(f"{page.relative_to(ROOT)}:{number}: describes `make {m.group(1)}`")
    assert not found, "words for docs/contributing.md, not a user page:\n" + "\n".join(found)


def test_contributing_has_every_target_and_is_linked():
    text = CONTRIBUTING.read_text()
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M)
    assert phony
    missing = [t for t in phony.group(1).split() if t != "install" and f"`make {t}" not in text]
    assert not missing, f"make targets docs/contributing.md does not describe: {missing}"
    assert "docs/contributing.md" in (ROOT / "README.md").read_text()


# -- examples: what their docstrings and the README say they print -----------------------


def docstring(name: str) -> str:
    import ast

    doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
    assert doc, f"examples/{name} has no docstring"
    return doc


def printed_block(doc: str) -> list[str]:
    """The indented block after "printed:" in a docstring: what a run printed."""
    lines = doc.split("printed:", 1)[1].splitlines()
    block = [line.strip() for line in lines[1:] if line.startswith("    ")]
    assert block, "no printed output quoted"
    return block


def shape(line: str) -> str:
    """A printed line with its counts as a pattern: timing moves them, not the words."""
    return "^" + re.sub(r"\d[\d,.]*", r"\\d+", re.escape(line)) + "$"


# The examples run torch; make pythons runs this file where torch is not installed.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="runs torch, not installed here")


def run_example(name: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120, cwd=EXAMPLES)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.splitlines()


def test_shape_ignores_counts_only():
    assert re.match(shape("received 400 storages in 200 messages"), "received 16 storages in 8 messages")
    assert not re.match(shape("received 400 storages in 200 messages"), "received 16 storages in 8 batches")


@needs_torch
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["quickstart.py", "dataloader_dicts.py"])
def test_an_example_prints_what_its_docstring_quotes(name):
    quoted = printed_block(docstring(name))
    printed = run_example(name)
    assert len(printed) == len(quoted), (quoted, printed)
    for want, got in zip(quoted, printed, strict=True):
        assert re.match(shape(want), got), f"examples/{name} printed {got!r}; its docstring says {want!r}"


def test_readme_quotes_the_quickstarts_output():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### What the quickstart prints", 1)[1]
    block = section.split("```", 2)[1].strip().splitlines()
    assert block == printed_block(docstring("quickstart.py"))


def test_custom_transport_says_its_bytes_load_again():
    doc = docstring("custom_transport.py")
    assert not re.search(r"\bonce\b", doc), "the bytes load again and again, not once"
    assert "as many times as you like" in doc


@needs_torch
@pytest.mark.timeout(120)
def test_custom_transport_bytes_load_again_in_another_process():
    """What custom_transport.py's docstring says: the bytes of dumps() load in another
    process of the program, again and again, while their tensors live."""
    script = """
import multiprocessing as mp, torch, shmreduce
def load_twice(data, conn):
    a, b = shmreduce.loads(data), shmreduce.loads(data)
    conn.send((a["t"].sum().item(), b["t"].sum().item(), a["t"].data_ptr() == b["t"].data_ptr()))
if __name__ == "__main__":
    t = torch.ones(1000)
    data = shmreduce.dumps({"t": t})
    r, w = mp.Pipe(duplex=False)
    p = mp.get_context("fork").Process(target=load_twice, args=(data, w))
    p.start()
    print(r.recv())
    p.join(30)
    assert p.exitcode == 0
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(1000.0, 1000.0, True)", proc.stdout
