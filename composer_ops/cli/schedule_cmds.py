"""``composer-ops schedules create|list|pause|resume|delete|trigger|backfill``: cron
schedules whose slots the coordinator starts. Each action writes an audit row, and,
as every operator command, changes nothing without --yes (it says what it would do)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

from composer_ops.cli._common import (
    EXIT_OK,
    add_command,
    add_json_option,
    add_yes_option,
    database_url,
    emit_json,
    env_option,
    json_arg,
    open_engine,
)
from composer_ops.cli.admin_cmds import actor
from composer_ops.core.schedules import CATCHUP_POLICIES, OVERLAP_POLICIES


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from composer_ops.engine.schedules import MAX_BACKFILL

    sch = sub.add_parser("schedules", help="cron schedules in a time zone: the coordinator starts their slots")
    ssub = sch.add_subparsers(dest="schedules_command", required=True,
                              metavar="{create,list,pause,resume,delete,trigger,backfill}")
    create = add_command(
        ssub, "create", cmd_create, help="a schedule starting runs of a workflow at each cron slot",
        description="The coordinator starts one run per slot of --cron read in --timezone (an IANA name; "
                    "daylight-saving days as Debian cron reads them: a time that does not exist fires at the "
                    "first minute that does, a repeated time fires once). Each run's input is --input with a "
                    "_schedule key (name, slot, source); its run ID is derived from the schedule and the slot, "
                    "so a slot never starts twice. --overlap: skip a slot while the previous run is active, "
                    "buffer one to start when it ends, or allow. --catchup after a coordinator outage: start "
                    "none of the late slots, the latest, or all. Dry-run unless --yes. Exit 2 for bad input "
                    "(nothing written).")
    create.add_argument("name")
    create.add_argument("--workflow", required=True, help="the workflow id (its deployed version starts)")
    create.add_argument("--cron", required=True, metavar="EXPR",
                        help="five fields: minute hour day-of-month month day-of-week (\"0 2 * * *\")")
    create.add_argument("--timezone", required=True, metavar="TZ", help="IANA time zone (Europe/Paris, UTC)")
    create.add_argument("--input", metavar="JSON", help="the runs' input: a JSON object")
    env_option(create, "--overlap", env="COMPOSER_SCHEDULE_OVERLAP", default="skip", choices=OVERLAP_POLICIES,
               metavar_default="skip", help="when the previous run is still active")
    env_option(create, "--catchup", env="COMPOSER_SCHEDULE_CATCHUP", default="latest", choices=CATCHUP_POLICIES,
               metavar_default="latest", help="which late slots start after an outage")
    add_yes_option(create, "create it (without: check everything and show what would be created)")
    add_json_option(create, "print the schedule as a JSON object")

    lst = add_command(ssub, "list", cmd_list, database="reads",
                      help="every schedule: next and last slot, last run, slots missed or skipped and why")
    add_json_option(lst, "print a JSON list of objects")

    for name, func, text in (("pause", cmd_pause, "stop starting slots (they are not run later; dry-run unless --yes)"),
                             ("resume", cmd_resume, "start slots again from the next one (dry-run unless --yes)")):
        p = add_command(ssub, name, func, help=text)
        p.add_argument("name")
        add_yes_option(p, f"{name} it (without: show what would change)")
        add_json_option(p)

    delete = add_command(ssub, "delete", cmd_delete, help="delete a schedule; its runs go on (dry-run unless --yes)")
    delete.add_argument("name")
    add_yes_option(delete, "delete it (without: show what would be deleted)")
    add_json_option(delete)

    trig = add_command(ssub, "trigger", cmd_trigger, help="start one run of the schedule now (dry-run unless --yes)")
    trig.add_argument("name")
    add_yes_option(trig, "start it (without: check the schedule can start a run now, and start none)")
    add_json_option(trig)

    back = add_command(
        ssub, "backfill", cmd_backfill, help="start the slots of a past window (dry-run unless --yes)",
        description="Every slot with FROM <= slot < TO gets its run (the run a coordinator would have started: "
                    "a slot that has one is left alone), whatever the overlap policy. Refused: a window "
                    f"reaching past the database clock, more than {MAX_BACKFILL} slots, a slot in a month without a "
                    "partition. Exit 2 for bad input.")
    back.add_argument("name")
    back.add_argument("--from", dest="start", required=True, metavar="WHEN",
                      help="an ISO date (midnight UTC), an ISO instant, or an age (36h, 7d)")
    back.add_argument("--to", dest="end", required=True, metavar="WHEN", help="as --from; the end is excluded")
    add_yes_option(back, "start the runs (without: list the slots and what would happen)")
    add_json_option(back)


def _utc(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else "-"


def _record(row: Any) -> dict[str, Any]:
    return {k: v for k, v in row.__dict__.items() if k not in ("wake_at",)}


def cmd_create(args: argparse.Namespace) -> int:
    from composer_ops.core import schedules as rules
    from composer_ops.errors import Invalid

    # Everything a person can get wrong is checked before connecting.
    rules.check_name(args.name)
    rules.check_cron(args.cron)
    rules.check_zone(args.timezone)
    document = json_arg(args.input, "--input")
    if document is not None and not isinstance(document, dict):
        raise Invalid(f"--input must be a JSON object (the runs' input gets a _schedule key), "
                      f"got {type(document).__name__}")
    with open_engine(args) as engine:
        row = engine.schedules.create(args.name, workflow=args.workflow, cron=args.cron, timezone=args.timezone,
                                      input=document, overlap=args.overlap, catchup=args.catchup,
                                      actor=actor(args), yes=args.yes)
    if args.json:
        emit_json({**_record(row), "applied": bool(args.yes)})
        return EXIT_OK
    what = (f"schedule {row.name}: {row.workflow_id} at {row.cron!r} in {row.timezone} "
            f"(overlap {row.overlap}, catchup {row.catchup}); next slot {_utc(row.next_slot_at)}")
    print(f"created {what}" if args.yes else f"would create {what}; nothing was changed (add --yes to create)")
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from composer_ops.engine import Engine

    with Engine.connect(database_url(args), pool_size=1, application_name="composer-ops schedules list") as engine:
        rows = engine.schedules.list()
    if args.json:
        emit_json([_record(r) for r in rows])
        return EXIT_OK
    if not rows:
        print("no schedule")
        return EXIT_OK
    for r in rows:
        state = "paused" if r.paused else f"next {_utc(r.next_slot_at)}"
        last = f"last {_utc(r.last_slot_at)} run {r.last_run_id} {r.last_run_status or '(gone)'}" if r.last_run_id \
            else "no run yet"
        why = f"; latest: {r.last_not_started_reason}" if r.last_not_started_reason else ""
        print(f"{r.name}  {r.workflow_id}  {r.cron!r} {r.timezone}  overlap {r.overlap}, catchup {r.catchup}  "
              f"{state}  {last}  missed {r.missed_slots}, skipped {r.skipped_slots}{why}")
    return EXIT_OK


def _paused(args: argparse.Namespace, pause: bool) -> int:
    with open_engine(args) as engine:
        act = engine.schedules.pause if pause else engine.schedules.resume
        changed = act(args.name, actor=actor(args), yes=args.yes)
        row = engine.schedules.get(args.name)
    if args.json:
        emit_json({"name": args.name, "paused": row.paused, "changed": changed, "applied": bool(args.yes),
                   "next_slot_at": row.next_slot_at})
        return EXIT_OK
    verb = "pause" if pause else "resume"
    if not changed:
        print(f"schedule {args.name} was {'paused' if pause else 'running'} already")
    elif not args.yes:
        print(f"would {verb} schedule {args.name}; nothing was changed (add --yes to {verb})")
    elif pause:
        print(f"paused schedule {args.name}")
    else:
        print(f"resumed schedule {args.name}; next slot {_utc(row.next_slot_at)}")
    return EXIT_OK


def cmd_pause(args: argparse.Namespace) -> int:
    return _paused(args, True)


def cmd_resume(args: argparse.Namespace) -> int:
    return _paused(args, False)


def cmd_delete(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        row = engine.schedules.get(args.name)
        if args.yes:
            engine.schedules.delete(args.name, actor=actor(args))
    if args.json:
        emit_json({"name": row.name, "id": row.id, "applied": bool(args.yes)})
        return EXIT_OK
    if args.yes:
        print(f"deleted schedule {row.name} ({row.id}); its runs go on")
    else:
        print(f"would delete schedule {row.name} ({row.workflow_id} at {row.cron!r} in {row.timezone}); "
              "nothing was changed (add --yes to delete)")
    return EXIT_OK


def cmd_trigger(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        run_id = engine.schedules.trigger(args.name, actor=actor(args), yes=args.yes)
    if args.json:
        emit_json({"name": args.name, "run_id": run_id if args.yes else None, "applied": bool(args.yes)})
        return EXIT_OK
    if args.yes:
        print(run_id)
    else:
        print(f"would start one run of schedule {args.name} now; nothing was changed (add --yes to start it)")
    return EXIT_OK


def cmd_backfill(args: argparse.Namespace) -> int:
    from composer_ops.core.schedules import check_name
    from composer_ops.core.selection import parse_when

    check_name(args.name)                                   # bad input: exit 2 before connecting
    parse_when(args.start, "--from")
    parse_when(args.end, "--to")
    with open_engine(args) as engine:
        done = engine.schedules.backfill(args.name, start=args.start, end=args.end, yes=args.yes,
                                         actor=actor(args))
    if args.json:
        emit_json(done.as_json())
        return EXIT_OK
    for s in done.slots:
        verb = {"start": "started" if done.applied else "would start", "exists": "has its run"}[s.action]
        print(f"{_utc(s.slot)}  {s.run_id}  {verb}")
    if done.applied:
        print(f"started {done.started} run(s) of {len(done.slots)} slot(s)")
    else:
        todo = sum(1 for s in done.slots if s.action == "start")
        print(f"would start {todo} run(s) of {len(done.slots)} slot(s); nothing was changed (add --yes to start "
              "them)")
    return EXIT_OK
