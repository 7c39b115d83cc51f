"""The README stays short, and the README and docs/ link only to what exists and cite no issues.

A newcomer reads README.md in minutes; the reference lives in docs/. Every relative link
resolves to a file of the checkout, and a link's ``#anchor`` to a heading of its target
(GitHub's slugs). Neither names issue numbers: the docs describe the product as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
ISSUE = re.compile(r"(?<![\w/&])#\d{1,3}\b")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'.

    >>> slug("Event time: what is judged, and what is counted")
    'event-time-what-is-judged-and-what-is-counted'
    >>> slug("Offline: `servewatch compare`")
    'offline-servewatch-compare'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference to docs/"


def test_docs_pages_exist() -> None:
    assert len(PAGES) > 1, "docs/*.md missing"


@pytest.mark.parametrize("path", PAGES, ids=name)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {name(resolved)}")
    assert not broken, f"{name(path)}: {broken}"


@pytest.mark.parametrize("path", PAGES, ids=name)
def test_no_issue_numbers(path: Path) -> None:
    found = ISSUE.findall(prose(path.read_text()))
    assert not found, f"{name(path)} cites issue numbers {found}: describe the product, not its history"
