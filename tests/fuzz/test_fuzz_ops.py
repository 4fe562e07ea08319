"""Notebook parameters under hostile values: a run_id that is not a UUIDv7 is refused
before any query (the investigation entry point never even connects), and every
``-p KEY VALUE`` of every report converts to the declared type or is Invalid."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops import ops
from composer_ops.errors import Invalid
from composer_ops.ops import investigation
from composer_ops.reports import available, declared_parameters, resolve_parameters
from tests.fuzz.conftest import examples
from tests.fuzz.strategies import json_values, run_id_like, texts, tried

NOWHERE = "postgresql://nobody@/nowhere?host=/nonexistent-socket-dir&connect_timeout=1"


@pytest.fixture(scope="module")
def no_database() -> Iterator[list[Any]]:
    """Any attempt to open a connection is recorded (and fails)."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        raise AssertionError("a query was attempted before the run_id was validated")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(investigation, "connection", refuse)
        yield attempts


def _is_uuid7(text: Any) -> bool:
    try:
        return isinstance(text, str) and uuid.UUID(text.strip()).version == 7
    except ValueError:
        return False


@examples(150)
@given(st.one_of(run_id_like, json_values))
def test_run_id_parameter_is_refused_before_any_query(no_database: list[Any], value: Any) -> None:
    tried("notebooks: run_investigation run_id")
    if _is_uuid7(value):
        assert ops.validate_run_id(value) == str(uuid.UUID(value.strip()))
        return
    with pytest.raises(Invalid) as caught:
        ops.run_story(NOWHERE, value)
    assert "\n" not in str(caught.value) and "run_id" in str(caught.value)
    assert no_database == []


REPORTS = available()
PARAMETERS = {name: declared_parameters(name) for name in REPORTS}


@examples(120)
@given(st.sampled_from(REPORTS), st.data(), st.one_of(texts, st.integers().map(str), st.floats().map(str),
                                                     st.sampled_from(["true", "no", "None", "null", "1e999", "-0"])))
def test_report_parameters_convert_or_are_refused(name: str, data: st.DataObject, text: str) -> None:
    tried("notebooks: -p KEY VALUE")
    declared = PARAMETERS[name]
    key = data.draw(st.one_of(st.sampled_from(sorted(declared)), texts))
    try:
        values = resolve_parameters([name], [(key, text)])
    except Invalid as exc:
        assert "\n" not in str(exc)
        return
    assert key in declared and set(values[name]) == {key}


def _breaks(text: str) -> bool:
    return any(c in text for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def test_a_key_with_a_line_break() -> None:
    with pytest.raises(Invalid) as caught:
        resolve_parameters([REPORTS[0]], [("a\nb", "1")])
    assert "\n" not in str(caught.value)


def test_a_parameter_nested_deeper_than_the_parser_can_go() -> None:
    with pytest.raises(Invalid):
        resolve_parameters(["run_investigation"], [("run_id", "[" * 5000 + "]" * 5000)])
