"""``composer-ops audit list``: the operator audit, one line per command however many
transactions (audit rows) it took."""

from __future__ import annotations

import argparse
from datetime import UTC
from typing import Any

from composer_ops.cli._common import EXIT_OK, add_command, add_json_option, database_url, emit_json, env_option
from composer_ops.errors import Invalid


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from composer_ops.repo.audit import ACTIONS

    aud = sub.add_parser("audit", help="the operator audit: who archived, dropped, cancelled, retried, deleted what")
    asub = aud.add_subparsers(dest="audit_command", required=True, metavar="{list}")
    lst = add_command(
        asub, "list", cmd_audit_list, database="reads",
        help="operator commands, newest first, one line each",
        description="Every operator action writes audit rows in its own transactions (a bulk cancel one per "
                    "chunk, a retention drop one per month); this lists them one line per command, newest "
                    "first: when, the action, on what, the counts added up (per action for a command of several), "
                    "the transactions, the database "
                    "role and the command line. Exit 0, 2 for bad input.")
    env_option(lst, "--since", env="COMPOSER_AUDIT_SINCE", metavar="WHEN",
               help="commands that wrote at or after WHEN: an ISO date (midnight UTC), an ISO instant, or an age "
                    "counted back from the database clock (10min, 36h, 7d, 2w, 3 months)")
    env_option(lst, "--action", env="COMPOSER_AUDIT_ACTION", metavar="ACTION",
               help=f"only this action, or several separated by commas ({', '.join(ACTIONS)})")
    env_option(lst, "--limit", env="COMPOSER_AUDIT_LIMIT", type=int, default=50, metavar_default="50",
               help="at most this many commands")
    add_json_option(lst, "print a JSON list of objects, one per command, each with its rows")


def cmd_audit_list(args: argparse.Namespace) -> int:
    from composer_ops.core.cutoff import parse_cutoff
    from composer_ops.ops.operator import audit_commands

    try:
        since = parse_cutoff(args.since) if args.since else None      # a bad WHEN exits 2 before connecting
    except Invalid:
        raise Invalid(f"--since {args.since!r} is not an ISO date (2025-01-31), an ISO instant "
                      "(2025-01-31T12:00:00Z) or an age (10min, 36h, 7d, 2w, 3 months)") from None
    actions = [a.strip() for a in args.action.split(",") if a.strip()] if args.action else None
    found = audit_commands(database_url(args), since=since, actions=actions, limit=args.limit)
    if args.json:
        emit_json([_record(c) for c in found])
        return EXIT_OK
    if not found:
        print("no operator action is recorded" + (" that matches" if since or actions else ""))
        return EXIT_OK
    for c in found:
        counts = (_counts_text(c.counts) if len(c.actions) == 1 else
                  "; ".join(f"{a}: {_counts_text(c.counts[a]) or 'no counts'}" for a in c.actions))
        who = f"{c.last.db_role}@{c.last.client_host or c.last.client_addr}"
        print(f"{c.last.at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}  {', '.join(c.actions):<18}  "
              f"{', '.join(c.targets) or '-'}  [{counts or 'no counts'}; {len(c.rows)} transaction(s)]  {who}  "
              f"{c.last.command or '-'}")
    return EXIT_OK


def _counts_text(counts: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, dict))


def _record(c: Any) -> dict[str, Any]:
    return {"at": c.last.at, "first_at": c.first.at, "actions": c.actions, "targets": c.targets, "counts": c.counts,
            "transactions": len(c.rows), "command": c.last.command, "command_id": c.last.command_id,
            "login_role": c.last.login_role, "db_role": c.last.db_role, "client_addr": c.last.client_addr,
            "client_host": c.last.client_host,
            "rows": [dict(r.__dict__) for r in c.rows]}
