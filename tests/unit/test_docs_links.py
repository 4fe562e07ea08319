"""Every link between the project's Markdown files resolves: the file exists, and an
anchor (``#...``) names a heading of that file as GitHub renders it. Links with a
scheme (https:, mailto:) are not followed. And every reference by name in the text,
code and SQL (``docs/NAME.md, "Section"``) names a file of docs/ and the start of one of
its headings."""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "reports" / "README.md",
               *(ROOT / "docs").glob("*.md")])
#: Where a section of docs/ is named in prose: the docs, the SQL, the Python, the Makefile.
SOURCES = sorted([*DOCS, ROOT / "Makefile", *(ROOT / "sql").rglob("*.sql"),
                  *[p for d in ("composer_ops", "bench", "tests") for p in (ROOT / d).rglob("*.py")
                    if p != Path(__file__).resolve()]])
#: ``docs/NAME.md, "Section"``, ``docs/NAME.md ("Section")`` or the same of README.md (the
#: quote may go on over a line break, a comment's marker with it: ``--`` in SQL, ``#`` in
#: Python and the Makefile).
_NAMED = re.compile(r'\b(README\.md|docs/[\w-]+\.md)`?,?\s*(?:\n\s*(?:--|#)?\s*)?\(?"([^"]+)"')
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


def headings(text: str) -> list[str]:
    """The headings of a Markdown text, as written (code spans without their backticks)."""
    tokens = _PARSER.parse(text)
    return [_inline_text(tokens[i + 1]).strip() for i, t in enumerate(tokens) if t.type == "heading_open"]


def named_sections(text: str) -> list[tuple[str, str]]:
    """The references by name in ``text``: (the file, from the project's root; the section
    as quoted, its line breaks and comment markers folded into spaces)."""
    return [(m.group(1), re.sub(r"\s*\n\s*(?:--|#)?\s*", " ", m.group(2)).strip()) for m in _NAMED.finditer(text)]


@functools.cache
def _file_slugs(path: Path) -> frozenset[str]:
    return frozenset(slugs(path.read_text()))


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
        elif anchor and target.suffix == ".md" and anchor not in _file_slugs(target):
            broken.append(f"{href}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_named_sections_are_read_across_comment_lines() -> None:
    text = ('-- (docs/performance-log.md, "Wake-ups\n-- handed to busy workers")\nx docs/a.md, "B"\n'
            '# README.md, "Tests": y docs/b.md ("C")')
    assert named_sections(text) == [("docs/performance-log.md", "Wake-ups handed to busy workers"),
                                    ("docs/a.md", "B"), ("README.md", "Tests"), ("docs/b.md", "C")]


def test_sections_named_in_prose_exist() -> None:
    """A reference such as (docs/performance-log.md, "What the function layers cost")
    names a Markdown file of the project and the start of one of its headings (any case)."""
    found: dict[str, list[str]] = {}
    broken = []
    count = 0
    for source in SOURCES:
        text = source.read_text()
        if ".md" not in text:
            continue
        for name, section in named_sections(text):
            count += 1
            target = ROOT / name
            if not target.exists():
                broken.append(f"{source.relative_to(ROOT)}: {name} does not exist")
                continue
            heads = found.setdefault(name, [h.lower() for h in headings(target.read_text())])
            if not any(h.startswith(section.lower()) for h in heads):
                broken.append(f'{source.relative_to(ROOT)}: no heading of {name} starts with "{section}"')
    assert count > 20, f"only {count} references by name found: is the pattern still right?"
    assert not broken, "; ".join(broken)


def test_every_experiment_of_the_log_is_in_the_index() -> None:
    """performance.md's "The experiment log" links each dated section of performance-log.md."""
    log = (ROOT / "docs" / "performance-log.md").read_text()
    index = (ROOT / "docs" / "performance.md").read_text().split("## The experiment log", 1)[1]
    linked = set(re.findall(r"\(performance-log\.md#([\w-]+)\)", index))
    dated = [h for h in re.findall(r"^## (.+)$", log, flags=re.MULTILINE)]
    unlisted = [h for h in dated if re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") not in linked]
    assert dated and not unlisted, unlisted
