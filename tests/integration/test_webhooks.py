"""Webhook relay against a local HTTP server: delivery, signature, retries."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from composer_ops import Engine
from composer_ops.engine.webhooks import SIGNATURE_HEADER, RelayPolicy, verify

SECRET = "s3cret-for-tests"


class Hook:
    def __init__(self) -> None:
        self.received: list[tuple[str, bytes, str | None]] = []
        self.fail_first = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.received.append((self.path, body, self.headers.get(SIGNATURE_HEADER)))
                failing = self.path == "/always-fails" or (self.path == "/flaky" and hook.fail_first > 0)
                if self.path == "/flaky" and hook.fail_first > 0:
                    hook.fail_first -= 1
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(b) for p, b, _ in self.received if p == path]


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.server.shutdown()
    h.server.server_close()


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
    [(path, body, signature)] = hook.received
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
