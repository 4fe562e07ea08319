"""Engine.deploy/start/signal/cancel/get_run under hostile input, on a real database:
each refused case is one ComposerError line and leaves every table as it was; each
accepted case stores exactly what was sent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops import ComposerError, Engine, Invalid
from composer_ops.testing.servers import Server
from tests.fuzz.conftest import examples
from tests.fuzz.strategies import BASE_SPEC, bad_json, json_values, mutated_specs, nest, run_id_like, texts, tried

TABLES = ("workflow_definitions", "workflow_runs", "task_instances", "workflow_events", "task_outbox",
          "webhook_deliveries")
WAITING = {"id": "fz", "nodes": [{"id": "ask", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
                                 {"id": "ask2", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["ask"]}]}


class Fixture:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = Engine.connect(url, pool_size=2)
        self.engine.deploy(WAITING)
        self.run_id = self.engine.start("fz")            # waits for "go": signals to it are accepted
        self.conn = psycopg.connect(url, autocommit=True)

    def counts(self) -> tuple[int, ...]:
        query = " UNION ALL ".join(f"SELECT count(*) FROM {t}" for t in TABLES)
        return tuple(int(r[0]) for r in self.conn.execute(query.encode()))

    def refused(self, call: Any) -> ComposerError:
        """``call`` must raise a one-line ComposerError and write nothing."""
        before = self.counts()
        with pytest.raises(ComposerError) as caught:
            call()
        text = str(caught.value)
        assert text and "\n" not in text, repr(text)
        assert self.counts() == before
        return caught.value


@pytest.fixture(scope="module")
def fx(server: Server, template_db: str) -> Iterator[Fixture]:
    with server.database(template=template_db) as url:
        f = Fixture(url)
        yield f
        f.conn.close()
        f.engine.close()


@examples(100)
@given(bad_json, st.sampled_from(["start", "signal"]))
def test_hostile_inputs_and_payloads_are_refused(fx: Fixture, value: Any, via: str) -> None:
    tried(f"engine: hostile JSON via {via}")
    if via == "start":
        fx.refused(lambda: fx.engine.start("fz", input=value))
    else:
        fx.refused(lambda: fx.engine.signal(fx.run_id, "go", value))


def test_huge_and_bomb_documents_are_refused_quickly(fx: Fixture) -> None:
    """Bigger than the 8 MiB limit; and a tiny document sharing one list 10^8 times
    (what a YAML alias bomb loads into), which must not be walked to the end."""
    layer: Any = ["x"] * 10
    for _ in range(7):
        layer = [layer] * 10
    # Measured in this process's CPU time, which other load on the machine does not
    # inflate: walked to the end, the bomb's 10^8 leaves would take minutes of it.
    for label, value in (("huge", "x" * (8 * 1024 * 1024 + 1)), ("bomb", layer), ("deep", nest(10_000))):
        began = time.process_time()
        fx.refused(lambda v=value: fx.engine.start("fz", input=v))
        fx.refused(lambda v=value: fx.engine.deploy({**BASE_SPEC, "config": {"v": v}}))
        assert time.process_time() - began < 20, label
        tried("engine: huge, bomb and deep documents", 2)


@examples(60)
@given(json_values)
def test_any_json_input_is_stored_faithfully_or_refused(fx: Fixture, value: Any) -> None:
    tried("engine: arbitrary JSON input")
    before = fx.counts()
    try:
        run_id = fx.engine.start("fz", input=value)
    except Invalid as exc:
        assert "NUL" in str(exc) and fx.counts() == before
        return
    assert same(fx.engine.get_run(run_id).input, value)


def same(stored: Any, sent: Any) -> bool:
    """Equal as JSON: jsonb keeps a float's decimal text, which may read back as an int
    (1.2791007152497642e+17 -> 127910071524976420) denoting the same double."""
    if isinstance(sent, float) or isinstance(stored, float):
        return isinstance(stored, int | float) and not isinstance(stored, bool) and float(stored) == float(sent)
    if isinstance(sent, list):
        return isinstance(stored, list) and len(stored) == len(sent) and all(map(same, stored, sent))
    if isinstance(sent, dict):
        return isinstance(stored, dict) and stored.keys() == sent.keys() and all(same(stored[k], sent[k]) for k in sent)
    return bool(stored == sent) and type(stored) is type(sent)


@examples(80)
@given(st.one_of(texts, st.sampled_from(["", " ", "fz\x00", "x" * 10_000, "FZ", "fz "])),
       st.one_of(st.none(), st.integers(-(2**40), 2**40), st.booleans(), texts), st.one_of(st.none(), run_id_like))
def test_bad_workflow_ids_versions_and_run_ids(fx: Fixture, workflow: str, version: Any, run_id: str | None) -> None:
    tried("engine: start arguments")
    if workflow == "fz" and version in (None, 1) and run_id is None:
        return                                        # a valid start: not this test's business
    fx.refused(lambda: fx.engine.start(workflow, input={}, version=version, run_id=run_id))


@examples(60)
@given(run_id_like, st.one_of(texts, st.sampled_from(["", "go\x00", "x" * 201, "\udcff"])), json_values)
def test_bad_signal_run_ids_and_names(fx: Fixture, run_id: str, name: str, payload: Any) -> None:
    tried("engine: signal, cancel and get_run arguments")
    fx.refused(lambda: fx.engine.signal(run_id, name, payload))
    fx.refused(lambda: fx.engine.cancel(run_id, reason="fuzz"))
    fx.refused(lambda: fx.engine.get_run(run_id))
    fx.refused(lambda: fx.engine.signal(fx.run_id, name if name != "go" else "stop", payload))


@examples(100)
@given(mutated_specs())
def test_deploy_stores_a_valid_version_or_nothing(fx: Fixture, doc: Any) -> None:
    tried("engine: deploy mutated definitions")
    before = fx.counts()
    try:
        workflow_id, version = fx.engine.deploy(doc)
    except ComposerError as exc:
        assert str(exc) and "\n" not in str(exc) and fx.counts() == before
        return
    assert fx.counts()[0] == before[0] + 1 and fx.counts()[1:] == before[1:]
    assert workflow_id == doc["id"] and version >= 1
