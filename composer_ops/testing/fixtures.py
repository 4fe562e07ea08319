"""A deterministic seeded database for the notebook harness (nbval), the ops tests
and demos: definitions, runs, tasks, signals, outbox rows and a webhook delivery,
a MAP node with its items and a SUB_WORKFLOW parent with its child run, inserted
directly with SQL, with the figures every notebook must reproduce.

History lives in four fixed past months (2025-01..2025-04) with fixed UUIDv7 IDs.
Live work (active tasks, leases, the outbox) lives in the current UTC month, with
IDs derived from the month's first instant and timestamps relative to the database
clock, placed well inside their age and expiry buckets so the figures hold for
minutes after seeding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from composer_ops.core.children import child_run_id
from composer_ops.core.runids import add_months, month_label, month_start

HISTORY_MONTHS = ("202501", "202502", "202503", "202504")

ORDER_V1: dict[str, Any] = {
    "id": "order-fulfilment", "name": "Order fulfilment", "webhook_url": "https://example.invalid/hook",
    "config": {"region": "eu"},
    "nodes": [
        {"id": "charge", "type": "TASK", "task": "payments.charge", "queue": "payments",
         "retry": {"max_attempts": 3, "initial_backoff_s": 1, "multiplier": 2, "max_backoff_s": 60}, "lease_s": 30},
        {"id": "route", "type": "SWITCH", "depends_on": ["charge"], "expression": "$.nodes.charge.output.tier",
         "cases": {"gold": ["express"]}, "default": ["standard"]},
        {"id": "express", "type": "TASK", "task": "ship.express", "depends_on": ["route"]},
        {"id": "standard", "type": "TASK", "task": "ship.standard", "depends_on": ["route"]},
        {"id": "cool_off", "type": "WAIT", "depends_on": ["express", "standard"], "duration_s": 5},
        {"id": "delivered", "type": "WAIT_FOR_SIGNAL", "depends_on": ["cool_off"], "signal": "delivered"},
        {"id": "notify", "type": "TASK", "task": "notify", "depends_on": ["delivered"],
         "retry": {"max_attempts": 3}},
    ],
}
#: v2 adds a timeout to the delivery wait (deployed; the live runs use it).
ORDER_V2: dict[str, Any] = {**ORDER_V1, "nodes": [
    {**n, "timeout_s": 86400} if n["id"] == "delivered" else n for n in ORDER_V1["nodes"]]}
REPORT_V1: dict[str, Any] = {
    "id": "nightly-report", "name": "Nightly report",
    "nodes": [
        {"id": "extract_a", "type": "TASK", "task": "report.extract", "queue": "reports"},
        {"id": "extract_b", "type": "TASK", "task": "report.extract", "queue": "reports"},
        {"id": "load", "type": "TASK", "task": "report.load", "queue": "reports",
         "depends_on": ["extract_a", "extract_b"]},
    ],
}
#: A MAP over a listed batch of invoices (as examples/charge_all.json, two at a time).
CHARGE_ALL_V1: dict[str, Any] = {
    "id": "charge-all", "name": "Charge every due invoice",
    "nodes": [
        {"id": "list", "type": "TASK", "task": "invoices.list_due", "queue": "payments"},
        {"id": "charge_all", "type": "MAP", "depends_on": ["list"], "items": "$.nodes.list.output.invoices",
         "task": "invoices.charge", "queue": "payments", "max_parallel": 2, "on_item_failure": "continue",
         "retry": {"max_attempts": 3}},
        {"id": "summary", "type": "TASK", "task": "invoices.summarise", "depends_on": ["charge_all"],
         "input": {"charges": "$.nodes.charge_all.output"}},
    ],
}
#: A parent whose SUB_WORKFLOW node starts a refund run (examples/returns.json, refund.json).
REFUND_V1: dict[str, Any] = {
    "id": "refund", "name": "Refund an order",
    "nodes": [{"id": "pay_back", "type": "TASK", "task": "refunds.pay", "queue": "payments"}],
}
RETURNS_V1: dict[str, Any] = {
    "id": "returns", "name": "Handle a returned parcel",
    "nodes": [
        {"id": "inspect", "type": "TASK", "task": "returns.inspect"},
        {"id": "refund", "type": "SUB_WORKFLOW", "depends_on": ["inspect"], "workflow": "refund",
         "input": {"amount": "$.nodes.inspect.output.refundable"}},
        {"id": "notify", "type": "TASK", "task": "notify", "depends_on": ["refund"]},
    ],
}


def uuid7_text(ts: datetime, seq: int) -> str:
    """A deterministic UUIDv7: ``ts``'s milliseconds, then bits derived from ``seq``."""
    ms = int(ts.timestamp() * 1000)
    rand_a = (seq * 2654435761) & 0xFFF
    rand_b = (0x2A5F_17C3_9D44_B0E1 ^ (seq * 0x9E37_79B9)) & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0x2 << 62) | rand_b
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True, kw_only=True)
class SeedInfo:
    """What :func:`seed` inserted: the run IDs by label, the current month and the clock it used."""

    runs: dict[str, str]
    current_month: str
    now: datetime
    tasks: dict[str, str] = field(default_factory=dict)

    @property
    def story_run(self) -> str:
        """The run the investigation notebook opens by default (the newest FAILED run)."""
        return self.runs["H9"]


class _Seeder:
    def __init__(self, conn: psycopg.Connection[Any], now: datetime) -> None:
        self.conn = conn
        self.now = now
        self.seq = 0
        self.runs: dict[str, str] = {}
        self.tasks: dict[str, str] = {}

    def ago(self, seconds: float) -> datetime:
        return self.now - timedelta(seconds=seconds)

    def next_id(self, ts: datetime) -> str:
        self.seq += 1
        return uuid7_text(ts, self.seq)

    def definition(self, spec: dict[str, Any], version: int, deployed: bool, at: datetime) -> None:
        self.conn.execute(
            """INSERT INTO workflow_definitions (id, name, version, spec_json, created_by, webhook_url,
                                                 deployed, deployed_at, created_at)
               VALUES (%s, %s, %s, %s, 'seed', %s, %s, %s, %s)""",
            (spec["id"], spec["name"], version, Jsonb(spec), spec.get("webhook_url"), deployed,
             at if deployed else None, at))

    def run(self, label: str, wf: str, version: int, status: str, created: datetime, *,
            id_at: datetime | None = None, completed: datetime | None = None, error: str | None = None,
            output: Any = None, run_id: str | None = None, parent: tuple[str, str] | None = None) -> str:
        """A run; ``run_id`` given (a child's, derived from its parent) or made from
        ``id_at``; ``parent`` the (run label, node) of the SUB_WORKFLOW node that started it."""
        run_id = run_id or self.next_id(id_at or created)
        self.conn.execute(
            """INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json,
                                          context_json, error_json, output_json, created_at, updated_at,
                                          completed_at, parent_run_id, parent_node_id)
               VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
            (run_id, wf, version, status, Jsonb({"order": label}), Jsonb({"input": {"order": label}, "config": {}}),
             Jsonb({"error": error}) if error else None, Jsonb(output) if output is not None else None,
             created, completed or created, completed, self.runs[parent[0]] if parent else None,
             parent[1] if parent else None))
        self.runs[label] = run_id
        return run_id

    def task(self, run: str, node: str, node_type: str, queue: str | None, state: str, created: datetime, *,
             attempt: int = 0, started: datetime | None = None, finished: datetime | None = None,
             updated: datetime | None = None, wake_at: datetime | None = None, signal: str | None = None,
             owner: str | None = None, lease: datetime | None = None, error: str | None = None,
             branches: list[str] | None = None, output: Any = None, item: int | None = None,
             counters: tuple[int, int, int, int] | None = None) -> str:
        """A task; ``item`` the index of a MAP item, ``counters`` a MAP node's own
        (total, started, done, failed)."""
        task_id = self.next_id(created)
        total, started_items, done, failed = counters if counters is not None else (None, None, None, None)
        self.conn.execute(
            """INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state, attempt, output_json,
                                           last_error, branches, wake_at, signal_name, scheduled_at, started_at,
                                           finished_at, completed_at, created_at, updated_at, lease_owner,
                                           lease_expires_at, item_index, items_total, items_started, items_done,
                                           items_failed)
               VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
                       %s, %s, %s, %s, %s)""",
            (task_id, self.runs[run], node, node_type, queue, state, attempt,
             Jsonb(output) if output is not None else None, Jsonb({"error": error}) if error else None,
             branches, wake_at, signal, created, started, finished,
             finished if state == "COMPLETED" else None, created, updated or finished or started or created,
             owner, lease, item, total, started_items, done, failed))
        self.tasks[f"{run}.{node}" if item is None else f"{run}.{node}[{item}]"] = task_id
        return task_id

    def signal(self, run: str, name: str, created: datetime, consumed: datetime | None, payload: Any) -> None:
        self.conn.execute(
            "INSERT INTO workflow_events (id, run_id, name, payload, created_at, consumed_at) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            (self.next_id(created), self.runs[run], name, Jsonb(payload), created, consumed))

    def history(self, run: str, kind: str, at: datetime, node: str, detail: Any) -> None:
        self.conn.execute(
            "INSERT INTO run_history (run_id, at, kind, node_id, request, detail) VALUES (%s, %s, %s, %s, %s, %s)",
            (self.runs[run], at, kind, node, "seed", Jsonb(detail)))

    def outbox(self, run: str, node: str, queue: str, attempt: int, task_name: str, available: datetime) -> None:
        self.conn.execute(
            "INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at, created_at) "
            "VALUES (%s, %s, %s, %s, %s, 30, %s, %s)",
            (queue, self.runs[run], self.tasks[f"{run}.{node}"], attempt, task_name, available,
             min(available, self.now)))

    def report_run(self, label: str, status: str, created: datetime) -> None:
        """A nightly-report run; SUCCEEDED ones have all three tasks COMPLETED."""
        done = created + timedelta(minutes=4)
        self.run(label, "nightly-report", 1, status, created, completed=done)
        if status == "SUCCEEDED":
            for i, node in enumerate(("extract_a", "extract_b", "load")):
                self.task(label, node, "TASK", "reports", "COMPLETED", created + timedelta(seconds=i),
                          started=created + timedelta(seconds=10 + i * 60),
                          finished=created + timedelta(seconds=60 + i * 60), output={"rows": 100 * (i + 1)})


def seed(conn: psycopg.Connection[Any], *, analyze: bool = True) -> SeedInfo:
    """Insert the fixture content into a freshly migrated database (does not commit).
    ``analyze`` runs ANALYZE so the catalog row estimates equal the exact counts."""
    now: datetime = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    now = now.astimezone(UTC)
    conn.execute("SELECT composer_ensure_partitions_from(%s, 3)", (date(2025, 1, 1),))
    conn.execute("SELECT composer_ensure_partitions(3)")
    s = _Seeder(conn, now)
    s.definition(ORDER_V1, 1, False, datetime(2024, 12, 1, tzinfo=UTC))
    s.definition(ORDER_V2, 2, True, datetime(2025, 6, 1, tzinfo=UTC))
    s.definition(REPORT_V1, 1, True, datetime(2024, 12, 1, tzinfo=UTC))
    for spec in (CHARGE_ALL_V1, REFUND_V1, RETURNS_V1):
        s.definition(spec, 1, True, datetime(2025, 6, 1, tzinfo=UTC))
    _misaligned_month(conn)
    _history(s)
    _live(s)
    _fanout(s)
    _odd(s)
    if analyze:
        tables = [r[0] for r in conn.execute("SELECT unnest(composer_run_tables())").fetchall()]
        for table in (*tables, "task_outbox"):
            conn.execute(f"ANALYZE {table}".encode())
    return SeedInfo(runs=dict(s.runs), current_month=month_label(now), now=now, tasks=dict(s.tasks))


def _misaligned_month(conn: psycopg.Connection[Any]) -> None:
    """December 2024 of all three tables with bounds an hour early, as a partition
    function doing month arithmetic in a UTC+1 session TimeZone would have made them."""
    for table in ("workflow_runs", "task_instances", "workflow_events"):
        conn.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES FROM (composer_uuid7_bound({})) "
                             "TO (composer_uuid7_bound({}))").format(
            sql.Identifier(f"{table}_p202412"), sql.Identifier(table),
            sql.Literal(datetime(2024, 11, 30, 23, tzinfo=UTC)), sql.Literal(datetime(2024, 12, 31, 23, tzinfo=UTC))))


def _odd(s: _Seeder) -> None:
    """Rows that break what the engine guarantees, for the reports to flag: a RUNNING
    task without a lease (L9), a task for a node the definition does not have (H9's
    legacy_audit), and a run whose definition version is missing (H12 names
    order-fulfilment v3, as a definition deleted by hand in SQL would leave it: runs have
    no foreign key to their definition since V019)."""
    base = month_start(month_label(s.now))
    s.run("L9", "order-fulfilment", 2, "RUNNING", s.ago(400), id_at=base + timedelta(seconds=9))
    s.task("L9", "charge", "TASK", "payments", "RUNNING", s.ago(400), started=s.ago(300))
    t0 = _at("202503", 16)
    s.task("H9", "legacy_audit", "TASK", "default", "COMPLETED", t0 + timedelta(seconds=60),
           started=t0 + timedelta(seconds=61), finished=t0 + timedelta(seconds=62))
    s.conn.execute("UPDATE workflow_runs SET workflow_version = 3 WHERE id = %s", (s.runs["H12"],))


def odd_definitions(conn: psycopg.Connection[Any], info: SeedInfo) -> None:
    """On top of :func:`seed` (does not commit): active work its definition does not
    explain, as hand edits in SQL leave it. nightly-report v1 loses its node extract_a
    (L6's PENDING and L7's RUNNING extract_a are then for a node not in their definition),
    and L8 (RUNNING, its charge PENDING) names order-fulfilment v9, which does not exist.
    Every count of the active work is unchanged (:func:`odd_definitions_figures`)."""
    conn.execute("""UPDATE workflow_definitions
                       SET spec_json = jsonb_set(spec_json, '{nodes}',
                                                 (SELECT jsonb_agg(n) FROM jsonb_array_elements(spec_json -> 'nodes') n
                                                   WHERE n ->> 'id' <> 'extract_a'))
                     WHERE id = 'nightly-report' AND version = 1""")
    conn.execute("UPDATE workflow_runs SET workflow_version = 9 WHERE id = %s", (info.runs["L8"],))


def odd_definitions_figures(info: SeedInfo) -> dict[str, Any]:
    """The active_tasks figures for :func:`seed` then :func:`odd_definitions`: the seed's,
    with L7's and L6's extract_a and the run L8 flagged (three rows, oldest first)."""
    runs = info.runs
    return {**expected_figures(info)["active_tasks"], "definition_mismatches": 3, "anomalies": sorted([
        f"RUNNING without a lease: run {runs['L9']}, node charge",
        f"task for a node not in its definition: run {runs['L6']}, node extract_a",
        f"task for a node not in its definition: run {runs['L7']}, node extract_a",
        f"definition version missing: run {runs['L8']}",
    ])}


def _at(month: str, day: int, hour: int = 12) -> datetime:
    return month_start(month).replace(day=day, hour=hour)


def _history(s: _Seeder) -> None:
    for label, day in (("H1", 5), ("H2", 12), ("H3", 19)):
        s.report_run(label, "SUCCEEDED", _at("202501", day))
    s.report_run("H4", "SUCCEEDED", _at("202502", 3))
    s.report_run("H5", "SUCCEEDED", _at("202502", 14))
    # H6: stuck since February 2025, waiting for a 'delivered' signal with no timeout (v1).
    t0 = _at("202502", 20)
    s.run("H6", "order-fulfilment", 1, "RUNNING", t0)
    s.task("H6", "charge", "TASK", "payments", "COMPLETED", t0, started=t0 + timedelta(seconds=1),
           finished=t0 + timedelta(seconds=3), output={"tier": "silver"})
    s.task("H6", "route", "SWITCH", None, "COMPLETED", t0 + timedelta(seconds=3), finished=t0 + timedelta(seconds=3),
           branches=["standard"])
    s.task("H6", "express", "TASK", "default", "SKIPPED", t0 + timedelta(seconds=3), finished=t0 + timedelta(seconds=3))
    s.task("H6", "standard", "TASK", "default", "COMPLETED", t0 + timedelta(seconds=3),
           started=t0 + timedelta(seconds=4), finished=t0 + timedelta(seconds=9))
    s.task("H6", "cool_off", "WAIT", None, "COMPLETED", t0 + timedelta(seconds=9), finished=t0 + timedelta(seconds=14),
           wake_at=t0 + timedelta(seconds=14))
    s.task("H6", "delivered", "WAIT_FOR_SIGNAL", None, "WAITING", t0 + timedelta(seconds=14), signal="delivered")
    s.signal("H6", "address-changed", t0 + timedelta(seconds=20), None, {"city": "Lyon"})
    # March: one failed and one cancelled report, and the story run (H9).
    t0 = _at("202503", 2)
    s.run("H7", "nightly-report", 1, "FAILED", t0, completed=t0 + timedelta(minutes=7),
          error="node extract_a failed: source database unreachable")
    s.task("H7", "extract_a", "TASK", "reports", "FAILED", t0, attempt=2, started=t0 + timedelta(minutes=6),
           finished=t0 + timedelta(minutes=7), error="source database unreachable")
    s.task("H7", "extract_b", "TASK", "reports", "COMPLETED", t0, started=t0 + timedelta(seconds=5),
           finished=t0 + timedelta(seconds=65))
    s.task("H7", "load", "TASK", "reports", "SKIPPED", t0 + timedelta(minutes=7), finished=t0 + timedelta(minutes=7))
    t0 = _at("202503", 9)
    s.run("H8", "nightly-report", 1, "CANCELLED", t0, completed=t0 + timedelta(minutes=1), error="cancelled: operator")
    for node in ("extract_a", "extract_b"):
        s.task("H8", node, "TASK", "reports", "CANCELLED", t0, finished=t0 + timedelta(minutes=1),
               error="cancelled: operator")
    _story(s, _at("202503", 16))
    s.report_run("H10", "SUCCEEDED", _at("202504", 6))
    s.report_run("H11", "SUCCEEDED", _at("202504", 13))
    s.run("H12", "order-fulfilment", 1, "PENDING", _at("202504", 27))


def _story(s: _Seeder, t0: datetime) -> None:
    """H9: charge retried once, the gold branch, a wait, a signal that arrived early
    (buffered, then consumed) plus a duplicate, and notify failing on its last attempt."""
    def at(sec: float) -> datetime:
        return t0 + timedelta(seconds=sec)

    s.run("H9", "order-fulfilment", 1, "FAILED", t0, completed=at(120),
          error="node notify failed: smtp 550 mailbox unavailable")
    s.task("H9", "charge", "TASK", "payments", "COMPLETED", at(0), attempt=1, started=at(33), finished=at(35),
           error="card processor timeout", output={"tier": "gold"})
    s.task("H9", "route", "SWITCH", None, "COMPLETED", at(35), finished=at(35), branches=["express"])
    s.task("H9", "express", "TASK", "default", "COMPLETED", at(35), started=at(36), finished=at(50))
    s.task("H9", "standard", "TASK", "default", "SKIPPED", at(35), finished=at(35))
    s.task("H9", "cool_off", "WAIT", None, "COMPLETED", at(50), finished=at(55), wake_at=at(55))
    s.signal("H9", "delivered", at(52), at(55), {"proof": "signed-by-recipient"})
    s.task("H9", "delivered", "WAIT_FOR_SIGNAL", None, "COMPLETED", at(55), finished=at(55), signal="delivered",
           output={"proof": "signed-by-recipient"})
    s.signal("H9", "delivered", at(80), None, {"proof": "duplicate scan"})
    s.task("H9", "notify", "TASK", "default", "FAILED", at(55), attempt=2, started=at(110), finished=at(120),
           error="smtp 550 mailbox unavailable")
    s.conn.execute(
        """INSERT INTO webhook_deliveries (run_id, url, payload, attempts, next_attempt_at, delivered_at,
                                           last_status, created_at)
           VALUES (%s, %s, %s, 1, %s, %s, 200, %s)""",
        (s.runs["H9"], ORDER_V1["webhook_url"], Jsonb({"run_id": s.runs["H9"], "status": "FAILED"}),
         at(121), at(122), at(120)))


def _live(s: _Seeder) -> None:
    """Runs of the current month with active work (ages and expiries in seconds)."""
    base = month_start(month_label(s.now))

    def live_run(label: str, wf: str, version: int, age: float, k: int) -> None:
        s.run(label, wf, version, "RUNNING", s.ago(age), id_at=base + timedelta(seconds=k))

    def done(run: str, node: str, ntype: str, age: float, **kw: Any) -> None:
        queue = kw.pop("queue", "default" if ntype == "TASK" else None)
        state = kw.pop("state", "COMPLETED")
        s.task(run, node, ntype, queue, state, s.ago(age), finished=s.ago(age - 5), **kw)

    live_run("L1", "order-fulfilment", 2, 100, 1)
    s.task("L1", "charge", "TASK", "payments", "RUNNING", s.ago(100), started=s.ago(90), owner="worker-a",
           lease=s.ago(-1200))
    live_run("L2", "order-fulfilment", 2, 1800, 2)
    s.task("L2", "charge", "TASK", "payments", "RUNNING", s.ago(1800), attempt=2, started=s.ago(1000),
           owner="worker-b", lease=s.ago(900), error="card processor timeout")
    live_run("L3", "order-fulfilment", 2, 700, 3)
    done("L3", "charge", "TASK", 700, queue="payments", output={"tier": "gold"})
    done("L3", "route", "SWITCH", 650, branches=["express"])
    done("L3", "standard", "TASK", 650, state="SKIPPED")
    s.task("L3", "express", "TASK", "default", "RUNNING", s.ago(600), started=s.ago(500), owner="worker-a",
           lease=s.ago(-7200))
    live_run("L4", "order-fulfilment", 2, 4 * 3600, 4)
    done("L4", "charge", "TASK", 4 * 3600, queue="payments", output={"tier": "silver"})
    done("L4", "route", "SWITCH", 4 * 3600 - 10, branches=["standard"])
    done("L4", "express", "TASK", 4 * 3600 - 10, state="SKIPPED")
    done("L4", "standard", "TASK", 4 * 3600 - 10)
    s.task("L4", "cool_off", "WAIT", None, "WAITING", s.ago(3 * 3600), wake_at=s.ago(-3600))
    live_run("L5", "order-fulfilment", 2, 13 * 3600, 5)
    done("L5", "charge", "TASK", 13 * 3600, queue="payments", output={"tier": "gold"})
    done("L5", "route", "SWITCH", 13 * 3600 - 10, branches=["express"])
    done("L5", "standard", "TASK", 13 * 3600 - 10, state="SKIPPED")
    done("L5", "express", "TASK", 13 * 3600 - 10)
    done("L5", "cool_off", "WAIT", 13 * 3600 - 100)
    s.task("L5", "delivered", "WAIT_FOR_SIGNAL", None, "WAITING", s.ago(12 * 3600), signal="delivered",
           wake_at=s.ago(12 * 3600 - 86400))
    live_run("L6", "nightly-report", 1, 1800, 6)
    s.task("L6", "extract_a", "TASK", "reports", "PENDING", s.ago(1800), attempt=1, updated=s.ago(120),
           error="connection reset by peer")
    s.task("L6", "extract_b", "TASK", "reports", "PENDING", s.ago(1800))
    s.outbox("L6", "extract_a", "reports", 1, "report.extract", s.ago(-1800))
    s.outbox("L6", "extract_b", "reports", 0, "report.extract", s.ago(1800))
    live_run("L7", "nightly-report", 1, 2 * 86400, 7)
    s.task("L7", "extract_a", "TASK", "reports", "RUNNING", s.ago(2 * 86400), attempt=1, started=s.ago(7300),
           owner="worker-b", lease=s.ago(7200), error="worker lost its lease")
    done("L7", "extract_b", "TASK", 2 * 86400, queue="reports")
    live_run("L8", "order-fulfilment", 2, 700, 8)
    s.task("L8", "charge", "TASK", "payments", "PENDING", s.ago(700))
    s.outbox("L8", "charge", "payments", 0, "payments.charge", s.ago(700))


def _fanout(s: _Seeder) -> None:
    """MAP and SUB_WORKFLOW runs of the current month, between L8 and L9 by run ID.

    M1 (charge-all, RUNNING): its MAP node charge_all over 6 invoices, 2 at a time, has
    dispatched items 0-4: 0 and 2 COMPLETED (2 took 900 s, the slowest), 1 FAILED on its
    third attempt, 3 RUNNING (leased by worker-a), 4 PENDING in the outbox;
    item 5 waits for a free slot (PENDING, not dispatched). The node's counters say so.
    P1 (returns, RUNNING) waits in its SUB_WORKFLOW node refund for C1 (refund, RUNNING,
    its pay_back PENDING in the outbox), whose ID is derived from P1 and the node as the
    engine derives it; P1's history names the child. M9 (charge-all, SUCCEEDED) is odd
    data: its MAP node counts 3 completed items and has rows for 2."""
    base = month_start(month_label(s.now))
    s.run("M1", "charge-all", 1, "RUNNING", s.ago(1200), id_at=base + timedelta(seconds=8.1))
    invoices = [f"inv-{i}" for i in range(1, 7)]
    s.task("M1", "list", "TASK", "payments", "COMPLETED", s.ago(1200), started=s.ago(1199), finished=s.ago(1190),
           output={"invoices": invoices})
    s.task("M1", "charge_all", "MAP", "payments", "WAITING", s.ago(1190), updated=s.ago(228),
           counters=(6, 5, 2, 1))

    def item(i: int, state: str, **kw: Any) -> None:
        s.task("M1", "charge_all", "MAP", "payments", state, s.ago(1190), item=i, **kw)

    item(0, "COMPLETED", started=s.ago(1189), finished=s.ago(1129), output={"charged": invoices[0]})
    item(1, "FAILED", attempt=2, started=s.ago(1100), finished=s.ago(1090), error="card declined")
    item(2, "COMPLETED", started=s.ago(1128), finished=s.ago(228), output={"charged": invoices[2]})
    item(3, "RUNNING", started=s.ago(120), owner="worker-a", lease=s.ago(-1500))
    item(4, "PENDING", updated=s.ago(228))
    item(5, "PENDING")
    s.outbox("M1", "charge_all[4]", "payments", 0, "invoices.charge", s.ago(228))

    parent = s.run("P1", "returns", 1, "RUNNING", s.ago(600), id_at=base + timedelta(seconds=8.2))
    s.task("P1", "inspect", "TASK", "default", "COMPLETED", s.ago(600), started=s.ago(599), finished=s.ago(590),
           output={"refundable": 42})
    s.task("P1", "refund", "SUB_WORKFLOW", None, "WAITING", s.ago(590))
    child = child_run_id(parent, "refund", base + timedelta(seconds=8.3))
    s.run("C1", "refund", 1, "RUNNING", s.ago(590), run_id=child, parent=("P1", "refund"))
    s.history("P1", "child_started", s.ago(590), "refund", {"child": child})
    s.task("C1", "pay_back", "TASK", "payments", "PENDING", s.ago(590))
    s.outbox("C1", "pay_back", "payments", 0, "refunds.pay", s.ago(590))

    s.run("M9", "charge-all", 1, "SUCCEEDED", s.ago(5000), id_at=base + timedelta(seconds=8.4),
          completed=s.ago(4000))
    s.task("M9", "list", "TASK", "payments", "COMPLETED", s.ago(5000), started=s.ago(4999), finished=s.ago(4990),
           output={"invoices": invoices[:3]})
    s.task("M9", "charge_all", "MAP", "payments", "COMPLETED", s.ago(4990), finished=s.ago(4100),
           counters=(3, 3, 3, 0), output=[{"charged": v} for v in invoices[:3]])
    for i in (0, 1):
        s.task("M9", "charge_all", "MAP", "payments", "COMPLETED", s.ago(4990), item=i, started=s.ago(4989 - i),
               finished=s.ago(4500 - i), output={"charged": invoices[i]})
    s.task("M9", "summary", "TASK", "default", "COMPLETED", s.ago(4100), started=s.ago(4099), finished=s.ago(4000))


def expected_figures(info: SeedInfo) -> dict[str, dict[str, Any]]:
    """The figures each notebook must show for :func:`seed`'s content (written by hand
    from the fixture above, not computed by the code under test)."""
    cur = info.current_month
    ahead = [add_months(cur, i) for i in range(1, 4)]
    months = ["202412", *HISTORY_MONTHS, cur, *ahead]
    runs = info.runs
    misaligned = [f"partition bounds do not match its name: {t} partition {t}_p202412"
                  for t in ("task_instances", "workflow_events", "workflow_runs")]
    no_lease = [f"RUNNING without a lease: run {runs['L9']}, node charge"]
    return {
        "partition_sizes": {
            "partitions": 35, "months": months, "misaligned": 3,
            # The current month: 32 rows of L1-L9, then M1 (1 run, 8 tasks), P1 (1 run, 2 tasks,
            # 1 history row), C1 (1 run, 1 task) and M9 (1 run, 5 tasks).
            "rows_by_table": {"workflow_runs": 25, "task_instances": 79, "workflow_events": 3, "run_history": 1},
            "rows_by_month": {"202412": 0, "202501": 12, "202502": 16, "202503": 18, "202504": 9, cur: 53,
                              ahead[0]: 0, ahead[1]: 0, ahead[2]: 0},
            "months_ahead": {"workflow_runs": 3, "task_instances": 3, "workflow_events": 3, "run_history": 3},
            "lookahead_alerts": 0,
            # log-linear fit of 12, 16, 18, 9 rows over four consecutive months: slope -0.0745
            "growth_pct_per_month": -7.2,
            "anomalies": misaligned, "self_checks_failed": [],
        },
        "active_tasks": {
            # L1-L9 and H6 hold 11; M1 adds its MAP node (WAITING, created 1190 s ago) and items
            # 3 (RUNNING), 4 and 5 (PENDING), P1 its SUB_WORKFLOW node (WAITING, 590 s), C1 its
            # pay_back (PENDING, 590 s): 4 new groups (MAP x 3 states, SUB_WORKFLOW).
            "active": 17, "by_state": {"PENDING": 6, "RUNNING": 6, "WAITING": 5}, "groups": 11,
            "histogram": {"< 1 min": 0, "1-5 min": 1, "5-15 min": 5, "15-60 min": 7, "1-6 h": 1, "6-24 h": 1,
                          "> 1 day": 2},
            "top_run": runs["M1"], "top_run_active": 4, "runs_with_active_tasks": 13,
            # M1's item 4 is dispatched, item 5 held back by max_parallel 2 (6 items, 5 started).
            "map_items": {"payments": {"running": 1, "dispatched": 1, "held": 1}},
            "outbox": {"payments": {"rows": 3, "ready": 3, "delayed": 0},
                       "reports": {"rows": 2, "ready": 1, "delayed": 1}},
            "long_waits": [[runs["H6"], "delivered", "delivered"]], "long_waits_total": 1,
            # Every active task's node is in its run's definition (H12's missing v3 has no active
            # task: run_investigation flags it; odd_definitions adds some).
            "definition_mismatches": 0,
            "anomalies": no_lease, "self_checks_failed": [],
        },
        "lease_expiries": {
            # M1's item 3 is the sixth RUNNING task: worker-a's, expiring in 25 min.
            "running": 6, "expired": 2,
            "owners": {"(none)": {"running": 1, "expired": 0}, "worker-a": {"running": 3, "expired": 0},
                       "worker-b": {"running": 2, "expired": 2}},
            "suspect_dead": ["worker-b"], "most_overdue_run": runs["L7"],
            "buckets": {"expired > 1 h ago": 1, "expired 5-60 min ago": 1, "expired < 5 min ago": 0,
                        "expires in < 1 min": 0, "expires in 1-5 min": 0, "expires in 5-30 min": 2,
                        "expires in > 30 min": 1, "no lease": 1},
            "odd_leases": {"without": 1, "infinite": 0},      # L9's charge has no lease
            "attempts": {"0": 14, "1": 2, "2": 1},
            "requeues": [[runs["L6"], "extract_a", "connection reset by peer"],
                         [runs["L2"], "charge", "card processor timeout"]],
            "anomalies": no_lease, "self_checks_failed": [],
        },
        "retention_dry_run": {
            "drop": ["202501", "202503"],          # 202412 is refused: its bounds are not its name's
            "keep_active": {"202502": [runs["H6"]], "202504": [runs["H12"]]},
            "too_new": [cur, *ahead], "rows_reclaimed": 30,
            "anomalies": misaligned, "self_checks_failed": [],
        },
        "run_investigation": {
            "run_id": info.story_run, "status": "FAILED", "tasks": 8, "nodes": 8, "edges": 7, "retries": 3,
            "failed_nodes": ["notify"], "skipped_nodes": ["standard"],
            "signals": {"consumed": 1, "buffered": 1}, "webhook_delivered": True,
            "map_items": {}, "slowest_items": {}, "links": [],
            # The seed writes no run history: no attempt is recorded (tests/integration/test_history.py
            # checks these figures on a run that lived through a killed worker).
            "attempts": 0, "lost_leases": [], "history": {},
            "error": "node notify failed: smtp 550 mailbox unavailable",
            "anomalies": [f"task for a node not in its definition: run {info.story_run}, node legacy_audit"],
            "self_checks_failed": [],
        },
        **runbook_figures(info),
    }


def investigation_figures(info: SeedInfo) -> dict[str, dict[str, Any]]:
    """The figures run_investigation must show for the MAP and SUB_WORKFLOW runs of
    :func:`_fanout`, by run label (the notebook's ``run_id`` parameter)."""
    runs = info.runs

    def story(label: str, status: str, tasks: int, nodes: int, edges: int, **figures: Any) -> dict[str, Any]:
        return {"run_id": runs[label], "status": status, "tasks": tasks, "nodes": nodes, "edges": edges,
                "retries": 0, "failed_nodes": [], "skipped_nodes": [], "signals": {}, "webhook_delivered": False,
                "attempts": 0, "lost_leases": [], "history": {}, "error": None, "anomalies": [],
                "self_checks_failed": [], "map_items": {}, "slowest_items": {}, "links": [], **figures}

    return {
        # The MAP node is one task of the story (items are not): list and charge_all reached.
        "M1": story("M1", "RUNNING", 2, 3, 2,
                    map_items={"charge_all": {"COMPLETED": 2, "FAILED": 1, "RUNNING": 1, "PENDING": 2}},
                    slowest_items={"charge_all": [2, 900.0]}),
        "P1": story("P1", "RUNNING", 2, 3, 2, history={"child_started": 1},
                    links=[["child", "refund", runs["C1"], "RUNNING"]]),
        "C1": story("C1", "RUNNING", 1, 1, 0, links=[["parent", "refund", runs["P1"], "RUNNING"]]),
        # Counters of 3 done items over 2 item rows: flagged, the report still renders.
        "M9": story("M9", "SUCCEEDED", 3, 3, 2, map_items={"charge_all": {"COMPLETED": 2}},
                    slowest_items={"charge_all": [0, 489.0]},
                    anomalies=[f"MAP counters disagree with its items: run {runs['M9']}, node charge_all"]),
    }


def runbook_figures(info: SeedInfo) -> dict[str, dict[str, Any]]:
    """The figures each runbook (notebooks/runbooks/) must show for :func:`seed`'s content
    with its default parameters, diagnosing and planning only (``confirm=False``)."""
    runs = info.runs
    dry: dict[str, Any] = {"confirm": False, "acted": False, "refused": None, "did": []}
    lost = sorted([runs["L2"], runs["L7"]])          # worker-b's leases, both expired
    tables = ("workflow_runs", "task_instances", "workflow_events", "run_history")
    return {
        "sweeper_lag": {"alert": True, "expired": lost, "suspect_dead": ["worker-b"], "plan": lost, "act": dry},
        # The seed's timers (L4's cool_off, L5's delivered timeout) are not due yet; no dispatch has a
        # schedule_to_start deadline.
        "timers_overdue": {"alert": False, "due": 0, "late": 0, "plan": [], "starts_due": 0, "start_plan": [],
                           "act": dry},
        "dead_worker": {"dead": [], "suspect_dead": ["worker-b"], "plan": lost, "act": dry},
        "partitions_ahead": {"alert": False, "months_ahead": dict.fromkeys(tables, 3), "plan": [], "act": dry},
        # L8's charge (payments) and L6's extract_b (reports) are ready; the seed registers no worker.
        "outbox_ready": {"alert": True, "plan": {"payments": 0, "reports": 0}, "act": dry},
        "retention_blocked": {"alert": True, "blocked": {"202502": [runs["H6"]], "202504": [runs["H12"]]},
                              "plan": sorted([runs["H6"], runs["H12"]]), "act": dry},
        "long_waits": {"alert": True, "waits": [[runs["H6"], "delivered", "delivered"]], "total": 1, "plan": [],
                       "act": dry},
        "failing_webhooks": {"alert": False, "failing": [], "plan": [], "act": dry},
        "replay_lag": {"alert": False, "standby": False, "plan": [], "act": dry},
        # The seed's FAILED runs (H7, H9) are from 2025: none in the default window of 7 days.
        "replay_failed": {"failed": [], "plan": [], "act": dry},
        # The seed sets no queue: none is paused, and with no queue named nothing is planned.
        "downstream_overloaded": {"alert": False, "paused": [], "plan": [], "act": dry},
        # 25 runs, the newest by run ID is L9 (the current month's IDs are its first instant + k s; M1, P1,
        # C1 and M9 sit between L8 and L9).
        "find_run": {"found": 20, "newest": runs["L9"], "act": dry},
        # The seed has no schedule.
        "schedule_late": {"alert": False, "plan": {}, "act": dry},
    }
