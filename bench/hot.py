"""HOT updates and index writes on ``task_instances``, before and after V005.

Two fresh databases, both migrated to the latest migration (the engine's statements
need all of it), one then given V004's layout of ``task_instances`` back (the lease
index on ``lease_expires_at``, fillfactor 100: what V005 changed), run the same three
phases through the Engine API (the statements the workers and the shell run), on one
session each:

- ``steady``: N 1-task runs started, claimed (4 at a time) and completed: the no-op
  workload of the throughput benchmark;
- ``long_tasks``: the same with 3 heartbeats per task between claim and completion;
- ``heartbeats``: M tasks claimed, then 3 rounds of heartbeats over all of them.

Per phase: row writes (inserts + updates), the HOT share of updates
(pg_stat_user_tables), index entries written (B-tree leaf inserts found in the WAL
with pg_waldump, per index; only when the server's data directory is readable, i.e.
the embedded server) and index buffer accesses (pg_statio_user_indexes: reads and
writes together), all summed over the task_instances partitions.

It also EXPLAINs the lease sweeper's and the timer loop's statements, captured from
the repository functions themselves, on a seeded table (200,000 tasks, one run in
20 still active) after ANALYZE, for both schemas.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from typing import Any, cast

import psycopg
from psycopg import sql

from composer_ops.testing.servers import Server

SPEC = {"id": "bench-hot", "nodes": [{"id": "work", "type": "TASK", "task": "noop", "lease_s": 300}]}

_STATS = """
SELECT COALESCE(sum(n_tup_ins), 0)::bigint, COALESCE(sum(n_tup_upd), 0)::bigint,
       COALESCE(sum(n_tup_hot_upd), 0)::bigint,
       (SELECT COALESCE(sum(idx_blks_hit + idx_blks_read), 0)::bigint
          FROM pg_statio_user_indexes x JOIN pg_inherits i ON i.inhrelid = x.relid
         WHERE i.inhparent = 'task_instances'::regclass),
       pg_current_wal_insert_lsn()::text
  FROM pg_stat_user_tables s JOIN pg_inherits i ON i.inhrelid = s.relid
 WHERE i.inhparent = 'task_instances'::regclass
"""

_RELFILES = """
SELECT pg_relation_filenode(c.oid)::text, c.relkind::text,
       COALESCE((SELECT p.relname::text FROM pg_inherits ii JOIN pg_class p ON p.oid = ii.inhparent
                  WHERE ii.inhrelid = c.oid), c.relname::text)
  FROM pg_class c
 WHERE c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'task_instances'::regclass)
    OR c.oid IN (SELECT x.indexrelid FROM pg_index x JOIN pg_inherits i ON i.inhrelid = x.indrelid
                  WHERE i.inhparent = 'task_instances'::regclass)
"""

_RECORD = re.compile(r"rmgr: (\w+)\s.*?desc: (\S+)(.*?)blkref #0: rel \d+/(\d+)/(\d+)")
#: B-tree records that add an entry to a leaf page (a leaf split carries its new item).
_LEAF_INSERTS = {"INSERT_LEAF", "INSERT_POST", "SPLIT_L", "SPLIT_R"}


def _stats(url: str) -> tuple[int, int, int, int, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row: Any = conn.execute(_STATS).fetchone()
    return int(row[0]), int(row[1]), int(row[2]), int(row[3]), str(row[4])


def _flush(engine: Any) -> None:
    """Publish the engine session's pending statistics now (PostgreSQL 15+)."""
    with engine.pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_stat_force_next_flush()")


def _wal_index_inserts(server: Server, url: str, start: str, end: str) -> dict[str, Any] | None:
    """Index leaf inserts and heap records per task_instances relation between two LSNs."""
    if server.data_dir is None or server.bin_dir is None or not (server.bin_dir / "pg_waldump").exists():
        return None
    with psycopg.connect(url) as conn:
        oid_row = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
        assert oid_row is not None
        db_oid = str(oid_row[0])
        files = {f: (kind, name) for f, kind, name in conn.execute(_RELFILES).fetchall()}
    out = subprocess.run([str(server.bin_dir / "pg_waldump"), "-p", str(server.data_dir / "pg_wal"),
                          "-s", start, "-e", end], capture_output=True, text=True, check=False)
    per_index: Counter[str] = Counter()
    heap: Counter[str] = Counter()
    for line in out.stdout.splitlines():
        m = _RECORD.search(line)
        if not m or m.group(4) != db_oid or m.group(5) not in files:
            continue
        rmgr, desc, rest, _, filenode = m.groups()
        kind, name = files[filenode]
        if rmgr == "Btree" and desc in _LEAF_INSERTS and (not desc.startswith("SPLIT") or "level: 0" in rest):
            per_index[name] += 1
        elif rmgr in ("Heap", "Heap2") and kind == "r":
            heap[desc.split("+")[0]] += 1
    return {"per_index": dict(per_index), "total": sum(per_index.values()), "heap_records": dict(heap)}


def _phase(server: Server, url: str, engine: Any, name: str, body: Any) -> dict[str, Any]:
    _flush(engine)
    ins0, upd0, hot0, idx0, lsn0 = _stats(url)
    body()
    _flush(engine)
    ins1, upd1, hot1, idx1, lsn1 = _stats(url)
    with psycopg.connect(url) as conn:
        diff = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", (lsn1, lsn0)).fetchone()
        assert diff is not None
        wal_bytes = int(diff[0])
    writes = (ins1 - ins0) + (upd1 - upd0)
    wal = _wal_index_inserts(server, url, lsn0, lsn1)
    return {
        "phase": name, "inserts": ins1 - ins0, "updates": upd1 - upd0, "hot_updates": hot1 - hot0,
        "hot_ratio": (hot1 - hot0) / (upd1 - upd0) if upd1 > upd0 else None,
        "row_writes": writes,
        "index_writes": wal["total"] if wal else None,
        "index_writes_per_row_write": wal["total"] / writes if wal and writes else None,
        "index_writes_by_index": wal["per_index"] if wal else None,
        "heap_wal_records": wal["heap_records"] if wal else None,
        "index_buffer_accesses_per_row_write": (idx1 - idx0) / writes if writes else None,
        "wal_bytes_per_row_write": wal_bytes / writes if writes else None,
    }


def _workload(engine: Any, runs: int, beats: int) -> None:
    for _ in range(runs):
        engine.start(SPEC["id"])
    while True:
        claims = engine.claim(["default"], "bench-hot", 4, task_names=["noop"])
        if not claims:
            return
        for _ in range(beats):
            for c in claims:
                if engine.heartbeat(c) is None:
                    raise RuntimeError("lease lost during the HOT benchmark")
        for c in claims:
            engine.complete(c, {"ok": True})


def _heartbeats(engine: Any, tasks: int, rounds: int) -> Any:
    for _ in range(tasks):
        engine.start(SPEC["id"])
    claims = engine.claim(["default"], "bench-hot", tasks, task_names=["noop"])

    def beat() -> None:
        for _ in range(rounds):
            for c in claims:
                if engine.heartbeat(c) is None:
                    raise RuntimeError("lease lost during the HOT benchmark")

    return beat, claims


def _schema(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        indexes = [r[0] for r in conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'task_instances' ORDER BY indexname").fetchall()]
        ff = conn.execute("""SELECT DISTINCT COALESCE((SELECT option_value FROM pg_options_to_table(c.reloptions)
                                                        WHERE option_name = 'fillfactor'), '100')
                               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                              WHERE i.inhparent = 'task_instances'::regclass""").fetchall()
        version = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
    return {"migration": version[0] if version else None, "indexes": indexes,
            "fillfactor": sorted(str(r[0]) for r in ff)}


#: V004's lease index on the latest schema, in place of the one V005 made.
_V004_INDEXES = """
CREATE INDEX IF NOT EXISTS idx_task_instances_running_lease
    ON task_instances (lease_expires_at) WHERE state = 'RUNNING';
DROP INDEX IF EXISTS idx_task_instances_running;
"""


def _v004_layout(conn: psycopg.Connection[Any]) -> None:
    """V004's layout of task_instances on the latest schema: the lease index V005
    replaced, and fillfactor 100 on every partition (the repository lists them)."""
    from composer_ops.repo import partitions

    conn.execute(_V004_INDEXES)
    for part in partitions.list_partitions(conn):
        if part.table == "task_instances":
            conn.execute(sql.SQL("ALTER TABLE {} SET (fillfactor = 100)").format(sql.Identifier(part.name)))


def _create(server: Server, db: str, v004_layout: bool) -> str:
    from composer_ops.db.migrate import migrate

    url = server.create_database(db)
    migrate(url)
    if v004_layout:
        with psycopg.connect(url, autocommit=True) as conn:
            _v004_layout(conn)
    return url


def measure_schema(server: Server, label: str, v004_layout: bool, *, runs: int, tasks: int,
                   rounds: int = 3) -> dict[str, Any]:
    from composer_ops import Engine

    db = f"bench_hot_{label}"
    url = _create(server, db, v004_layout)
    try:
        with Engine.connect(url, pool_size=1, application_name="bench-hot") as engine:
            engine.deploy(SPEC)
            phases = [_phase(server, url, engine, "steady", lambda: _workload(engine, runs, 0)),
                      _phase(server, url, engine, "long_tasks", lambda: _workload(engine, runs // 2, 3))]
            beat, claims = _heartbeats(engine, tasks, rounds)
            phases.append(_phase(server, url, engine, "heartbeats", beat))
            for c in claims:
                engine.complete(c, None)
        return {"label": label, "schema": _schema(url), "phases": {p["phase"]: p for p in phases},
                "explain": explain(server, label, v004_layout)}
    finally:
        server.drop_database(db)


#: ``runs`` runs of 10 tasks of workflow ``workflow`` (deployed first), 1 in 20 still
#: active (per active run: 1 RUNNING task leased to one of ``owners`` workers, 3 PENDING,
#: 1 WAITING); the others finished. Used by :func:`explain` and by
#: tests/integration/test_hot_updates.py, which asserts the same plans.
SEED = """
WITH runs AS (
    SELECT g, lpad(to_hex((extract(epoch FROM now()) * 1000)::bigint + g), 12, '0') AS h, md5(g::text) AS m
      FROM generate_series(1, %(runs)s) g),
ins AS (
    INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status)
    SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(m, 1, 3) || '-8' || substr(m, 4, 3)
           || '-' || substr(m, 7, 12), %(workflow)s, 1, CASE WHEN g %% 20 = 0 THEN 'RUNNING' ELSE 'SUCCEEDED' END
      FROM runs
    RETURNING id, status)
INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state, lease_owner, lease_expires_at, wake_at,
                            output_json)
SELECT ins.id || '-' || n, ins.id, 'n' || n, CASE WHEN n = 9 THEN 'WAIT' ELSE 'TASK' END, 'default', s.state,
       CASE WHEN s.state = 'RUNNING' THEN 'worker-' || abs(hashtext(ins.id)) %% %(owners)s END,
       CASE WHEN s.state = 'RUNNING' THEN now() + make_interval(secs => abs(hashtext(ins.id)) %% 60 - 20) END,
       CASE WHEN s.state = 'WAITING' THEN now() + make_interval(secs => abs(hashtext(ins.id)) %% 120 - 60) END,
       CASE WHEN s.state = 'COMPLETED' THEN '{"ok": true}'::jsonb END
  FROM ins, generate_series(0, 9) n,
       LATERAL (SELECT CASE WHEN ins.status = 'SUCCEEDED' THEN 'COMPLETED'
                            WHEN n = 0 THEN 'RUNNING' WHEN n = 9 THEN 'WAITING'
                            WHEN n < 4 THEN 'PENDING' ELSE 'COMPLETED' END AS state) s
"""


class StatementCapture:
    """Stands in for a connection and records the statement a repository function runs."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def cursor(self, **_: Any) -> StatementCapture:
        return self

    def __enter__(self) -> StatementCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def execute(self, query: str, params: Any = None, **_options: Any) -> StatementCapture:
        self.statements.append((query, params))
        return self

    def fetchall(self) -> list[Any]:
        return []

    def as_connection(self) -> psycopg.Connection[Any]:
        """This capture, typed as the connection the repository functions take.

        A duck-typed stand-in: it has only what ``fetch_all`` uses (``cursor(row_factory=...)``
        as a context manager, ``execute``, ``fetchall``), which is all the captured
        functions (``tasks.expired_leases``, ``signals.due_waits``) call."""
        return cast("psycopg.Connection[Any]", self)


def explain(server: Server, label: str, v004_layout: bool, runs: int = 20000) -> dict[str, list[str]]:
    """EXPLAIN (ANALYZE) of the sweeper's and the timer's statements on a seeded table."""
    from composer_ops import Engine
    from composer_ops.repo import clock, signals, tasks

    db = f"bench_explain_{label}"
    url = _create(server, db, v004_layout)
    try:
        with Engine.connect(url, pool_size=1) as engine:
            engine.deploy(SPEC)
        plans: dict[str, list[str]] = {}
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SEED, {"runs": runs, "workflow": SPEC["id"], "owners": 8})
            conn.execute("ANALYZE workflow_runs")
            conn.execute("ANALYZE task_instances")
            for name, fn in (("expired_leases", tasks.expired_leases), ("due_waits", signals.due_waits)):
                capture = StatementCapture()
                fn(capture.as_connection(), 100, now=clock.now(conn))
                query, params = capture.statements[0]
                rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY OFF) " + query,
                                    params).fetchall()
                plans[name] = [str(r[0]) for r in rows]
        return plans
    finally:
        server.drop_database(db)


def measure(server: Server, *, runs: int = 1000, tasks: int = 1000) -> dict[str, Any]:
    before = measure_schema(server, "v004", True, runs=runs, tasks=tasks)
    after = measure_schema(server, "latest", False, runs=runs, tasks=tasks)
    return {"before": before, "after": after,
            "heartbeat_hot_ratio_before": before["phases"]["heartbeats"]["hot_ratio"],
            "heartbeat_hot_ratio": after["phases"]["heartbeats"]["hot_ratio"]}
