"""Validation of client JSON (run input, signal payload, handler output).

PostgreSQL's jsonb refuses NUL characters and non-finite numbers, and deeply nested
documents blow Python's recursion limit; all are reported here, before any write,
as one ``Invalid`` line naming the document and the position.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from composer_ops.core.jsonsize import MAX_BYTES as MAX_BYTES  # the one limit, named here for its callers
from composer_ops.errors import Invalid

MAX_DEPTH = 64
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def check_json(value: Any, what: str) -> Any:
    """Return ``value`` if it is a storable JSON document, else raise Invalid."""
    _walk(value, what, "$", 0, [0])
    try:
        # Counted as stored: UTF-8, not with every non-ASCII character as a 6-byte escape.
        size = len(json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError) as exc:
        raise Invalid(f"{what} is not JSON: {exc}") from None
    if size > MAX_BYTES:
        raise Invalid(f"{what} is {size} bytes of JSON; the limit is {MAX_BYTES}")
    return value


def _walk(value: Any, what: str, path: str, depth: int, size: list[int]) -> None:
    # ``size`` accumulates a lower bound of the serialised length, so a document that
    # shares one subtree many times (a YAML alias bomb: a few bytes of YAML, gigabytes
    # of JSON) is refused after MAX_BYTES worth of walking, not after serialising it all.
    if depth > MAX_DEPTH:
        raise Invalid(f"{what} nests deeper than {MAX_DEPTH} levels at {path}")
    size[0] += 4 if isinstance(value, str) else 1
    if size[0] > MAX_BYTES:
        raise Invalid(f"{what} is more than {MAX_BYTES} bytes of JSON (at {path}); the limit is {MAX_BYTES}")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if value.bit_length() > 14_000:      # near Python's limit on printing integers: ask it
            try:
                str(value)
            except ValueError:
                raise Invalid(f"{what} has an integer of more than {sys.get_int_max_str_digits()} digits "
                              f"at {path}") from None
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(f"{what} has a non-finite number at {path}")
        return
    if isinstance(value, str):
        size[0] += len(value)
        if size[0] > MAX_BYTES:      # named here, not at the value after it
            raise Invalid(f"{what} is more than {MAX_BYTES} bytes of JSON (at {path}); the limit is {MAX_BYTES}")
        _check_text(value, what, path)
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _walk(item, what, f"{path}[{i}]", depth + 1, size)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise Invalid(f"{what} has a non-string key {_short(key)} at {path}")
            size[0] += len(key) + 3
            _check_text(key, what, f"{path} (key {_short(key)})")
            _walk(item, what, _child(path, key), depth + 1, size)
        return
    raise Invalid(f"{what} is not JSON: {type(value).__name__} at {path}")


def _child(path: str, key: str) -> str:
    """``$.a`` for plain keys, ``$["a b\\n"]`` (escaped, shortened) for others: an error
    message stays one line whatever the keys hold."""
    return f"{path}.{key}" if _PLAIN_KEY.fullmatch(key) else f"{path}[{_short(key)}]"


def _short(value: Any) -> str:
    if isinstance(value, str):
        text = json.dumps(value)
    else:
        try:
            text = repr(value)
        except ValueError:               # an integer too long to print
            text = type(value).__name__
    return text if len(text) <= 42 else text[:40] + "..."


def _check_text(text: str, what: str, path: str) -> None:
    if "\x00" in text:
        raise Invalid(f"{what} has a NUL character at {path}; PostgreSQL cannot store it")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid(f"{what} has text that is not valid UTF-8 (a lone surrogate) at {path}") from None


def storable_text(text: str) -> str:
    """``text`` as PostgreSQL can store it in JSON: a NUL written as ``\\x00`` and a
    lone surrogate as its backslash escape (``\\udc80``), the rest as it is. For texts the engine
    records whatever they hold (a handler's error), where :func:`check_json` refuses."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def parse_json_text(text: str | bytes, what: str) -> Any:
    """Decode JSON text, naming the line and column of a syntax error."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Invalid(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Invalid(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise Invalid(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    return check_json(value, what)
