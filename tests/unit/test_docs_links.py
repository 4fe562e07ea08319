"""Every link between the project's Markdown files resolves: the file exists, and an
anchor (``#...``) names a heading of that file as GitHub renders it. Links with a
scheme (https:, mailto:) are not followed."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
_PARSER = MarkdownIt("commonmark").enable("table")


def _inline_text(token: Token) -> str:
    return "".join(child.content for child in token.children or [] if child.type in ("text", "code_inline"))


def slugs(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text: lower case, every
    character but letters, digits, '_', '-' and spaces dropped, spaces as '-', a
    repeated anchor numbered from -1."""
    seen: Counter[str] = Counter()
    out: set[str] = set()
    tokens = _PARSER.parse(text)
    for i, token in enumerate(tokens):
        if token.type != "heading_open":
            continue
        base = re.sub(r"[^\w\- ]", "", _inline_text(tokens[i + 1]).strip().lower()).replace(" ", "-")
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def links(text: str) -> list[str]:
    found: list[str] = []
    for token in _PARSER.parse(text):
        for child in token.children or []:
            if child.type == "link_open":
                found.append(str(child.attrs.get("href", "")))
    return found


def test_slugs_follow_githubs_rules() -> None:
    text = "# Where the CPU of a 1-task run goes (profile of 244ec5b, 2026-12-04)\n## `make bench` runs\n## A\n## A\n"
    assert slugs(text) == {"where-the-cpu-of-a-1-task-run-goes-profile-of-244ec5b-2026-12-04", "make-bench-runs",
                           "a", "a-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc: Path) -> None:
    broken = []
    for href in links(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", href):
            continue
        path, _, anchor = href.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{href}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in slugs(target.read_text()):
            broken.append(f"{href}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)
