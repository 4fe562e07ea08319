"""The 8 MiB limit of client JSON counts UTF-8 bytes as stored, and names the value
that passed it (engine/jsonvalues.py)."""

from __future__ import annotations

import pytest

from composer_ops.engine.jsonvalues import MAX_BYTES, check_json, storable_text
from composer_ops.errors import Invalid


def test_non_ascii_text_counts_its_utf8_bytes_not_its_escapes() -> None:
    doc = {"u": "é" * 1_500_000}              # 3 MB of UTF-8, 9 MB as \\u00e9 escapes
    assert check_json(doc, "input") is doc


def test_the_limit_names_the_value_that_passed_it() -> None:
    with pytest.raises(Invalid, match=r"input is more than \d+ bytes of JSON \(at \$\.big\)"):
        check_json({"big": "x" * (MAX_BYTES + 1), "small": "a"}, "input")


@pytest.mark.parametrize(("text", "stored"), [("a\x00b", "a\\x00b"), ("s\udc80t", "s\\udc80t"), ("é ok", "é ok")])
def test_storable_text_escapes_what_postgresql_refuses(text: str, stored: str) -> None:
    out = storable_text(text)
    assert out == stored and "\x00" not in out
    out.encode("utf-8")            # a lone surrogate would raise here
