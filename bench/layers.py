"""The cost of the function layers: the server's CPU for each event of a 1-task run, in the engine's
functions against the same rows written by plain prepared statements.

``python -m bench.layers [--pgbin DIR [--fsync off]] [--runs 200] [--rounds 4] [--out FILE]``

A design measurement, not a second engine. The engine writes a claim through PL/pgSQL
functions (``composer_claim``, sql/R__claim.sql), and wrote a start and a completion
through ``composer_apply`` until 2026-12-05 (now one statement it prepares,
composer_ops/repo/writes.py; the completion's lock and load is still a function). Here the same row
writes (a start: the run, its task, the outbox row and the 'started' history row; a
claim: the outbox row deleted, the task leased, the 'claimed' history row; a
completion: the run locked and read with its tasks, the task completed, the
'completed' history row, the run finished) are made again by plain statements that
psycopg prepares, naming the month's partitions, with the checks the engine's make on
this path (the definition, the claim's advisory lock and fence, the queue's pause,
the run not deleted, the fenced task update) and the start's wake-up read of
``task_waiters`` and notification; the completion as three statements in a
transaction (its BEGIN and COMMIT included), pipelined into two round trips as the
engine's (since 2026-12-06; before, one round trip each). What it leaves out: the engine's
decisions (the pure core, on the client), flow control beyond a paused queue, more
than one queue or month per claim, retries, and the hand-off of wake-ups to registered
workers (none is registered here, so neither side hands any out). A sketch, not a
replacement: its claim checks the fence in the snapshot its advisory lock was taken in
(the engine's looks again after the lock). Its start writes the rows the engine's
writes for this workflow (no ``max_run_s``, no 'started' detail: bench-one has neither).

Each round runs ``--runs`` starts, then claims (one task each), then completions,
each event by the engine (one pooled connection) and by the plain statements (a
connection of their own), which goes first alternating by round; then, plain only,
``--runs`` completions each making the next claim in its own transaction (a sketch of
claim-on-complete). Each block is measured as its session's backend time on a CPU
(``/proc/PID/schedstat``). Prints the medians per event, their ratio, the sum per run,
and the completion with its claim against the two apart; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from rich.table import Table

from bench import scenario
from bench.flowcost import OnCpu
from bench.report import measured_run, parser, publish, require_binaries, stderr_log
from bench.workload import ONE_TASK, make_template
from composer_ops.core.runids import month_of
from composer_ops.engine.ids import uuid7_text
from composer_ops.testing import servers
from composer_ops.testing.servers import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
EVENTS = ("start", "claim", "complete")
WARM = 10

START = """
WITH d AS (
    SELECT 1 FROM workflow_definitions
     WHERE id = %(wf)s AND version = %(version)s AND enabled AND deleted_at IS NULL
), r AS (
    INSERT INTO workflow_runs_p{m} (id, workflow_definition_id, workflow_version, status, context_json,
                                    created_at, updated_at)
    SELECT %(run)s, %(wf)s, %(version)s, 'RUNNING', %(context)s, now(), now() FROM d
    ON CONFLICT (id) DO NOTHING
    RETURNING id
), t AS (
    INSERT INTO task_instances_p{m} (id, run_id, node_id, node_type, queue, state, input_json, scheduled_at,
                                     created_at, updated_at)
    SELECT %(task)s, r.id, 'work', 'TASK', 'default', 'PENDING', '{{}}', now(), now(), now() FROM r
    RETURNING run_id, id
), o AS (
    INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at, created_at, priority)
    SELECT 'default', t.run_id, t.id, 0, 'noop', 30, now(), now(), 0 FROM t
    RETURNING id
), h AS (
    INSERT INTO run_history_p{m} (run_id, at, kind, request) SELECT r.id, now(), 'started', %(request)s FROM r
), w AS (
    SELECT x.worker FROM task_waiters x
     WHERE x.slots > x.promised - x.seen AND x.queues && ARRAY['default']
     ORDER BY x.since DESC LIMIT 1
       FOR UPDATE SKIP LOCKED
)
SELECT (SELECT count(*) FROM o) AS written, (SELECT count(*) FROM w) AS waiters, pg_notify('composer_tasks', 'default')
"""

CLAIM = """
WITH l AS (
    SELECT pg_advisory_xact_lock(hashtext('composer_claim'), hashtext(%(claim)s))
), go AS (
    SELECT NOT EXISTS (SELECT 1 FROM claim_fences f WHERE f.claim = %(claim)s)
           AND NOT COALESCE((SELECT s.paused FROM queue_settings s WHERE s.queue = 'default'), false) AS ok
      FROM l
), o AS (
    DELETE FROM task_outbox
     WHERE id = (SELECT id FROM task_outbox
                  WHERE queue = 'default' AND available_at <= now() AND task_name = ANY(%(names)s)
                  ORDER BY priority DESC, available_at, id LIMIT 1
                    FOR UPDATE SKIP LOCKED)
       AND (SELECT ok FROM go)
    RETURNING run_id, task_id, attempt, task_name, lease_s, max_run_s, queue
), t AS (
    UPDATE task_instances_p{m} t
       SET state = 'RUNNING', lease_owner = %(owner)s,
           lease_expires_at = now() + make_interval(secs => LEAST(o.lease_s, o.max_run_s)),
           run_deadline_at = now() + make_interval(secs => o.max_run_s), started_at = now(), updated_at = now()
      FROM o
     WHERE t.run_id = o.run_id AND t.id = o.task_id AND t.attempt = o.attempt AND t.state IN ('PENDING', 'QUEUED')
       AND NOT EXISTS (SELECT 1 FROM workflow_runs_p{m} r WHERE r.id = o.run_id AND r.deleted_at IS NOT NULL)
    RETURNING t.run_id, t.id AS task_id, t.node_id, t.attempt, o.task_name, o.queue, t.input_json,
              LEAST(o.lease_s, o.max_run_s) AS lease_s, t.lease_owner, t.lease_expires_at
), h AS (
    INSERT INTO run_history_p{m} (run_id, kind, node_id, task_id, attempt, worker, request, detail)
    SELECT t.run_id, 'claimed', t.node_id, t.task_id, t.attempt, t.lease_owner, %(claim)s,
           jsonb_build_object('task', t.task_name, 'lease_s', t.lease_s)
      FROM t
)
SELECT run_id, task_id, attempt FROM t
"""

#: The engine's claim of one task of queue 'default' (sql/R__claim.sql), to format with
#: the function's name, ``channel`` and ``seen``. NULL and NULL: without registering (as
#: a caller that is not a listening worker claims); a worker's own claims, its reports'
#: included, name its channel and register.
ENGINE_CLAIM = ("SELECT run_id, task_id, attempt FROM {fn}(ARRAY['default'], %(names)s, %(owner)s, 1, %(claim)s, "
                "{channel}, 1, {seen}, NULL, false)")

LOCK = """
SELECT now(), r.id, r.workflow_definition_id, r.workflow_version, r.status, r.context_json
  FROM workflow_runs_p{m} r WHERE r.id = %(run)s AND r.deleted_at IS NULL
   FOR UPDATE
"""

LOAD = """
SELECT node_id, id, state, attempt, branches, signal_name, lease_owner, lease_expires_at, created_at, wake_at,
       lease_expiries, items_total, items_started, items_done, items_failed
  FROM task_instances_p{m} WHERE run_id = %(run)s
"""

FINISH = """
WITH t AS (
    UPDATE task_instances_p{m} t
       SET state = 'COMPLETED', output_json = %(output)s, completed_at = now(), finished_at = now(),
           updated_at = now(), lease_owner = NULL, lease_expires_at = NULL
     WHERE t.run_id = %(run)s AND t.id = %(task)s AND t.node_id = 'work' AND t.attempt = %(attempt)s
       AND t.state IN ('PENDING', 'QUEUED', 'RUNNING')
    RETURNING t.run_id
), h AS (
    INSERT INTO run_history_p{m} (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
    SELECT t.run_id, now(), 'completed', 'work', %(task)s, %(attempt)s, %(owner)s, %(request)s,
           '{{"finished": "SUCCEEDED"}}'
      FROM t
), f AS (
    UPDATE workflow_runs_p{m} r
       SET status = 'SUCCEEDED', output_json = %(result)s, completed_at = now(), updated_at = now()
     WHERE r.id = %(run)s AND r.status IN ('PENDING', 'RUNNING') AND EXISTS (SELECT 1 FROM t)
    RETURNING r.id
)
SELECT (SELECT count(*) FROM t) AS tasks, (SELECT count(*) FROM f) AS runs,
       CASE WHEN (SELECT count(*) FROM t) = 1 AND (SELECT count(*) FROM f) = 1 THEN 'ok'
            ELSE composer_fail('CO409', 'plain completion: the task or the run was not where it was claimed')
       END AS ok
"""


#: A claimed task: (run ID, task ID, attempt).
Claimed = tuple[str, str, int]


def _id() -> str:
    return uuid7_text()


class Plain:
    """The three events as plain prepared statements, on a connection of their own."""

    def __init__(self, url: str, *, application_name: str = "bench-layers-plain", engine_claim: bool = False) -> None:
        """``engine_claim``: claims (and a completion's next claim) by the engine's
        ``composer_claim`` (:data:`ENGINE_CLAIM`) instead of the plain statement."""
        self.auto = psycopg.connect(url, autocommit=True, application_name=application_name)
        self._claim = ENGINE_CLAIM.format(fn="composer_claim", channel="NULL", seen="NULL") if engine_claim else CLAIM
        try:
            self.pid = int(self.auto.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            # What the engine's claim sets for its own statements (sql/R__claim.sql): the pick
            # follows the outbox index's order rather than reading and sorting the backlog.
            for setting in ("enable_seqscan", "enable_bitmapscan", "jit"):
                self.auto.execute(f"SET {setting} = off")
            row = self.auto.execute("SELECT version FROM workflow_definitions WHERE id = %s "
                                    "ORDER BY version DESC LIMIT 1", (ONE_TASK["id"],)).fetchone()
        except BaseException:
            self.auto.close()
            raise
        if row is None:
            self.auto.close()
            raise RuntimeError(f"{ONE_TASK['id']} is not deployed")
        self.version = int(row[0])
        self.month = month_of(_id())
        #: the statements name this month's partitions: past its end (UTC) they would miss
        year, month = int(self.month[:4]), int(self.month[4:])
        self._month_ends = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC).timestamp()

    def _sql(self, text: str) -> str:
        if time.time() >= self._month_ends:
            raise RuntimeError(f"the month turned during the measurement (its statements name {self.month}'s "
                               "partitions)")
        return text.format(m=self.month)

    def start(self) -> None:
        run = _id()
        row = self.auto.execute(self._sql(START), {
            "wf": ONE_TASK["id"], "version": self.version, "run": run, "task": _id(),
            "context": Jsonb({"input": None, "config": {}}), "request": _id()}, prepare=True).fetchone()
        if row is None or row[0] != 1:
            raise RuntimeError(f"plain start of {run} wrote {row}")

    def claim(self, owner: str = "bench-layers") -> Claimed | None:
        """One ready task leased to ``owner``, or None when none is ready."""
        row = self.auto.execute(self._sql(self._claim), {"claim": _id(), "names": ["noop"], "owner": owner},
                                prepare=True).fetchone()
        return None if row is None else (str(row[0]), str(row[1]), int(row[2]))

    def complete(self, claimed: Claimed, *, owner: str = "bench-layers", then_claim: bool = False) -> Claimed | None:
        """The completion of ``claimed`` in two round trips (the run locked and read; the
        writes and the commit), as the engine's; ``then_claim``: the next claim made in
        its transaction, returned."""
        run, task, attempt = claimed
        conn = self.auto
        with conn.pipeline() as pipe, conn.transaction():
            locked = conn.execute(self._sql(LOCK), {"run": run}, prepare=True)
            loaded = conn.execute(self._sql(LOAD), {"run": run}, prepare=True)
            pipe.sync()
            if locked.fetchone() is None:
                raise RuntimeError(f"plain completion: run {run} is missing")
            loaded.fetchall()
            written = conn.execute(self._sql(FINISH), {
                "run": run, "task": task, "attempt": attempt, "owner": owner, "request": _id(),
                "output": Jsonb(None), "result": Jsonb({"work": None})}, prepare=True)
            nxt = conn.execute(self._sql(self._claim), {"claim": _id(), "names": ["noop"], "owner": owner},
                               prepare=True) if then_claim else None
        row = written.fetchone()      # (a write that matched nothing failed in the statement: rolled back)
        if row is None or row[:2] != (1, 1):
            raise RuntimeError(f"plain completion of {run} wrote {row}")
        got = None if nxt is None else nxt.fetchone()
        return None if got is None else (str(got[0]), str(got[1]), int(got[2]))

    def close(self) -> None:
        self.auto.close()


def measure(server: Server, template: str, *, runs: int = 200, rounds: int = 4,
            log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """``rounds`` rounds of ``runs`` of each event per side on a database cloned from
    ``template``: the per-round server ms per event of each side, their medians and ratio."""
    from composer_ops import Engine

    db = "bench_layers"
    url = server.create_database(db, template=template)
    try:
        with Engine.connect(url, pool_size=1, application_name="bench-layers-engine") as engine:
            with engine.pool.connection() as conn:
                engine_cpu = OnCpu(int(conn.execute("SELECT pg_backend_pid()").fetchone()[0]))  # type: ignore[index]
            plain = Plain(url)
            try:
                plain_cpu = OnCpu(plain.pid)
                claims: list[Any] = []

                def engine_start() -> None:
                    engine.start(ONE_TASK["id"])

                def engine_claim() -> None:
                    got = engine.claim(["default"], "bench-layers", 1, task_names=["noop"])
                    if len(got) != 1:
                        raise RuntimeError(f"engine claim took {len(got)} tasks, not 1")
                    claims.extend(got)

                def engine_complete() -> None:
                    engine.complete(claims.pop(), None)

                held: list[Claimed] = []

                def plain_claim() -> None:
                    got = plain.claim()
                    if got is None:
                        raise RuntimeError("plain claim took no task")
                    held.append(got)

                def plain_complete(then_claim: bool = False) -> None:
                    got = plain.complete(held.pop(), then_claim=then_claim)
                    if then_claim:
                        if got is None:
                            raise RuntimeError("plain completion claimed no next task")
                        held.insert(0, got)

                sides: dict[str, dict[str, Callable[[], None]]] = {
                    "engine": {"start": engine_start, "claim": engine_claim, "complete": engine_complete},
                    "plain": {"start": plain.start, "claim": plain_claim, "complete": plain_complete}}
                cpus = {"engine": engine_cpu, "plain": plain_cpu}
                for event in EVENTS:         # warm: plans cached, statements prepared
                    for name in sides:
                        for _ in range(WARM):
                            sides[name][event]()
                per: dict[str, dict[str, list[float]]] = {n: {e: [] for e in EVENTS} for n in sides}
                together: list[float] = []
                for r in range(rounds):
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for event in EVENTS:
                        for name in order:
                            cpu0 = cpus[name].seconds()
                            for _ in range(runs):
                                sides[name][event]()
                            per[name][event].append((cpus[name].seconds() - cpu0) / runs * 1e3)
                    # A completion that makes the next claim in its transaction: runs
                    # claimed in hand and as many ready, then completed afterwards.
                    for _ in range(2 * runs):
                        plain.start()
                    for _ in range(runs):
                        plain_claim()
                    cpu0 = plain_cpu.seconds()
                    for _ in range(runs):
                        plain_complete(then_claim=True)
                    together.append((plain_cpu.seconds() - cpu0) / runs * 1e3)
                    for _ in range(runs):
                        plain_complete()
                    log(f"round {r + 1} of {rounds}: " + ", ".join(
                        f"{e} {per['engine'][e][-1]:.3f}/{per['plain'][e][-1]:.3f}" for e in EVENTS)
                        + f", plain completion and claim together {together[-1]:.3f}")
            finally:
                plain.close()
        with psycopg.connect(url, autocommit=True) as check:
            row = check.execute("SELECT count(*) FILTER (WHERE status = 'SUCCEEDED'), count(*) FROM workflow_runs"
                               ).fetchone()
            left = check.execute("SELECT count(*) FROM task_outbox").fetchone()
        expected = 2 * (WARM + runs * rounds) + 2 * runs * rounds
        if row != (expected, expected) or left != (0,):
            raise RuntimeError(f"runs succeeded/all {row}, outbox rows left {left}; expected {expected} and none")
    finally:
        server.drop_database(db)
    medians = {n: {e: statistics.median(v) for e, v in events.items()} for n, events in per.items()}
    return {"runs": runs, "rounds": rounds, "server_ms_per_event": per, "median": medians,
            "per_run": {n: sum(m.values()) for n, m in medians.items()},
            "plain_over_engine": {e: medians["plain"][e] / medians["engine"][e] for e in EVENTS},
            "plain_over_engine_per_run": sum(medians["plain"].values()) / sum(medians["engine"].values()),
            "plain_complete_and_claim_together": together,
            "together_over_apart": statistics.median(together) / (medians["plain"]["complete"]
                                                                   + medians["plain"]["claim"])}


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"server CPU ms per event, medians of {result['rounds']} rounds of {result['runs']} "
                    f"(PostgreSQL {result.get('server_version', '?')}, fsync {result.get('fsync', '?')})")
    for col in ("event", "engine", "plain statements", "plain / engine"):
        t.add_column(col, justify="left" if col == "event" else "right")
    for e in EVENTS:
        t.add_row(e, f"{result['median']['engine'][e]:.3f}", f"{result['median']['plain'][e]:.3f}",
                  f"{result['plain_over_engine'][e]:.2f}")
    t.add_row("a run", f"{result['per_run']['engine']:.3f}", f"{result['per_run']['plain']:.3f}",
              f"{result['plain_over_engine_per_run']:.2f}")
    together = statistics.median(result["plain_complete_and_claim_together"])
    t.add_row("completion with the next claim, one transaction (plain; ratio to apart)", "",
              f"{together:.3f}", f"{result['together_over_apart']:.2f}")
    return t


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m bench.layers", __doc__, "layers-pg<major>-[fsync-off-]")
    p.add_argument("--runs", type=int, default=200, help="events per side, event and round (default 200)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--fsync", choices=("on", "off"), default="on",
                   help="the cluster's fsync (off: with --pgbin only; the CPU a commit's flush costs the "
                        "session's backend is then left out)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.rounds < 1:
        p.error("--runs and --rounds must be at least 1")
    require_binaries(p, args.pgbin)
    if args.fsync == "off" and (not args.pgbin or os.environ.get(servers.ENV_URL)):
        p.error("--fsync off needs --pgbin and no COMPOSER_DATABASE_URL (a cluster of its own)")
    server = scenario.start_server(args.pgbin, {"fsync": args.fsync} if args.pgbin else None)
    log = stderr_log("layers")
    out = measured_run(server.version, "python -m bench.layers " + " ".join(argv if argv is not None else sys.argv[1:]),
                       lambda: measure(server, make_template(server, "bench_tpl_layers"), runs=args.runs,
                                       rounds=args.rounds, log=log))
    out["fsync"] = server.settings(("fsync",)).get("fsync")
    publish(out, args.out, RESULTS, f"layers-pg{server.version_num // 10000}-"
            + ("fsync-off-" if args.fsync == "off" else ""), table(out), log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
