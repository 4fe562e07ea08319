"""The operator actions' cases of the fault sweep (tests/faults/test_write_paths.py):
partitions, retention, archive and restore, schedules and queues."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from composer_ops.core.manifest import read_manifest
from composer_ops.core.schedules import slot_run_id
from composer_ops.engine import archive, retire
from composer_ops.engine.retention import drop_due_months
from composer_ops.errors import Unavailable
from composer_ops.repo.archive import DETACHED_SCHEMA
from composer_ops.repo.partitions import RUN_TABLES
from composer_ops.testing.processes import wait_for
from tests.faults.cases import RELAY, Rig, _claim_one, _fresh_run, _raised, _token
from tests.faults.harness import Result
from tests.integration.helpers import uuid7_at


def _months_ahead_missing(b: Rig) -> list[str]:
    """This month and the five after it (YYYYMM), the last two without their partitions."""
    months = [r[0] for r in b.sql(
        "SELECT to_char((date_trunc('month', now() AT TIME ZONE 'UTC') + make_interval(months => i)), 'YYYYMM') "
        "FROM generate_series(0, 5) i")]
    for month in months[4:]:
        for table in ("workflow_events", "task_instances"):
            b.sql(f"DROP TABLE IF EXISTS {table}_p{month}")
        if b.sql("SELECT to_regclass(%s) IS NOT NULL", (f"workflow_runs_p{month}",))[0][0]:
            b.sql(f"ALTER TABLE workflow_runs DETACH PARTITION workflow_runs_p{month}")
            b.sql(f"DROP TABLE workflow_runs_p{month}")
    return months


def _a_month_to_drop(b: Rig) -> str:
    """January 2020 with one finished run in it; the state is a running run of this
    month, which the drop must not touch."""
    b.sql("SELECT composer_ensure_partitions_from(%s, 0)", (date(2020, 1, 1),))
    b.sql("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status) "
          "VALUES (%s, 'f-chain', 1, 'SUCCEEDED')", (uuid7_at(datetime(2020, 1, 15, tzinfo=UTC)),))
    return b.direct.start("f-chain")


CUTOFF = datetime(2021, 1, 1, tzinfo=UTC)


@dataclass
class Month:
    """January 2020 with a finished run in it, an archive directory of the case's own,
    and the last audit row before the case."""

    directory: str
    audit_mark: int
    keep: str          # a running run of this month, which nothing may touch


def _month_2020(b: Rig) -> Month:
    for table in RUN_TABLES:       # what an earlier case detached
        b.sql(f"DROP TABLE IF EXISTS {DETACHED_SCHEMA}.{table}_p202001")
    keep = _a_month_to_drop(b)
    mark = b.sql("SELECT coalesce(max(id), 0) FROM operator_audit")[0][0]
    return Month(directory=tempfile.mkdtemp(prefix="composer-faults-"), audit_mark=mark, keep=keep)


def _archived_and_dropped(b: Rig) -> Month:
    m = _month_2020(b)
    archive.archive_due(b.db_url, CUTOFF, Path(m.directory))
    drop_due_months(b.db_url, CUTOFF)
    m.audit_mark = b.sql("SELECT coalesce(max(id), 0) FROM operator_audit")[0][0]
    return m


def _audits(b: Rig, m: Month, action: str) -> int:
    return int(b.sql("SELECT count(*) FROM operator_audit WHERE id > %s AND action = %s AND target = '202001'",
                     (m.audit_mark, action))[0][0])


def _month_rows(b: Rig) -> int | None:
    if not b.sql("SELECT to_regclass('workflow_runs_p202001') IS NOT NULL")[0][0]:
        return None
    return int(b.sql("SELECT count(*) FROM workflow_runs_p202001")[0][0])


def _again_if_lost(again: Callable[[Rig, Any], Any]) -> Callable[[Rig, Any, Result], Result]:
    """An operator command that reads the month outside a retried transaction (the
    archive's export) fails on a lost connection, saying so, with nothing half done:
    the operator runs it again (here without faults), and that run must finish it."""
    def rerun(b: Rig, m: Any, result: Result) -> Result:
        if isinstance(result.error, Unavailable):
            try:
                return Result(value=again(b, m))
            except Exception as exc:  # judged by the check
                return Result(error=exc)
        return result
    return rerun


def _archive(url: str, m: Month) -> Any:
    return archive.archive_due(url, CUTOFF, Path(m.directory))


def _retire(url: str, m: Month, *, keep_table: bool = False) -> Any:
    return retire.retire_months(url, CUTOFF, archive_dir=None if keep_table else Path(m.directory),
                                keep_table=keep_table, yes=True)


def _archived_once(b: Rig, m: Month, result: Result) -> list[str]:
    """The month's archive is in place and holds the month's rows; each command that
    finished wrote one audit row, and the month is still there."""
    result = _again_if_lost(lambda b, m: _archive(b.db_url, m))(b, m, result)
    problems = _raised(result)
    if result.error is None and [x.month for x in result.value.months] != ["202001"]:
        problems.append(f"the archive reported {result.value.months}")
    manifest = archive.verify_month(Path(m.directory) / "202001")
    if manifest.table("workflow_runs").rows != _month_rows(b):     # type: ignore[union-attr]
        problems.append(f"the archive holds {manifest.rows} rows, the month {_month_rows(b)}")
    if not 1 <= _audits(b, m, "partitions archive") <= 2:
        problems.append(f"{_audits(b, m, 'partitions archive')} archive audit rows")
    return problems


def _retired_once(outcome: str, action: str) -> Callable[[Rig, Month, Result], list[str]]:
    """The month dropped (after its archive verified) or detached, reported so even when
    the acknowledgement was lost or the retry started while it committed, one audit row."""
    def check(b: Rig, m: Month, result: Result) -> list[str]:
        keep_table = outcome == "detached"
        result = _again_if_lost(lambda b, m: _retire(b.db_url, m, keep_table=keep_table))(b, m, result)
        problems = _raised(result)
        if result.error is None and [(x.month, x.outcome) for x in result.value.months] != [("202001", outcome)]:
            problems.append(f"reported {[(x.month, x.outcome, x.reason) for x in result.value.months]}")
        if _month_rows(b) is not None:
            problems.append("the month is still there")
        if _audits(b, m, action) != 1:
            problems.append(f"{_audits(b, m, action)} '{action}' audit rows")
        if keep_table and not b.sql(f"SELECT to_regclass('{DETACHED_SCHEMA}.workflow_runs_p202001') IS NOT NULL")[0][0]:
            problems.append("the detached month is not kept")
        if b.direct.get_run(m.keep).status != "RUNNING":
            problems.append("a run of another month changed")
        return problems
    return check


def _restored_once(b: Rig, m: Month, result: Result) -> list[str]:
    problems = _raised(result)
    want = read_manifest(Path(m.directory) / "202001").table("workflow_runs").rows  # type: ignore[union-attr]
    if result.error is None and not result.value.applied:
        problems.append(f"the restore returned {result.value}")
    if _month_rows(b) != want:
        problems.append(f"the month holds {_month_rows(b)} runs, the archive {want}")
    if _audits(b, m, "partitions restore") != 1:
        problems.append(f"{_audits(b, m, 'partitions restore')} restore audit rows")
    return problems


def _failed_run(b: Rig) -> str:
    run_id = _fresh_run(b, "f-chain")
    b.direct.fail(_claim_one(b), "fatal", retryable=False)
    return run_id


def _three_tokened_runs(b: Rig) -> tuple[str, list[str]]:
    token = _token()
    return token, sorted(b.direct.start("f-chain", input={"token": token}) for _ in range(3))


def _relayed(b: Rig, run_id: str) -> None:
    """The relay retries a refused or lost delivery after its lease: relay passes until
    the delivery is marked delivered (the one case using this posts to an endpoint that
    accepts), with the generous deadline of a loaded machine."""
    def delivered() -> bool:
        if b.sql("SELECT delivered_at IS NOT NULL FROM webhook_deliveries WHERE run_id = %s", (run_id,))[0][0]:
            return True
        b.direct.coordinator(relay=RELAY).run_once(["webhooks"])
        return False
    wait_for(delivered, what=f"run {run_id}'s webhook delivered by the relay")


def _schedule(b: Rig, cron: str = "0 * * * *", *, due_hours: int = 0) -> str:
    """A schedule of its own (earlier cases' deleted, so a pass sees this one only);
    with ``due_hours``, its cursor moved back so that the slots of the last
    ``due_hours`` hours and this hour's are due (catch-up all, overlap allow)."""
    b.sql("UPDATE schedules SET deleted_at = now(), wake_at = NULL WHERE deleted_at IS NULL")
    name = f"s-{_token()[:12]}"
    b.direct.schedules.create(name, workflow="f-chain", cron=cron, timezone="Europe/Paris", catchup="all",
                              overlap="allow")
    if due_hours:
        b.sql("UPDATE schedules SET next_slot_at = date_trunc('hour', now()) - make_interval(hours => %s), "
              "wake_at = date_trunc('hour', now()) - make_interval(hours => %s) WHERE name = %s",
              (due_hours, due_hours, name))
    return name


def _schedule_runs(b: Rig, name: str) -> list[tuple[str, str, str]]:
    """(run ID, source, slot) of every run the schedule started, from their 'started' history."""
    return [(r[0], r[1], r[2]) for r in b.sql("""
        SELECT h.run_id, h.detail->>'source', h.detail->>'slot' FROM run_history h
         WHERE h.kind = 'started' AND h.detail->>'schedule' = %s ORDER BY 3""", (name,))]


def _audited(b: Rig, action: str, name: str) -> list[str]:
    n = b.sql("SELECT count(*) FROM operator_audit WHERE action = %s AND target = %s", (action, name))[0][0]
    return [] if n == 1 else [f"{n} {action!r} audit rows for one call"]


def _slots_fired_once(b: Rig, name: str, result: Result) -> list[str]:
    """A pass cut by a fault leaves the schedule for the next pass: run one. Then every
    slot from the cursor's old place to its new one has exactly one run, the slot's."""
    if b.sql("SELECT wake_at <= now() FROM schedules WHERE name = %s", (name,))[0][0]:
        b.direct.coordinator().run_once(["schedules"])
    sid, cursor = b.sql("SELECT id, next_slot_at FROM schedules WHERE name = %s", (name,))[0]
    fired = _schedule_runs(b, name)
    slots = [datetime.fromisoformat(slot) for _, _, slot in fired]
    problems = _raised(result)
    if len(fired) != 3 or len(set(slots)) != len(slots) or any(s >= cursor for s in slots):
        problems.append(f"runs {fired} for 3 slots, cursor now {cursor}")
    if any(run_id != slot_run_id(sid, "cron", slot) for (run_id, _, _), slot in zip(fired, slots, strict=True)):
        problems.append(f"a run ID is not its slot's: {fired}")
    started = b.sql("SELECT count(*) FROM schedule_events WHERE schedule_id = %s AND kind = 'started'", (sid,))
    if started != [(len(fired),)]:
        problems.append(f"{started[0][0]} 'started' events for {len(fired)} runs")
    return problems


def _triggered_once(b: Rig, name: str, result: Result) -> list[str]:
    fired = _schedule_runs(b, name)
    problems = _raised(result) + _audited(b, "schedules trigger", name)
    if len(fired) != 1 or (result.error is None and result.value != fired[0][0]):
        problems.append(f"trigger returned {result.value!r}; the schedule's runs are {fired}")
    return problems


def _backfilled_once(b: Rig, name: str, result: Result) -> list[str]:
    fired = _schedule_runs(b, name)
    problems = _raised(result) + _audited(b, "schedules backfill", name)
    if len(fired) != 3 or {source for _, source, _ in fired} != {"backfill"}:
        problems.append(f"runs {fired} for 3 backfilled slots")
    if result.error is None and (result.value.started, [s.action for s in result.value.slots]) != (3, ["start"] * 3):
        problems.append(f"backfill reported {result.value.started} started, not its lost attempt's 3")
    return problems


def _created_once(b: Rig, name: str, result: Result) -> list[str]:
    n = b.sql("SELECT count(*) FROM schedules WHERE name = %s", (name,))[0][0]
    problems = _raised(result) + _audited(b, "schedules create", name)
    if n != 1:
        problems.append(f"{n} schedules named {name}")
    return problems


def _paused_once(b: Rig, name: str, result: Result) -> list[str]:
    paused = b.sql("SELECT paused FROM schedules WHERE name = %s AND deleted_at IS NULL", (name,))
    problems = _raised(result) + _audited(b, "schedules pause", name)
    if paused != [(True,)] or (result.error is None and result.value is not True):
        problems.append(f"schedule paused {paused}; pause returned {result.value!r} (True: it paused it)")
    return problems


def _backfill(b: Rig, name: str) -> Any:
    top = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return b.engine.schedules.backfill(name, start=top - timedelta(hours=4), end=top - timedelta(hours=1),
                                       yes=True)
def _limited_run(b: Rig) -> str:
    b.direct.queues.set_limit("fl", 1)
    return _fresh_run(b, "f-limited")


def _late_start(b: Rig) -> str:
    """A fresh run of f-prompt whose dispatch is past its schedule_to_start deadline."""
    run_id = _fresh_run(b, "f-prompt")
    b.sql("UPDATE task_outbox SET start_by = now() - interval '1 millisecond' WHERE run_id = %s", (run_id,))
    return run_id


def _two_of_one_customer(b: Rig) -> list[str]:
    for (run_id,) in b.sql("SELECT id FROM workflow_runs WHERE status = 'RUNNING'"):
        b.direct.cancel(run_id, reason="next case")
    customer = _token()
    return [b.direct.start("f-keyed", input={"customer": customer}) for _ in range(2)]


def _queue_name(b: Rig) -> str:
    return "fq-" + _token()[:12]


def _paused_queue(b: Rig) -> str:
    queue = _queue_name(b)
    b.direct.queues.pause(queue)
    return queue


