"""Webhook relay under hostile endpoints and bad stored URLs: timeouts, response cap,
no redirects, URL checks at relay time, signature freshness, no secret in logs."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, Invalid
from composer_ops.core.spec import parse_spec
from composer_ops.engine import webhooks
from composer_ops.engine.webhooks import (
    PARALLEL_POSTS,
    SIGNATURE_HEADER,
    RelayPolicy,
    post,
    relay_once,
    sign,
    url_problem,
    verify,
)
from composer_ops.errors import Unavailable
from tests.receiver import Receiver

SECRET = "hunter2-webhook-secret-do-not-log"
FAST = RelayPolicy(connect_timeout_s=0.5, timeout_s=0.3, deadline_s=1.0, initial_backoff_s=0.0, max_backoff_s=0.0)


class Endpoint(Receiver):
    """A local server whose behaviour depends on the path."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.release = threading.Event()
        self.closing = threading.Event()
        super().__init__(self._respond)

    def _respond(self, request: BaseHTTPRequestHandler, body: bytes) -> int | None:
        if request.path == "/held":              # answers once the test releases it
            self.release.wait(30)
            return 200
        if request.path == "/silent":            # accept, answer nothing until the test ends
            self.closing.wait(60)
            return None
        if request.path == "/redirect":
            request.send_response(307)
            request.send_header("Location", "/ok")
            request.end_headers()
            return None
        request.send_response(200)
        request.end_headers()
        if request.path == "/huge":              # an endless body
            chunk = b"x" * 65536
            try:
                for _ in range(2000):
                    request.wfile.write(chunk)
                    self.sent_bytes += len(chunk)
            except OSError:
                pass
        elif request.path == "/drip":            # one byte at a time, each within the read timeout
            try:
                for _ in range(600):             # a minute, unless the client cuts it
                    request.wfile.write(b"x")
                    request.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass
        return None


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.closing.set()
    e.close()


@pytest.mark.parametrize(("url", "reason"), [
    ("ftp://127.0.0.1/x", "only http and https"),
    ("file:///etc/passwd", "only http and https"),
    ("javascript:alert(1)", "only http and https"),
    ("http:///nohost", "no host"),
    ("http://127.0.0.1:99999/", "malformed"),
    ("http://exa mple.com/", "whitespace or control"),
    ("http://example.com/\r\nX-Injected: 1", "whitespace or control"),
    ("http://user:pa55w0rd@example.com/", "credentials"),
])
def test_url_checked_at_relay_time(url: str, reason: str) -> None:
    problem = url_problem(url)
    assert problem is not None and reason in problem
    assert "pa55w0rd" not in problem
    result = post(url, {"a": 1}, secret=None, policy=FAST)
    assert result.permanent and result.status is None and "pa55w0rd" not in (result.error or "")


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/",
                                 "http://0.0.0.0:8080/", "http://[::ffff:169.254.169.254]/", "http://224.0.0.1/",
                                 "http://[fd00:ec2::254]/", "http://100.100.100.200/", "http://[64:ff9b::a9fe:a9fe]/",
                                 "http://[::a9fe:a9fe]/", "http://[2002:a9fe:a9fe::1]/", "http://2852039166/",
                                 "http://0xa9fea9fe/", "http://0251.0376.0251.0376/", "http://169.254.43518/"])
def test_a_link_local_unspecified_or_multicast_address_is_never_posted_to(url: str) -> None:
    """Cloud metadata answers on link-local addresses: refused at deploy, and at relay time
    (a version stored before), before any connection."""
    with pytest.raises(Invalid, match="(a link-local|a cloud metadata|an unspecified|a multicast) address: refused"):
        parse_spec({"id": "w", "webhook_url": url, "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    result = post(url, {"a": 1}, secret=None, policy=FAST)
    assert result.permanent and result.status is None and "address: refused" in (result.error or ""), result


def test_a_host_that_resolves_to_a_link_local_address_is_refused_and_others_are_pinned(
        monkeypatch: pytest.MonkeyPatch, endpoint: Endpoint) -> None:
    """The name is resolved once: every address it has is checked, and the POST goes to the
    address checked (a second lookup, as DNS rebinding answers it, is never made)."""
    real = socket.getaddrinfo
    looked: list[str] = []

    def lookup(host: str, port: Any, *args: Any, **kw: Any) -> Any:
        looked.append(host)
        if host == "metadata.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))]
        if host == "receiver.example":
            return real("127.0.0.1", port, *args, **kw)
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    refused = post("http://metadata.example/x", {}, secret=None, policy=FAST)
    assert refused.permanent and "169.254.169.254, a link-local address: refused (metadata.example resolves to it)" \
        in (refused.error or ""), refused
    port = endpoint.url("/").split(":")[2].split("/")[0]
    sent = post(f"http://receiver.example:{port}/ok", {}, secret=None, policy=FAST)
    assert sent.ok and looked.count("receiver.example") == 1, (sent, looked)


@pytest.mark.parametrize("url", ["http://127.0.0.1/", "http://10.1.2.3/", "http://[::1]/", "http://example.com/",
                                 "https://hooks.example.org:8443/x"])
def test_loopback_private_and_named_hosts_are_accepted_at_deploy(url: str) -> None:
    assert parse_spec({"id": "w", "webhook_url": url, "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})


def test_each_checked_address_is_tried_in_turn(monkeypatch: pytest.MonkeyPatch, endpoint: Endpoint) -> None:
    """A name whose first address takes no connection (IPv6 first, the receiver on IPv4
    only; a dead A record) is posted to at the next, as a lookup by the socket library
    would have."""
    real = socket.getaddrinfo
    port = int(endpoint.url("/").split(":")[2].split("/")[0])

    def lookup(host: str, p: Any, *args: Any, **kw: Any) -> Any:
        if host == "two.example":                  # the receiver listens on 127.0.0.1 only
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", p)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", p))]
        return real(host, p, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    result = post(f"http://two.example:{port}/ok", {}, secret=None, policy=FAST)
    assert result.ok, result


def test_a_host_no_resolver_takes_is_a_permanent_failure_not_an_exception() -> None:
    result = post(f"http://{'a' * 64}.example/", {}, secret=None, policy=FAST)
    assert result.permanent and "not a valid name" in (result.error or ""), result


def test_read_timeout_cap_and_deadline(endpoint: Endpoint) -> None:
    # Each endpoint would hold the client for a minute or more; the bounds leave a loaded
    # machine ten seconds of slack over the policy's 0.3 s read timeout and 1 s deadline.
    began = time.monotonic()
    silent = post(endpoint.url("/silent"), {}, secret=None, policy=FAST)
    assert silent.error and "timed out" in silent.error.lower() and time.monotonic() - began < 10
    began = time.monotonic()
    huge = post(endpoint.url("/huge"), {}, secret=None, policy=FAST)
    assert huge.ok and huge.status == 200 and time.monotonic() - began < FAST.deadline_s + 10
    assert endpoint.sent_bytes < 2000 * 65536                 # we stopped reading; the server gave up
    began = time.monotonic()
    drip = post(endpoint.url("/drip"), {}, secret=None, policy=FAST)
    assert drip.ok and time.monotonic() - began < FAST.deadline_s + 10   # the body is cut at the deadline


def test_connect_timeout_is_separate_from_the_read_timeout() -> None:
    # A listening socket whose backlog is full: the next connect hangs in SYN_SENT.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(server.getsockname())
        fillers.append(s)
    try:
        policy = RelayPolicy(connect_timeout_s=0.3, timeout_s=5.0, deadline_s=10.0)
        began = time.monotonic()
        result = post(f"http://127.0.0.1:{server.getsockname()[1]}/", {}, secret=None, policy=policy)
        assert result.error is not None and time.monotonic() - began < 4.0   # not the 5 s read timeout
    finally:
        for s in fillers:
            s.close()
        server.close()


def test_redirects_are_not_followed(endpoint: Endpoint) -> None:
    result = post(endpoint.url("/redirect"), {}, secret=None, policy=FAST)
    assert result.status == 307 and result.error and "not followed" in result.error
    assert [p for p, _, _ in endpoint.requests] == ["/redirect"]


def test_signature_carries_a_timestamp_and_refuses_replays_and_tampering(endpoint: Endpoint) -> None:
    assert post(endpoint.url("/ok"), {"run": 1}, secret=SECRET, policy=FAST).ok
    _, body, headers = endpoint.requests[-1]
    header = headers[SIGNATURE_HEADER]
    ts = int(header.split(",")[0][2:])
    assert abs(ts - time.time()) < 5 and verify(SECRET, body, header)
    assert not verify(SECRET, body, header, now=ts + 301)                        # replayed later
    assert not verify(SECRET, body, header, now=ts - 301)                        # from the future
    forged = header.replace(f"t={ts}", f"t={ts + 100}")                          # fresh timestamp, old MAC
    assert not verify(SECRET, body, forged, now=ts + 100)
    assert verify(SECRET, body, sign(SECRET, body, ts + 100), now=ts + 100)
    for bad in ("", "t=", "v1=abc", "t=abc,v1=def", "garbage", f"t={ts}"):
        assert not verify(SECRET, body, bad, now=ts)


def _insert_delivery(conn: psycopg.Connection[Any], run_id: str, url: str) -> None:
    conn.execute("INSERT INTO webhook_deliveries (run_id, url, payload) VALUES (%s, %s, %s)",
                 (run_id, url, json.dumps({"run_id": run_id})))


def test_a_bad_stored_url_gives_up_at_once_and_spoils_nothing_else(db_url: str, endpoint: Endpoint) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        _insert_delivery(conn, "bad-scheme", "ftp://127.0.0.1/x")
        _insert_delivery(conn, "bad-host", "http://exa mple.com/")
        _insert_delivery(conn, "good", endpoint.url("/ok"))
    with Engine.connect(db_url, pool_size=2) as engine:
        delivered, failed = relay_once(engine.pool, secret=None, policy=FAST)
        with engine.pool.connection() as conn:
            rows = {r[0]: r[1:] for r in conn.execute(
                """SELECT run_id, attempts, delivered_at IS NOT NULL, gave_up_at IS NOT NULL, last_error
                     FROM webhook_deliveries""")}
    assert (delivered, failed) == (1, 2)
    assert rows["good"][:3] == (1, True, False)
    assert rows["bad-scheme"][:3] == (1, False, True) and "only http and https" in rows["bad-scheme"][3]
    assert rows["bad-host"][:3] == (1, False, True)


def test_a_post_is_recorded_when_it_ends_not_when_the_batch_does(db_url: str, endpoint: Endpoint) -> None:
    """A relay killed mid-batch POSTs again only what it had not recorded: a delivery whose
    POST ended is recorded while a slower POST of the same batch is still waiting."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        _insert_delivery(conn, "fast", endpoint.url("/ok"))
        _insert_delivery(conn, "slow", endpoint.url("/held"))
    policy = RelayPolicy(connect_timeout_s=10.0, timeout_s=60.0, deadline_s=60.0)
    with Engine.connect(db_url, pool_size=2) as engine:
        outcome: list[tuple[int, int]] = []
        relay = threading.Thread(target=lambda: outcome.append(relay_once(engine.pool, secret=None, policy=policy)))
        relay.start()
        try:
            recorded: dict[str, bool] = {}
            held: set[str] = set()
            give_up = time.monotonic() + 60
            while time.monotonic() < give_up:
                with psycopg.connect(db_url, autocommit=True) as conn:
                    recorded = dict(conn.execute(
                        "SELECT run_id, delivered_at IS NOT NULL FROM webhook_deliveries").fetchall())
                held = {p for p, _, _ in endpoint.requests}
                if recorded.get("fast") and len(held) == 2:
                    break
                time.sleep(0.05)
        finally:
            endpoint.release.set()
            relay.join(30)
    assert held == {"/ok", "/held"}                       # both POSTs were sent in the one batch
    assert recorded == {"fast": True, "slow": False}      # the ended one recorded, the held one not yet
    assert outcome == [(2, 0)]
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM webhook_deliveries WHERE delivered_at IS NULL").fetchone() == (0,)


def test_posts_not_started_when_recording_fails_are_not_sent(db_url: str, endpoint: Endpoint,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay whose record fails (the database stayed away) sends none of the batch's
    POSTs that had not started: they go out once, after the lease, not twice."""
    with psycopg.connect(db_url, autocommit=True) as conn:      # one by one: the claim takes them in this order
        _insert_delivery(conn, "fast", endpoint.url("/ok"))
        for i in range(PARALLEL_POSTS + 3):
            _insert_delivery(conn, f"held-{i}", endpoint.url("/held"))

    def held_received() -> int:
        with endpoint.lock:
            return sum(p == "/held" for p, _, _ in endpoint.requests)

    def record_fails(*_: Any) -> None:
        # The fast POST ended first; its thread takes the next queued one. Fail once that
        # one reached the endpoint too, so every thread holds a started POST and the
        # queue's order, not the threads' timing, decides what is sent.
        deadline = time.monotonic() + 60
        while held_received() < PARALLEL_POSTS and time.monotonic() < deadline:
            time.sleep(0.02)
        raise Unavailable("the database stayed away")

    class ReleasingPool(ThreadPoolExecutor):
        """Answers the held POSTs once the relay has cancelled what it had not started."""

        def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
            super().shutdown(wait=False, cancel_futures=cancel_futures)
            endpoint.release.set()
            super().shutdown(wait=wait)

    monkeypatch.setattr(webhooks, "_record", record_fails)
    monkeypatch.setattr(webhooks, "ThreadPoolExecutor", ReleasingPool)
    policy = RelayPolicy(connect_timeout_s=10.0, timeout_s=60.0, deadline_s=60.0)
    try:
        with Engine.connect(db_url, pool_size=2) as engine, pytest.raises(Unavailable):
            relay_once(engine.pool, secret=None, policy=policy)
    finally:
        endpoint.release.set()
    # PARALLEL_POSTS at once: the fast one and 7 held; the fast one's thread took the next;
    # the record failed, and the 3 still queued were never sent.
    sent = sorted(p for p, _, _ in endpoint.requests)
    assert sent == ["/held"] * PARALLEL_POSTS + ["/ok"]


def test_no_secret_in_logs(db_url: str, endpoint: Endpoint, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with Engine.connect(db_url, pool_size=2) as engine:
        for wf, path in (("ok", "/ok"), ("fails", "/redirect"), ("silent", "/silent")):
            engine.deploy({"id": wf, "webhook_url": endpoint.url(path),
                           "nodes": [{"id": "w", "type": "WAIT", "duration_s": 0}]})
            engine.start(wf)
        coord = engine.coordinator(webhook_secret=SECRET, relay=FAST)
        stats = [coord.run_once() for _ in range(3)]
    assert sum(s.webhooks_delivered for s in stats) == 1 and sum(s.webhooks_failed for s in stats) >= 2
    assert any("webhook" in r.getMessage() for r in caplog.records)
    text = "\n".join(f"{r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records)
    assert SECRET not in text and SECRET not in caplog.text


def test_relay_policy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_WEBHOOK_CONNECT_TIMEOUT_S", "0.5")
    monkeypatch.setenv("COMPOSER_WEBHOOK_TIMEOUT_S", "2")
    monkeypatch.setenv("COMPOSER_WEBHOOK_DEADLINE_S", "4")
    policy = RelayPolicy.from_env()
    assert (policy.connect_timeout_s, policy.timeout_s, policy.deadline_s) == (0.5, 2.0, 4.0)
    assert policy.lease >= policy.deadline_s           # a relay never holds a delivery past its lease
    monkeypatch.setenv("COMPOSER_WEBHOOK_TIMEOUT_S", "soon")
    with pytest.raises(Invalid, match="COMPOSER_WEBHOOK_TIMEOUT_S"):
        RelayPolicy.from_env()
    with pytest.raises(Invalid):
        RelayPolicy(connect_timeout_s=0)
