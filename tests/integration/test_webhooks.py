"""Webhook relay against a local HTTP server: delivery, signature, retries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from composer_ops import Engine
from composer_ops.engine.webhooks import SIGNATURE_HEADER, RelayPolicy, verify
from tests.receiver import Receiver

SECRET = "s3cret-for-tests"


class Hook(Receiver):
    """``/ok`` answers 204, ``/always-fails`` 500, ``/flaky`` 500 for its first ``fail_first`` posts."""

    def __init__(self) -> None:
        self.fail_first = 0
        super().__init__(self._respond)

    def _respond(self, request: BaseHTTPRequestHandler, body: bytes) -> int:
        failing = request.path == "/always-fails" or (request.path == "/flaky" and self.fail_first > 0)
        if request.path == "/flaky" and self.fail_first > 0:
            self.fail_first -= 1
        return 500 if failing else 204

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(b) for p, b, _ in self.requests if p == path]


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.close()


def _deploy_waiting(engine: Engine, wf: str, url: str) -> None:
    engine.deploy({"id": wf, "webhook_url": url, "nodes": [{"id": "tick", "type": "WAIT", "duration_s": 0}]})


def test_webhook_delivered_once_with_a_valid_signature(db_url: str, hook: Hook) -> None:
    with Engine.connect(db_url, pool_size=3) as engine:
        _deploy_waiting(engine, "hooked", hook.url("/ok"))
        run_id = engine.start("hooked", input={"k": 1})
        coord = engine.coordinator(webhook_secret=SECRET)
        for _ in range(3):
            coord.run_once()
        assert engine.get_run(run_id).status == "SUCCEEDED"
    [(path, body, headers)] = hook.requests
    signature = headers.get(SIGNATURE_HEADER)
    payload = json.loads(body)
    assert (path, payload["run_id"], payload["status"]) == ("/ok", run_id, "SUCCEEDED")
    assert signature is not None and verify(SECRET, body, signature)
    assert not verify("wrong", body, signature)
    assert not verify(SECRET, body + b" ", signature)
    assert not verify(SECRET, body, signature, now=int(signature.split(",")[0][2:]) + 3600)  # replayed later


def test_failing_endpoint_is_retried_and_does_not_block_other_runs(db_url: str, hook: Hook) -> None:
    hook.fail_first = 2
    with Engine.connect(db_url, pool_size=3) as engine:
        _deploy_waiting(engine, "flaky", hook.url("/flaky"))
        _deploy_waiting(engine, "broken", hook.url("/always-fails"))
        _deploy_waiting(engine, "fine", hook.url("/ok"))
        flaky, broken, fine = (engine.start(wf) for wf in ("flaky", "broken", "fine"))
        coord = engine.coordinator(relay=RelayPolicy(initial_backoff_s=0.0, max_backoff_s=0.0, max_attempts=4))
        stats = [coord.run_once() for _ in range(6)]
        with engine.pool.connection() as conn:
            rows = dict((r[0], r[1:]) for r in conn.execute(
                "SELECT run_id, attempts, delivered_at IS NOT NULL, gave_up_at IS NOT NULL FROM webhook_deliveries"))
    assert [b["run_id"] for b in hook.bodies("/ok")] == [fine]            # once, on the first pass
    assert len(hook.bodies("/flaky")) == 3                               # two 500s, then delivered
    assert rows[flaky] == (3, True, False)
    assert rows[broken] == (4, False, True)                              # gave up after max_attempts
    assert len(hook.bodies("/always-fails")) == 4
    assert sum(s.webhooks_delivered for s in stats) == 2
