"""Hypothesis strategies for hostile input: JSON that PostgreSQL or Python cannot
take (NUL, lone surrogates, non-finite numbers, huge integers, deep nesting, keys
that are not strings, values that are not JSON), run IDs, names and spec mutations;
and the tally of cases each suite tried, printed when the session ends."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from hypothesis import strategies as st

CASES: Counter[str] = Counter()


def tried(suite: str, n: int = 1) -> None:
    """Count one more case of ``suite`` (tests/fuzz/conftest.py prints the tally)."""
    CASES[suite] += n


#: Text as users send it: any code point but surrogates, NUL included.
texts = st.text(st.characters(codec="utf-8"), max_size=20)      # utf-8: no surrogates

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), texts)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)

NASTY_TEXT = ["\x00", "a\x00b", "\ud800", "x\udcff", "\udfff\ud800", "caf\udce9"]
HUGE_INTS = st.integers(4300, 4400).map(lambda n: 10**n)            # more digits than Python will print
nasty_scalars = st.one_of(
    st.sampled_from(NASTY_TEXT),
    texts.map(lambda t: t + "\x00"),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    HUGE_INTS,
    st.binary(min_size=1, max_size=8),
    st.sets(st.integers(), min_size=1, max_size=3),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
    st.builds(object),
    st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none()), json_scalars, min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(NASTY_TEXT), json_scalars, min_size=1, max_size=2),
)


def nest(depth: int, leaf: Any = 0) -> Any:
    """``depth`` lists and objects around ``leaf``, built without recursion."""
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _embed(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Put a bad value somewhere inside otherwise good JSON."""
    in_list = st.tuples(inner, st.lists(json_values, max_size=2), st.integers(0, 2)).map(
        lambda t: [*t[1][:t[2]], t[0], *t[1][t[2]:]])
    in_dict = st.tuples(texts.filter(lambda k: "\x00" not in k), inner, st.dictionaries(texts, json_values, max_size=2)
                        ).map(lambda t: {**t[2], t[0]: t[1]})
    return st.one_of(in_list, in_dict)


bad_json = st.one_of(
    st.recursive(nasty_scalars, _embed, max_leaves=6),
    st.integers(65, 3000).map(nest),                                 # deeper than the limit of 64
    st.integers(65, 200).map(lambda d: nest(d, "\x00")),
)

#: Strings that are nearly run IDs, and plain garbage.
UUID7 = "0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f"
run_id_like = st.one_of(
    texts,
    st.text("0123456789abcdefABCDEF-", min_size=30, max_size=40),
    st.tuples(st.integers(0, 35), st.sampled_from("0123456789abcdefgABCDEF-x \x00\u00e9")).map(
        lambda t: UUID7[:t[0]] + t[1] + UUID7[t[0] + 1:]),
    st.sampled_from([UUID7.upper(), UUID7.replace("-7", "-4"), UUID7.replace("-9f", "-cf"), f" {UUID7}",
                     f"{{{UUID7}}}", UUID7.replace("-", ""), UUID7 + "0", ""]),
)

#: A valid spec the mutations start from.
BASE_SPEC: dict[str, Any] = {
    "id": "fuzzed", "name": "fuzzed", "webhook_url": "https://example.com/hook", "config": {"x": 1},
    "nodes": [
        {"id": "a", "type": "TASK", "task": "t", "queue": "q", "input": {"v": "$.input.v", "c": "$.config.x"},
         "retry": {"max_attempts": 3, "initial_backoff_s": 1, "multiplier": 2, "max_backoff_s": 10}, "lease_s": 30},
        {"id": "s", "type": "SWITCH", "depends_on": ["a"], "expression": "$.nodes.a.output.k",
         "cases": {"x": ["b"]}, "default": ["w"]},
        {"id": "b", "type": "TASK", "task": "t", "depends_on": ["s"]},
        {"id": "w", "type": "WAIT", "depends_on": ["s"], "duration_s": 1},
        {"id": "e", "type": "WAIT_FOR_SIGNAL", "depends_on": ["b", "w"], "signal": "go", "timeout_s": 5,
         "on_timeout": "continue"},
    ],
}
SPEC_KEYS = ["id", "name", "webhook_url", "config", "nodes", "description", "type", "task", "queue", "input", "retry",
             "lease_s", "depends_on", "optional", "expression", "cases", "default", "duration_s", "until", "signal",
             "timeout_s", "on_timeout", "max_attempts", "initial_backoff_s", "multiplier", "max_backoff_s",
             "event", "WAIT_FOR_EVENT"]   # the aliases of "signal" and WAIT_FOR_SIGNAL
_SPECIAL = st.sampled_from(
    ["$.", "$.nodes", "$.nodes.zz.output", "$.input..x", "$.nope", "TASK", "SWITCH", "WAIT", "WAIT_FOR_SIGNAL",
     "a", "s", "ftp://x/", "http://", "http://h:99999/", -1, 0, 1e308, 10**30, [], {}, ["a", "a"], ["zz"]])
mutant_values = st.one_of(json_values, nasty_scalars, _SPECIAL)
#: Without integers too long to print: core/spec.py's messages cannot show them yet
#: (tests/fuzz/test_fuzz_core.py::test_spec_with_an_unprintable_integer).
printable_mutant_values = st.one_of(json_values, nasty_scalars.filter(lambda v: not _huge(v)), _SPECIAL)


def _huge(value: Any) -> bool:
    return isinstance(value, int) and value.bit_length() > 14000


@st.composite
def mutated_specs(draw: st.DrawFn, *, huge_ints: bool = True) -> Any:
    """BASE_SPEC with 1..4 random edits: set, delete or replace a key anywhere."""
    values = mutant_values if huge_ints else printable_mutant_values
    spec: Any = copy.deepcopy(BASE_SPEC)
    for _ in range(draw(st.integers(1, 4))):
        containers: list[Any] = [spec]
        stack = [spec]
        while stack:
            item = stack.pop()
            children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else []
            for child in children:
                if isinstance(child, dict | list):
                    containers.append(child)
                    stack.append(child)
        target = draw(st.sampled_from(containers))
        action = draw(st.sampled_from(["set", "delete", "replace"]))
        if isinstance(target, dict):
            key = draw(st.one_of(st.sampled_from(SPEC_KEYS), texts))
            if action == "delete" and target:
                target.pop(draw(st.sampled_from(sorted(target, key=str))), None)
            else:
                # a copy: a later edit must not change the strategy's own constants (_SPECIAL's lists)
                target[key] = copy.deepcopy(draw(values))
        elif isinstance(target, list) and target:
            index = draw(st.integers(0, len(target) - 1))
            if action == "delete":
                target.pop(index)
            else:
                target[index] = copy.deepcopy(draw(values))
    if draw(st.booleans()) and draw(st.integers(0, 9)) == 0:
        spec = draw(values)                                   # not even an object
    return spec
