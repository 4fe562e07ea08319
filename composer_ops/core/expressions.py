"""``$.`` references in workflow definitions: parsing, walking templates, resolving.

Inside a template (any JSON value), a string starting with ``$.`` is a reference to
``$.input...``, ``$.config...`` or ``$.nodes.<id>.output...``; every other string is a
literal. Segments are separated by ``.``; a digits-only segment indexes a list.
Resolution is total: a path that leads nowhere resolves to ``None`` rather than failing
the node, because a TASK handler judges a missing optional field better than the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from composer_ops.core.model import RunContext
from composer_ops.errors import Invalid

__all__ = [
    "NODE_ID_PATTERN",
    "Ref",
    "is_ref",
    "iter_refs",
    "parse_ref",
    "referenced_nodes",
    "resolve",
    "resolve_ref",
]

#: Node ids may not contain ``.``: it separates the segments of a reference.
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
ROOTS = ("input", "config", "nodes")


@dataclass(frozen=True, kw_only=True)
class Ref:
    """A parsed reference: ``root`` is input, config or nodes; ``node`` is set for nodes."""

    text: str
    root: str
    node: str | None
    path: tuple[str, ...]


def is_ref(value: object) -> bool:
    """True when ``value`` is a string that the resolver treats as a reference."""
    return isinstance(value, str) and value.startswith("$.")


@lru_cache(maxsize=4096)
def _parse(text: str) -> Ref:
    segments = text[2:].split(".")
    if any(s == "" for s in segments):
        raise Invalid(f"bad reference {json.dumps(text)}: empty path segment")
    root, rest = segments[0], segments[1:]
    if root not in ROOTS:
        raise Invalid(
            f"bad reference {json.dumps(text)}: unknown root {json.dumps(root)} (expected input, config or nodes)"
        )
    if root != "nodes":
        return Ref(text=text, root=root, node=None, path=tuple(rest))
    if len(rest) < 2 or rest[1] != "output":
        raise Invalid(f"bad reference {json.dumps(text)}: expected $.nodes.<id>.output[.path]")
    node = rest[0]
    if not NODE_ID_PATTERN.fullmatch(node):
        raise Invalid(f"bad reference {json.dumps(text)}: {json.dumps(node)} is not a valid node id")
    return Ref(text=text, root=root, node=node, path=tuple(rest[2:]))


def parse_ref(text: str) -> Ref:
    """Parse a ``$.`` reference; raise ``Invalid`` naming the problem on bad syntax."""
    if not is_ref(text):
        raise Invalid(f"bad reference {json.dumps(text)}: a reference starts with '$.'")
    return _parse(text)


def iter_refs(template: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(location, text)`` for every reference string in a template.

    ``location`` is a dotted path into the template (``amount``, ``items.0``), empty
    for the template itself, so validation errors can point at the offending value.
    """
    if isinstance(template, str):
        if is_ref(template):
            yield where, template
    elif isinstance(template, Mapping):
        for key, value in template.items():
            yield from iter_refs(value, f"{where}.{key}" if where else str(key))
    elif isinstance(template, Sequence) and not isinstance(template, bytes | bytearray):
        for index, value in enumerate(template):
            yield from iter_refs(value, f"{where}.{index}" if where else str(index))


def referenced_nodes(template: Any) -> set[str]:
    """The ids of the nodes whose outputs a template references.

    Raises ``Invalid`` if a reference in the template is malformed.
    """
    nodes: set[str] = set()
    for _, text in iter_refs(template):
        ref = _parse(text)
        if ref.node is not None:
            nodes.add(ref.node)
    return nodes


def _walk(value: Any, path: tuple[str, ...]) -> Any:
    for segment in path:
        if isinstance(value, Mapping):
            value = value.get(segment)
        elif isinstance(value, list) and segment.isascii() and segment.isdigit():
            index = int(segment)
            value = value[index] if index < len(value) else None
        else:
            return None
    return value


def resolve_ref(ref: Ref, context: RunContext, outputs: Mapping[str, Any]) -> Any:
    """The value a parsed reference points at, or ``None`` if the path leads nowhere."""
    if ref.root == "input":
        base = context.input
    elif ref.root == "config":
        base = context.config
    else:
        assert ref.node is not None
        base = outputs.get(ref.node)
    return _walk(base, ref.path)


def resolve(template: Any, context: RunContext, outputs: Mapping[str, Any]) -> Any:
    """Resolve every reference in a JSON template.

    ``outputs`` maps node ids to their outputs; a referenced node missing from it
    resolves to ``None``, as does any path that leads nowhere. Literal values are
    returned as they are; resolved values are shared, not copied.
    """
    if isinstance(template, str):
        return resolve_ref(parse_ref(template), context, outputs) if is_ref(template) else template
    if isinstance(template, Mapping):
        return {key: resolve(value, context, outputs) for key, value in template.items()}
    if isinstance(template, list | tuple):
        return [resolve(value, context, outputs) for value in template]
    return template
