"""The event's statement as it is sent (composer_ops/repo/writes.py): PostgreSQL's own
``$n`` placeholders, made once per shape, and its parameters in their order."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops.repo import writes
from composer_ops.repo.writes import _positional, statement

RUN = "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
AT = datetime(2026, 12, 5, tzinfo=UTC)


def test_positional_numbers_each_name_once_in_order_of_first_use() -> None:
    text, names = _positional("SELECT %(b)s::int, %(a)s::text, %(b)s::int, format('%%s', %(c)s::text)")
    assert text == "SELECT $1::int, $2::text, $1::int, format('%s', $3::text)"
    assert names == ("b", "a", "c")


def test_positional_refuses_a_lone_percent() -> None:
    with pytest.raises(ValueError, match="lone %"):
        _positional("SELECT 5 % 2, %(a)s")


@given(st.lists(st.sampled_from(["a", "b1", "c_2", "d"]), min_size=1, max_size=12))
def test_positional_maps_every_placeholder_to_its_name(uses: list[str]) -> None:
    text, names = _positional(" ".join(f"%({u})s" for u in uses))
    assert [names[int(n) - 1] for n in re.findall(r"\$(\d+)", text)] == uses


def _completion_creating(n: int) -> dict[str, object]:
    """A completion's document that creates ``n`` tasks (a fan-out's first completion)."""
    tasks = [{"id": f"t{k}", "node": f"n{k}", "type": "TASK", "queue": "default", "state": "PENDING",
              "input": {"k": k}} for k in range(n)]
    return {"at": AT, "run_id": RUN, "request": "r1",
            "done": [{"t": "root", "n": "root", "a": 0, "output": {"ok": True}}],
            "tasks": tasks, "outbox": [{"q": "default", "t": f"t{k}", "n": "t"} for k in range(n)]}


@pytest.mark.parametrize("n", [1, 10, 40])
def test_statement_values_follow_the_placeholders(n: int) -> None:
    doc = _completion_creating(n)
    text, values = statement(doc, "workflow_runs_p202412", "task_instances_p202412")
    numbers = {int(m) for m in re.findall(r"\$(\d+)", text)}
    assert numbers == set(range(1, len(values) + 1))
    assert "%(" not in text and "%%" not in text
    assert RUN in values and "t0" in values and f"n{n - 1}" in values
    again, values_again = statement(doc, "workflow_runs_p202412", "task_instances_p202412")
    assert again is text                                  # one text per shape, made once
    assert [getattr(v, "obj", v) for v in values_again] == [getattr(v, "obj", v) for v in values]


def test_a_refused_run_id_has_no_parameters() -> None:
    text, values = statement({"at": AT, "run_id": "not-a-uuid", "start": {"wf": "w", "version": 1}},
                             "workflow_runs", "task_instances")
    assert values == [] and "'run_id'" in text and "$" not in text


def test_the_text_cache_is_bounded() -> None:
    assert writes._text.cache_info().maxsize == 1024
