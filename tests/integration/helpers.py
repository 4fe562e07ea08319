"""Small builders for integration tests: definitions and runs inserted directly, a
lost COMMIT acknowledgement, and threads released together."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import uuid6

from composer_ops import Engine
from composer_ops.repo import clock, definitions, runs
from composer_ops.repo.outbox import ClaimAsk
from composer_ops.testing import fixtures

T = TypeVar("T")


def uuid7_at(ts: datetime) -> str:
    """A UUIDv7 whose timestamp is ``ts`` (random low bits)."""
    ms = int(ts.timestamp() * 1000)
    rand = uuid6.uuid7().int & ((1 << 80) - 1)
    value = (ms << 80) | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)        # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)        # variant 10
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def add_definition(conn: Any, workflow_id: str = "wf", spec: dict[str, Any] | None = None) -> int:
    spec = spec or {"id": workflow_id, "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}
    version = definitions.insert_version(conn, workflow_id=workflow_id, name=workflow_id, spec=spec,
                                         created_by="test", webhook_url=None)
    definitions.deploy(conn, workflow_id, version)
    return version


def add_run(conn: Any, workflow_id: str = "wf", *, at: datetime | None = None, version: int = 1,
            status: str | None = None) -> str:
    run_id = uuid7_at(at) if at else str(uuid6.uuid7())
    runs.insert_run(conn, run_id=run_id, workflow_id=workflow_id, workflow_version=version,
                    input={"x": 1}, context={"input": {"x": 1}, "config": {}}, now=clock.now(conn))
    if status and status != "RUNNING":
        conn.execute("UPDATE workflow_runs SET status = %s WHERE id = %s", (status, run_id))
    return run_id


def now_utc() -> datetime:
    return datetime.now(UTC)


def connect_in_tz(url: str, tz: str) -> Any:
    """A connection whose session TimeZone is ``tz`` (SET, since PGTZ would override
    a startup option)."""
    import psycopg

    conn = psycopg.connect(url)
    conn.execute("SELECT set_config('TimeZone', %s, false)", (tz,))
    conn.commit()
    row = conn.execute("SHOW TimeZone").fetchone()
    assert row is not None
    assert row[0] == tz
    return conn


class LoseAck:
    """Wraps an Engine's ``pool.connection``: after ``skip`` blocks, the next ``times``
    blocks that end without an error (their transaction committed) have their session
    killed before they return (``pg_terminate_backend`` of its own backend), so the
    caller gets the engine's error for a connection lost after its COMMIT, as when the
    server's acknowledgement of the COMMIT is lost. ``fired`` counts the kills."""

    def __init__(self, engine: Engine, times: int = 1, skip: int = 0) -> None:
        self.real, self.left, self.skip, self.fired = engine.pool.connection, times, skip, 0

    @contextlib.contextmanager
    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self.real(*args, **kwargs) as conn:
            yield conn
            if self.skip > 0:
                self.skip -= 1
            elif self.left > 0:
                self.left -= 1
                self.fired += 1
                conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")


def seed_aligned(conn: Any) -> fixtures.SeedInfo:
    """``fixtures.seed``, then its misaligned 202412 re-attached with the month's bounds
    (what `composer-ops migrate` repairs): retention refuses a month whose partitions'
    bounds are not its name's, and these tests drop 202412 with the others."""
    info = fixtures.seed(conn)
    conn.execute("SELECT composer_repair_partition_bounds()")
    return info


def drop_months(conn: Any, older_than: datetime) -> list[str]:
    """``composer_drop_partitions(older_than)``, the one-argument SQL function an
    operator calls from psql (the engine calls the two-argument one through
    ``repo.retention.drop``); returns the dropped months (YYYYMM)."""
    return [str(r[0]) for r in conn.execute("SELECT composer_drop_partitions(%s)", (older_than,)).fetchall()]


def at_once(fn: Callable[[Callable[[], None]], T], n: int = 2, timeout: float = 60.0) -> list[T]:
    """Run ``fn`` in ``n`` threads and return their results (in no order). Each thread
    calls the ``go`` it is given right before the part that must race: they all wait
    there until every one of them has arrived. The first error of a thread is raised."""
    barrier = threading.Barrier(n)
    results: list[T] = []
    errors: list[BaseException] = []

    def go() -> None:
        barrier.wait(timeout)

    def run() -> None:
        try:
            results.append(fn(go))
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert len(results) == n, f"{n - len(results)} of {n} threads did not finish in {timeout}s"
    return results


class CoordinatorClock:
    """The coordinator's schedule clock (``time.monotonic`` in engine/coordinator.py: its
    backoffs, floor reads, upkeep), stopped: it moves only by :meth:`advance`, so "still
    backing off" and "the backoff is over" do not depend on how long the machine took
    between two passes."""

    def __init__(self, monkeypatch: Any) -> None:
        import time

        from composer_ops.engine import coordinator

        self.now = time.monotonic()
        monkeypatch.setattr(coordinator, "time", self)

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def claim_ask(queues: list[str], owner: str, limit: int, names: list[str] | None, claim_id: str) -> ClaimAsk:
    """The claim of ID ``claim_id`` (a test's own, as a retried claim's first attempt had)."""
    return ClaimAsk(queues=tuple(queues), owner=owner, limit=limit, claim_id=claim_id,
                    task_names=None if names is None else tuple(names))
