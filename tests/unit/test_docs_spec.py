"""docs/spec.md, the reference of the definition format, holds to the code: every JSON
and YAML block in it is a whole definition that ``parse_spec`` accepts, or, when the
line after it reads ``Refused: `message```, one it refuses with exactly that message.
The rules the reference states in prose (keys compared as text, the backoff's first
wait, the cron dialect) are checked against the functions that apply them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from composer_ops.cli.run_cmds import load_definition
from composer_ops.core.flow import key_text
from composer_ops.core.retry import RetryPolicy, retry_decision
from composer_ops.core.schedules import check_cron
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Invalid

ROOT = Path(__file__).resolve().parents[2]
SPEC_MD = ROOT / "docs" / "spec.md"
_REFUSED = re.compile(r"Refused: `(.+)`$")


def _blocks() -> list[tuple[int, str, str, str | None]]:
    """(line, language, text, expected error or None) of each json/yaml block."""
    text = SPEC_MD.read_text()
    lines = text.splitlines()
    found = []
    for token in MarkdownIt("commonmark").parse(text):
        if token.type != "fence" or token.info.strip() not in ("json", "yaml"):
            continue
        assert token.map is not None
        end = token.map[1]
        after = next((line for line in lines[end:] if line.strip()), "")
        match = _REFUSED.match(after.strip())
        found.append((token.map[0] + 1, token.info.strip(), token.content, match.group(1) if match else None))
    return found


BLOCKS = _blocks()


def _load(lang: str, text: str, tmp_path: Path) -> Any:
    if lang == "json":
        return json.loads(text)
    path = tmp_path / "spec.yaml"       # through the CLI's own loader
    path.write_text(text)
    return load_definition(str(path))


def test_the_reference_has_examples_of_both_kinds() -> None:
    assert len([b for b in BLOCKS if b[3] is None]) >= 10
    assert len([b for b in BLOCKS if b[3] is not None]) >= 5
    assert any(b[1] == "yaml" for b in BLOCKS)


@pytest.mark.parametrize(("line", "lang", "text", "refused"), BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_each_example_is_a_whole_spec_that_validates_as_documented(
        line: int, lang: str, text: str, refused: str | None, tmp_path: Path) -> None:
    doc = _load(lang, text, tmp_path)
    assert isinstance(doc, dict) and "id" in doc and "nodes" in doc, f"docs/spec.md:{line} is no whole definition"
    if refused is None:
        spec = parse_spec(doc)
        assert parse_spec(spec.to_json()) == spec
    else:
        with pytest.raises(Invalid) as caught:
            parse_spec(doc)
        assert str(caught.value) == refused


def test_keys_are_compared_as_text() -> None:
    # "42 and "42" are the same key, as are true and "true"; nowhere is "null"
    assert key_text(42) == key_text("42") == "42"
    assert key_text(True) == key_text("true")
    assert key_text(None) == key_text("null")
    assert key_text({"b": 1, "a": 2}) == '{"a":2,"b":1}'


def test_the_backoff_worked_example() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=2, multiplier=2)
    assert [retry_decision(policy, attempt, True) for attempt in range(4)] == [2, 4, 8, None]
    capped = RetryPolicy(max_attempts=10, initial_backoff_s=1, multiplier=2, max_backoff_s=60)
    assert retry_decision(capped, 7, True) == 60
    assert retry_decision(policy, 0, False) is None


@pytest.mark.parametrize("expr", ["0 9 * * MON-FRI", "5 4 * * sun", "0 0 * JAN-MAR *", "*/15 * * * *",
                                  "0 9-17 * * 1-5", "0 0 1-31/2 * *", "0,30 * * * *", "0 0 * * 7", "0 0 L * *",
                                  "0 0 LW * *", "0 0 * * 5L", "0 0 * * 1#2", "0 0 1 * MON"])
def test_cron_accepted(expr: str) -> None:
    assert check_cron(expr) == expr


@pytest.mark.parametrize("expr", ["@hourly", "@daily", "0 0 * * * *", "? * * * *", "H * * * *", "0 0 15W * *",
                                  "61 * * * *", "0 0 30 2 *"])
def test_cron_refused(expr: str) -> None:
    with pytest.raises(Invalid):
        check_cron(expr)


def test_cron_error_as_documented() -> None:
    with pytest.raises(Invalid, match=re.escape("cron '61 * * * *': field 1 (minute) '61' is not valid")):
        check_cron("61 * * * *")


def test_cron_day_of_month_or_day_of_week() -> None:
    from datetime import UTC, datetime

    from composer_ops.core.schedules import check_zone, next_slot

    utc = check_zone("UTC")
    # "the 1st and every Monday": 2026-12-07 and 2026-12-28 are Mondays, 2027-01-01 a Friday
    assert next_slot("0 0 1 * MON", utc, datetime(2026, 12, 7, tzinfo=UTC)) == datetime(2026, 12, 14, tzinfo=UTC)
    assert next_slot("0 0 1 * MON", utc, datetime(2026, 12, 28, tzinfo=UTC)) == datetime(2027, 1, 1, tzinfo=UTC)
