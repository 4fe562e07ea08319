"""The groups of a dispatch's outbox rows, as the client computes them for
``composer_enqueue`` (composer_ops/repo/outbox.py, dispatch_groups; sql/R__dispatch.sql)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from composer_ops.repo.outbox import dispatch_groups, groups

rows_st = st.lists(st.fixed_dictionaries({"q": st.sampled_from(["default", "b", "Z", "é", 'a"b', "c\\\\d"]),
                                          "n": st.sampled_from(["t", "t2", "T", ""])}), max_size=30)


def test_one_row_is_one_group() -> None:
    assert groups([{"q": "default", "n": "noop", "r": "x"}]) == (["default"], ["noop"], [1], [1])
    assert dispatch_groups([{"q": "default", "n": "noop", "r": "x"}]) == ('{"default"}', '{"noop"}', "{1}", "{1}")


def test_groups_by_queue_then_name_and_places_by_group_then_place() -> None:
    rows = [{"q": "b", "n": "y"}, {"q": "a", "n": "x"}, {"q": "b", "n": "x"}, {"q": "a", "n": "x"},
            {"q": "b", "n": "y"}]
    assert groups(rows) == (["a", "b", "b"], ["x", "x", "y"], [2, 1, 2], [2, 4, 3, 1, 5])
    assert dispatch_groups(rows) == ('{"a","b","b"}', '{"x","x","y"}', "{2,1,2}", "{2,4,3,1,5}")


def test_no_rows_no_groups() -> None:
    assert groups([]) == ([], [], [], [])
    assert dispatch_groups([]) == ("{}", "{}", "{}", "{}")


@given(rows_st)
def test_every_row_is_in_its_group_once_in_order(rows: list[dict[str, Any]]) -> None:
    queues, names, counts, places = groups(rows)
    assert len(queues) == len(names) == len(counts)
    assert sorted(places) == list(range(1, len(rows) + 1))
    assert sum(counts) == len(rows) and all(c > 0 for c in counts)
    keys = list(zip(queues, names, strict=True))
    assert keys == sorted(set(keys))            # each group once, by queue then task name
    start = 0
    for key, count in zip(keys, counts, strict=True):
        group = places[start:start + count]
        assert group == sorted(group)           # a group's rows in their order
        assert {(rows[p - 1]["q"], rows[p - 1]["n"]) for p in group} == {key}
        start += count
