"""``composer-ops runbook NAME [-p KEY VALUE ...]`` and ``composer-ops runbook list``:
the runbook notebooks, run headlessly and kept as the incident's record."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from composer_ops.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_command,
    add_json_option,
    add_read_lock_wait_option,
    emit_json,
    env_option,
    say,
)
from composer_ops.errors import Invalid


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    rb = add_command(
        sub, "runbook", cmd_runbook, database="reads",
        help="run a runbook notebook (diagnose, plan, act with -p confirm true) and keep it as a record",
        description="Execute notebooks/runbooks/NAME.ipynb with papermill: diagnose (read-only), plan (what the "
                    "CLI's dry run would do), and act only with -p confirm true, through the engine, each action "
                    "audited with the record's path. The executed notebook is kept as "
                    "OUT/runbooks/NAME/<UTC timestamp>.ipynb and .html, and OUT/index.html links it. "
                    "`composer-ops runbook list` lists the runbooks, the alert each serves, and the records kept. "
                    "`composer-ops check` names the runbook of each alert.",
        epilog="Exit codes: 0 done (diagnosed and planned; acted when confirm was true); 1 a cell failed, or "
               "acting was refused because the role may only read (the diagnosis and plan are in the record; "
               "nothing was changed); 2 bad input (unknown runbook or parameter, bad value: nothing is run).")
    rb.add_argument("name", metavar="NAME", help="the runbook (e.g. sweeper_lag), or `list`")
    rb.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="set a runbook parameter (repeatable), e.g. -p confirm true")
    env_option(rb, "--out", env="COMPOSER_REPORTS_DIR", default="reports", metavar_default="reports",
               help="reports directory: records go to OUT/runbooks/NAME/, the index to OUT/index.html")
    env_option(rb, "--timeout", env="COMPOSER_REPORT_CELL_TIMEOUT", type=int, default=600,
               metavar_default="600",
               help="seconds one cell may run; then it is interrupted and the runbook fails naming it")
    add_read_lock_wait_option(rb)
    env_option(rb, "--progress", env="COMPOSER_REPORT_PROGRESS", default="1", choices=["0", "1"],
               metavar_default="1", help="show a progress bar (0: no)")
    add_json_option(rb, "with `list`: print a JSON object")


def cmd_runbook(args: argparse.Namespace) -> int:
    from composer_ops.cli.admin_cmds import actor
    from composer_ops.runbooks import catalogue, records

    out = Path(args.out).expanduser()
    if args.name == "list":
        if args.parameter:
            raise Invalid("runbook list takes no -p parameters")
        return _list(out, args.json)
    if args.timeout < 1:
        raise Invalid(f"--timeout must be at least 1, got {args.timeout}")
    catalogue.get(args.name)    # unknown name: NotFound, exit 2, before anything runs
    pairs = [(str(k), str(v)) for k, v in args.parameter]
    url = args.database_url
    for key, value in pairs:
        if key == "database_url":
            url = value
    done = records.run(args.name, [(k, v) for k, v in pairs if k != "database_url"], out,
                       database_url=url or os.environ.get("COMPOSER_DATABASE_URL"), command=actor(args).command or "",
                       progress=args.progress == "1", cell_timeout_s=args.timeout, lock_wait_s=args.lock_wait)
    result = done.result
    if not result.ok:
        say(result.describe_failure().replace('report ', 'runbook ', 1))
        return EXIT_FAILED
    print(f"{args.name}: record {result.html} ({result.seconds:.1f} s)")
    for line in done.act.get("did") or []:
        print(f"did: {line}")
    if done.refused:
        say(f"runbook {args.name}: {done.refused}; nothing was changed; see {result.html}")
        return EXIT_FAILED
    book = next(r for r in catalogue.RUNBOOKS if r.name == args.name)
    if book.reads_only:
        print(f"read only: this runbook changes nothing ({book.acts})")
    elif not done.act.get("confirm"):
        again = records.confirm_command(args.name, pairs)
        if url:
            again += " (with the same --database-url)"
        print(f"dry run: nothing was changed; to act as planned: {again}")
    print(f"index: {out / 'index.html'}")
    return EXIT_OK


def _list(out: Path, as_json: bool) -> int:
    from composer_ops.runbooks import RUNBOOKS, records

    kept = records.records(out)
    if as_json:
        emit_json({"runbooks": [{"name": r.name, "serves": r.serves, "alert": r.alert, "incident": r.incident,
                                 "means": r.means, "acts": r.acts} for r in RUNBOOKS],
                   "records": [{"runbook": k.runbook, "at": k.stem, "ok": k.ok, "path": str(k.path),
                                "confirm": k.confirm, "did": k.did, "refused": k.refused} for k in kept]})
        return EXIT_OK
    width = max(len(r.name) for r in RUNBOOKS)
    for r in RUNBOOKS:
        print(f"{r.name:<{width}}  {r.serves}: {r.means}")
    if not kept:
        print(f"\nno record kept under {out / 'runbooks'} yet")
        return EXIT_OK
    print(f"\nrecords under {out / 'runbooks'} (newest first):")
    for k in kept:
        what = ("FAILED" if not k.ok else f"not acted: {k.refused}" if k.refused
                else "; ".join(k.did) if k.did else "dry run")
        print(f"  {k.runbook:<{width}}  {k.stem}  {k.path}  {what}")
    return EXIT_OK
