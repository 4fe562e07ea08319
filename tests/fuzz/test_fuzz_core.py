"""The pure core under hostile input: the spec validator, ``$.`` references, run IDs
and the JSON check. Each case either passes validation (and then behaves) or ends
in one :class:`Invalid` line; nothing else may escape."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops.core.expressions import ROOTS, parse_ref, resolve
from composer_ops.core.model import RunContext
from composer_ops.core.runids import month_bounds, month_of, uuid7_timestamp, validate_run_id
from composer_ops.core.spec import parse_spec, spec_from_json
from composer_ops.engine.ids import uuid7_at
from composer_ops.engine.jsonvalues import MAX_DEPTH, check_json, parse_json_text
from composer_ops.errors import Invalid
from tests.fuzz.conftest import examples
from tests.fuzz.strategies import BASE_SPEC, bad_json, json_values, mutated_specs, run_id_like, texts, tried

T = TypeVar("T")


def one_line(exc: Exception) -> str:
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    return text


@dataclass(frozen=True)
class Refused:
    """A call ended in :class:`Invalid`, with this one line."""

    line: str


def outcome(call: Callable[[], T]) -> T | Refused:
    """What ``call`` returns, or :class:`Refused` when it raises Invalid in one line;
    anything else it raises (or an Invalid of several lines) fails the test."""
    try:
        return call()
    except Invalid as exc:
        return Refused(one_line(exc))


@examples(300)
@given(mutated_specs(huge_ints=False))
def test_spec_validator(doc: Any) -> None:
    tried("spec validator (parse_spec)")
    spec = outcome(lambda: parse_spec(doc))
    if isinstance(spec, Refused):
        return
    assert parse_spec(spec.to_json()) == spec                       # the stored form means the same
    assert spec_from_json(json.dumps(spec.to_json())) == spec


def test_spec_with_an_unprintable_integer() -> None:
    with pytest.raises(Invalid):
        parse_spec({**BASE_SPEC, "id": 10**5000})


SEGMENTS = st.sampled_from(["input", "config", "nodes", "output", "a", "0", "", "x.y", "-", "é"])


@examples(200)
@given(st.one_of(texts, texts.map(lambda t: "$." + t),
                 st.lists(SEGMENTS, max_size=6).map(lambda p: "$." + ".".join(p))))
def test_reference_parser(text: str) -> None:
    tried("expression references (parse_ref)")
    ref = outcome(lambda: parse_ref(text))
    if isinstance(ref, Refused):
        return
    assert text.startswith("$.") and ref.root in ROOTS and ref.text == text
    assert ".".join((ref.root, *([ref.node, "output"] if ref.node else []), *ref.path)) == text[2:]


@st.composite
def documents_with_a_path(draw: st.DrawFn) -> tuple[Any, list[str], Any]:
    doc = draw(json_values)
    path: list[str] = []
    value = doc
    while isinstance(value, dict | list) and value and draw(st.booleans()):
        if isinstance(value, dict):
            keys = [k for k in value if k and "." not in k and not (k.isascii() and k.isdigit())]
            if not keys:
                break
            key = draw(st.sampled_from(sorted(keys)))
            path.append(key)
            value = value[key]
        else:
            index = draw(st.integers(0, len(value) - 1))
            path.append(str(index))
            value = value[index]
    return doc, path, value


@examples(150)
@given(documents_with_a_path(), st.dictionaries(st.sampled_from(["a", "b"]), json_values, max_size=2),
       st.lists(st.one_of(texts, texts.map(lambda t: "$." + t)), max_size=4))
def test_resolver(found: tuple[Any, list[str], Any], outputs: dict[str, Any], junk: list[str]) -> None:
    tried("expression resolver (resolve)")
    doc, path, value = found
    context = RunContext(input=doc, config={"k": doc})
    ref = "$.input" + "".join(f".{p}" for p in path)
    assert resolve({"v": ref, "lit": "x$.y", "n": [1, None]}, context, outputs) == {"v": value, "lit": "x$.y",
                                                                                   "n": [1, None]}
    assert resolve("$.config.k" + "".join(f".{p}" for p in path), context, outputs) == value
    outcome(lambda: resolve({"junk": junk}, context, outputs))    # any reference resolves, to None if need be


@examples(200)
@given(run_id_like, st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=st.just(UTC)))
def test_run_id_validation(run_id: str, now: datetime) -> None:
    tried("run ID validation")
    valid = outcome(lambda: validate_run_id(run_id, now))
    if isinstance(valid, Refused):
        return
    assert valid == run_id
    assert now - timedelta(hours=1) <= uuid7_timestamp(run_id) <= now + timedelta(minutes=5)


@examples(150)
@given(st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9000, 1, 1), timezones=st.just(UTC)))
def test_minted_run_ids_round_trip(at: datetime) -> None:
    tried("run ID round trip")
    run_id = uuid7_at(at)
    assert uuid7_timestamp(run_id) == at.replace(microsecond=at.microsecond // 1000 * 1000)
    low, high = month_bounds(month_of(run_id))
    assert low <= run_id < high
    assert validate_run_id(run_id, at) and validate_run_id(run_id.upper().lower(), at)


@examples(300)
@given(bad_json)
def test_bad_json_is_refused(value: Any) -> None:
    tried("JSON check: hostile values")
    checked = outcome(lambda: check_json(value, "input"))
    assert isinstance(checked, Refused), f"accepted {value!r:.200}"
    assert checked.line.startswith("input ")


@examples(150)
@given(json_values)
def test_good_json_is_accepted(value: Any) -> None:
    tried("JSON check: good values")
    checked = outcome(lambda: check_json(value, "input"))
    if isinstance(checked, Refused):        # only NUL characters may be refused
        assert "NUL" in checked.line
        return
    assert checked is value
    json.dumps(value, allow_nan=False)


@examples(150)
@given(st.one_of(st.binary(max_size=64), texts, st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
                 st.integers(1, 5000).map(lambda n: '{"a":' * n + "1" + "}" * n)))
def test_json_text_is_parsed_or_refused(text: bytes | str) -> None:
    tried("JSON text (parse_json_text)")
    value = outcome(lambda: parse_json_text(text, "--payload"))
    if isinstance(value, Refused):
        return
    check_json(value, "--payload")
    assert not isinstance(value, dict | list) or _depth(value) <= MAX_DEPTH + 1


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, dict | list) and value:
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
        depth += 1
    return depth


_flow_numbers = st.one_of(st.integers(-10, 10**7), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                          st.none(), texts)
_flow_keys = st.one_of(st.sampled_from(["api", "$.input.c", "$.nodes.up.output.k", "$.nodes.down.output",
                                        "$.nope", "$.", "a b", ""]), texts)
_flow_docs = st.fixed_dictionaries({}, optional={
    "priority": _flow_numbers,
    "timeouts": st.one_of(_flow_numbers, st.dictionaries(
        st.sampled_from(["schedule_to_start_s", "start_to_close_s", "other"]), _flow_numbers, max_size=3)),
    "concurrency": st.one_of(_flow_numbers, st.dictionaries(
        st.sampled_from(["key", "limit", "strategy"]), st.one_of(_flow_keys, _flow_numbers), max_size=3)),
    "rate_limit": st.one_of(_flow_numbers, st.dictionaries(
        st.sampled_from(["key", "per_s", "burst", "x"]), st.one_of(_flow_keys, _flow_numbers), max_size=4)),
})


@examples(300)
@given(_flow_docs)
def test_flow_control_is_refused_in_one_line_or_round_trips(flow: dict[str, Any]) -> None:
    tried("flow control (parse_spec)")
    doc = {"id": "wf", "nodes": [{"id": "up", "type": "TASK", "task": "t"},
                                 {"id": "down", "type": "TASK", "task": "t", "depends_on": ["up"], **flow}]}
    spec = outcome(lambda: parse_spec(doc))
    if isinstance(spec, Refused):
        assert spec.line.startswith(('node "down": ', 'node "up": ')), spec.line
        return
    parsed = spec.nodes["down"].flow
    assert -32768 <= parsed.priority <= 32767
    if parsed.concurrency is not None:
        assert parsed.concurrency.limit >= 1 and parsed.concurrency.key.startswith("$.")
    if parsed.rate_limit is not None:
        assert parsed.rate_limit.per_s > 0 and parsed.rate_limit.burst >= 1
    for value in (parsed.timeouts.schedule_to_start_s, parsed.timeouts.start_to_close_s):
        assert value is None or value > 0
    assert parse_spec(spec.to_json()) == spec
