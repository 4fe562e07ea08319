"""``composer-ops queues list|pause|resume|set-limit``: the operator's levers on queues
(:mod:`composer_ops.engine.queues`). A change is a dry run unless ``--yes``; with it, the
change and its audit row commit together."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from composer_ops.cli._common import EXIT_OK, add_command, add_json_option, add_yes_option, emit_json, open_engine
from composer_ops.cli.admin_cmds import actor

if TYPE_CHECKING:
    from composer_ops.engine import Engine


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    qp = sub.add_parser("queues", help="queues: depth, running, paused, limits; pause, resume, set a limit")
    qsub = qp.add_subparsers(dest="queues_command", required=True, metavar="{list,pause,resume,set-limit}")
    lst = add_command(qsub, "list", cmd_queues_list, database="reads",
                      help="every queue: paused (why, for how long), limit (max running), running, depth, "
                           "ready, oldest ready",
                      description="Every queue with a setting, a dispatch waiting or a task RUNNING, judged by the "
                                  "database clock. Exit 0 whatever their state.")
    add_json_option(lst)
    pause = add_command(qsub, "pause", cmd_queues_pause,
                        help="stop every worker from taking tasks of a queue (its tasks stay queued)",
                        description="Every claim reads its queues' settings, so the pause holds from each "
                                    "worker's next claim (at most one poll interval). Running tasks finish.")
    pause.add_argument("queue", metavar="NAME")
    pause.add_argument("--reason", help="why (kept with the setting and in the audit row; a paused queue "
                                        "paused again without one keeps its reason)")
    resume = add_command(qsub, "resume", cmd_queues_resume, help="let workers take tasks of a paused queue again")
    resume.add_argument("queue", metavar="NAME")
    limit = add_command(qsub, "set-limit", cmd_queues_set_limit,
                        help="at most N tasks of a queue RUNNING at once over all workers (0: no limit)")
    limit.add_argument("queue", metavar="NAME")
    limit.add_argument("--max-running", type=int, required=True, metavar="N",
                       help="the most RUNNING attempts at once (0: no limit)")
    for parser in (pause, resume, limit):
        add_yes_option(parser, "change it (without --yes: say what would change, change nothing)")
        add_json_option(parser)


def _state(values: dict[str, object]) -> str:
    paused = f"paused ({values['reason']})" if values.get("paused") and values.get("reason") else \
        "paused" if values.get("paused") else "open"
    limit = values.get("max_running") or 0
    return f"{paused}, max running {limit if limit else 'no limit'}"


def cmd_queues_list(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        rows = engine.queues.list()
    if args.json:
        emit_json([r.__dict__ for r in rows])
        return EXIT_OK
    if not rows:
        print("no queue has a setting, a waiting dispatch or a running task")
        return EXIT_OK
    width = max(5, *(len(r.queue) for r in rows))
    print(f"{'queue':<{width}}  {'state':<8} {'limit':>6} {'running':>7} {'depth':>7} {'ready':>7} "
          f"{'oldest ready':>12}  paused for / reason")
    for r in rows:
        since = f"{r.paused_s:.0f}s" if r.paused_s is not None else ""
        print(f"{r.queue:<{width}}  {'paused' if r.paused else 'open':<8} {r.max_running or '-':>6} {r.running:>7} "
              f"{r.depth:>7} {r.ready:>7} {r.oldest_ready_s:>11.0f}s  {since} {r.reason or ''}".rstrip())
    return EXIT_OK


def _report(args: argparse.Namespace, change: object) -> int:
    from composer_ops.engine.queues import QueueChange

    assert isinstance(change, QueueChange)
    if args.json:
        emit_json(change.to_json())
        return EXIT_OK
    if not change.applied:
        verb = "would change" if change.changed else "would leave unchanged"
        print(f"dry run: {change.action} {verb} queue {change.queue}: {_state(change.before)} -> "
              f"{_state(change.after)}; run again with --yes to act")
    else:
        print(f"queue {change.queue}: {_state(change.before)} -> {_state(change.after)}"
              + ("" if change.changed else " (unchanged)"))
    return EXIT_OK


def _warn_unnamed(engine: Engine, queue: str) -> None:
    """A queue nothing names is likely a typo: said on stderr before the change (which
    goes on: a queue may be set up before its first task)."""
    if not engine.queues.named(queue):
        sys.stderr.write(f"composer-ops: warning: no deployed workflow, worker, task or setting names queue "
                         f"{queue!r} (a typo? `composer-ops queues list` shows the queues in use)\n")


def cmd_queues_pause(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        _warn_unnamed(engine, args.queue)
        return _report(args, engine.queues.pause(args.queue, reason=args.reason, yes=args.yes, actor=actor(args)))


def cmd_queues_resume(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        _warn_unnamed(engine, args.queue)
        return _report(args, engine.queues.resume(args.queue, yes=args.yes, actor=actor(args)))


def cmd_queues_set_limit(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        _warn_unnamed(engine, args.queue)
        return _report(args, engine.queues.set_limit(args.queue, args.max_running, yes=args.yes, actor=actor(args)))
