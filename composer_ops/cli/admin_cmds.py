"""Operator commands: ``workers list`` (and the ``runs`` actions registered under
``runs`` by :mod:`composer_ops.cli.run_cmds`), and what every operator action shares:
the :class:`~composer_ops.core.actor.Actor` its audit row names, and progress bars."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import shlex
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from composer_ops.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_command,
    add_json_option,
    add_lock_wait_option,
    add_run_argument,
    add_yes_option,
    emit_json,
    env_option,
    json_text,
    open_engine,
)
from composer_ops.core.actor import Actor
from composer_ops.errors import Invalid, LockTimeout

_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@:\s]*:)\S*@", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with passwords in libpq URLs and key=value strings replaced by ``***``."""
    return _KV_PASSWORD.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>***@", text))


def actor(args: argparse.Namespace) -> Actor:
    """Who acts, for the audit rows: this command line (passwords removed) and host; one
    per command, so every row the command writes shares its ``command_id``."""
    known: Actor | None = getattr(args, "actor", None)
    if known is None:
        words: Sequence[str] = getattr(args, "argv", None) or sys.argv[1:]
        # Each word on its own, before quoting: a quoted password inside a key=value word
        # (password='a b') is no longer one token once shlex has quoted the word around it.
        known = Actor(command=shlex.join(["composer-ops", *(redact(w) for w in words)]), host=socket.gethostname())
        args.actor = known
    return known


class RichProgress:
    """:class:`composer_ops.engine.archive.Progress` drawn by rich on stderr."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress
        self._task: Any = None

    def start(self, label: str, total: int | None) -> None:
        self._task = self._progress.add_task(label, total=total)

    def total(self, n: int) -> None:
        """The total, once it is known (after the bar started)."""
        if self._task is not None:
            self._progress.update(self._task, total=n)

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)


@contextlib.contextmanager
def progress_bars(enabled: bool = True) -> Iterator[RichProgress]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    with Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not enabled or not console.is_terminal) as bars:
        yield RichProgress(bars)



def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    wk = sub.add_parser("workers", help="the workers registry: live and dead workers and the leases they left")
    wsub = wk.add_subparsers(dest="workers_command", required=True, metavar="{list}")
    lst = add_command(
        wsub, "list", cmd_workers_list, database="reads",
        help="live, dead and stopped workers, and the leases each dead one left behind",
        description="Every worker registers itself and shows a sign of life once per registry interval. "
                    "A worker not seen for three intervals, and not stopped cleanly, is dead; the RUNNING "
                    "tasks it still holds a lease on are listed (the lease sweeper re-queues them once the "
                    "lease lapses). Exit 0 whatever the workers' state.")
    env_option(lst, "--window", env="COMPOSER_WORKERS_WINDOW_H", type=float, default=24.0, metavar="HOURS",
               metavar_default="24", help="also list workers last seen this many hours ago (0: all)")
    add_json_option(lst)


def add_selection_options(parser: argparse.ArgumentParser) -> None:
    """The options that select runs, shared by ``runs list`` and ``runs cancel``."""
    parser.add_argument("--workflow", metavar="ID", help="runs of this workflow only")
    parser.add_argument("--status", metavar="S", action="append",
                        help="runs in this status (PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED); repeat or "
                             "separate with commas for several")
    parser.add_argument("--since", metavar="WHEN",
                        help="runs whose ID's instant (their creation; a schedule's run of a past slot: the "
                             "slot) is at or after WHEN: an ISO date (midnight UTC), an ISO instant, or an age "
                             "counted back from the database clock (10min, 36h, 7d, 2w, 3 months)")
    parser.add_argument("--until", metavar="WHEN",
                        help="runs whose ID's instant is before WHEN (same forms as --since)")
    parser.add_argument("--where", metavar="EXPR",
                        help="conditions on the run's input, joined by 'and': input.customer=42, "
                             "input.tier=gold, input.order=\"A-17\" (values are JSON; a bare word is a string); "
                             "matched by JSON containment")


def register_runs(rsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``runs list`` (and the other operator actions on runs) under ``composer-ops runs``."""
    lst = add_command(
        rsub, "list", cmd_runs_list, database="reads", help="find runs by workflow, status, creation window and input",
        description="Runs matching every given condition, newest first. The creation window is turned into "
                    "run-ID bounds, so only the months it covers are read; without one every month is "
                    "searched, newest first, until LIMIT runs are found.")
    add_selection_options(lst)
    env_option(lst, "--limit", env="COMPOSER_RUNS_LIMIT", type=int, default=50, metavar_default="50",
               help="at most this many runs")
    add_json_option(lst, "print a JSON list of objects")

    can = add_command(
        rsub, "cancel", cmd_runs_cancel, help="cancel every active run a selection names (dry-run unless --yes)",
        description="Select runs as `runs list` does (at least one of --where, --workflow, --since, --until), "
                    "keep the active ones (PENDING, RUNNING), and cancel them through the engine's cancel event: "
                    "oldest first, CHUNK runs per transaction, each run under its lock, one audit row per chunk. "
                    "Without --yes it lists what it would cancel (each chunk decided and rolled back). A run "
                    "no event can be decided on (odd data: its definition version missing, a task in a "
                    "state the engine does not know) is refused with why, and the others go on. "
                    "Interrupted, it keeps what it did; run it "
                    "again to cancel the rest. Exit 0 done, 1 failed or a run refused, 2 bad input.")
    add_selection_options(can)
    can.add_argument("--reason", default="cancelled by operator", help="recorded as each run's error")
    add_yes_option(can, "cancel for real (without: list what would be cancelled)")
    add_lock_wait_option(can)
    env_option(can, "--chunk", env="COMPOSER_CANCEL_CHUNK", type=int, default=50, metavar_default="50",
               help="runs cancelled per transaction")
    add_json_option(can)

    rty = add_command(
        rsub, "retry", cmd_runs_retry, help="run a FAILED or CANCELLED run again from a node (dry-run unless --yes)",
        description="The failed node (or NODE) and every node downstream of it run again, and so do the tasks "
                    "that were cancelled when the run ended; completed upstream outputs are kept. The state "
                    "machine decides it under the run's lock and the run goes back to RUNNING; an audit row "
                    "records it. Without --yes the same decision is made and rolled back, and the nodes that "
                    "would run again are listed. Refused (exit 1): an active or SUCCEEDED run, a SUB_WORKFLOW "
                    "child whose parent's retry runs its work again (its parent FAILED or CANCELLED: retry the "
                    "parent from the node, as the error says; or its node now standing for another child). "
                    "Bad input (exit 2): an unknown node, a failed node the given nodes would not rerun, a "
                    "run whose definition version is deleted or missing. Instead of RUN, a "
                    "selection (as for `runs list`, FAILED runs unless --status says CANCELLED) retries up "
                    "to --limit runs, oldest first, each in its own transaction; a run refused or bad is "
                    "reported and the others go on (exit 0), and children left to their parent are listed "
                    "and not counted. Exit 0 done, 1 refused or failed, 2 bad input.")
    add_run_argument(rty, nargs="?", help="the run to retry (or give a selection)")
    rty.add_argument("--from", dest="from_nodes", metavar="NODE", action="append", default=[],
                     help="run again from this node (repeat for several; default: the nodes that failed)")
    add_selection_options(rty)
    env_option(rty, "--limit", env="COMPOSER_RETRY_LIMIT", type=int, default=100, metavar_default="100",
               help="with a selection: retry at most this many runs")
    add_yes_option(rty, "retry for real (without: say what would run again)")
    add_lock_wait_option(rty)
    add_json_option(rty)


def _ts(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value is not None else "-"


def _ago(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _short(value: Any, width: int | None) -> str:
    """``value`` as one line of JSON, cut to ``width`` characters (None: whole)."""
    if value is None:
        return ""
    text = json_text(value, separators=(",", ":"), ensure_ascii=False)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if width is None or len(text) <= width else text[: width - 3] + "..."


def _selection(args: argparse.Namespace) -> Any:
    from composer_ops.core.selection import selection

    return selection(workflow=args.workflow, status=args.status, since=args.since, until=args.until,
                     where=args.where)


def cmd_runs_list(args: argparse.Namespace) -> int:
    from composer_ops.engine.admin import find_runs

    chosen = _selection(args)     # a bad selection exits 2 before connecting
    with open_engine(args) as engine:
        resolved, found = find_runs(engine.pool, chosen, limit=args.limit)
    if args.json:
        emit_json([{"run_id": r.id, "workflow_id": r.workflow_id, "workflow_version": r.workflow_version,
                    "status": r.status, "created_at": r.created_at, "completed_at": r.completed_at,
                    "input": r.input, "error": r.error} for r in found])
        return EXIT_OK
    if not found:
        print("no run matches")
        return EXIT_OK
    # Nothing a selection matched on is cut (the workflow, the input --where searched),
    # nor anything when stdout is not a terminal (a file or a pipe keeps every character;
    # characters a terminal acts on are escaped, cli._common.shown, whatever stdout is).
    whole = not sys.stdout.isatty()
    cut_input = None if whole or args.where else 40
    cut_error = None if whole else 60
    flows = [f"{r.workflow_id} v{r.workflow_version}" for r in found]
    width = max(24, *map(len, flows))
    print(f"{'run':<36}  {'workflow':<{width}} {'status':<9} {'created':<20} {'completed':<20} input / error")
    for r, flow in zip(found, flows, strict=True):
        detail = _short(r.input, cut_input) + (f"  {_short(r.error, cut_error)}" if r.error else "")
        print(f"{r.id:<36}  {flow:<{width}} {r.status:<9} "
              f"{_ts(r.created_at):<20} {_ts(r.completed_at):<20} {detail}")
    more = " (the limit: more may match)" if len(found) == args.limit else ""
    print(f"{len(found)} run(s){more}")
    return EXIT_OK


class _Stopped(Exception):
    """Ctrl-C was pressed: stop after the chunk that just committed."""


@contextlib.contextmanager
def _stop_between_chunks() -> Iterator[threading.Event]:
    """The first SIGINT sets the event (the cancel stops once its current transaction
    ends, so nothing is cut off inside the driver); a second one interrupts at once."""
    pressed = threading.Event()

    def first(signum: int, frame: Any) -> None:
        pressed.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stderr.write("composer-ops: stopping after the current transaction (Ctrl-C again to stop now)\n")

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_runs_cancel(args: argparse.Namespace) -> int:
    from composer_ops.engine.admin import CancelChunk, cancel_runs

    chosen = _selection(args)
    cancelled: list[str] = []
    total: list[int] = []

    def so_far() -> str:
        return f"{len(cancelled)} done of {total[0] if total else 'the selected runs'}; run it again to finish"

    with open_engine(args) as engine:
        try:
            with progress_bars(enabled=args.yes) as bars, _stop_between_chunks() as pressed:
                bars.start("cancelling runs", None)

                def counted(n: int) -> None:
                    total.append(n)
                    bars.total(n)

                def chunk_done(c: CancelChunk) -> None:
                    cancelled.extend(c.cancelled)
                    bars.advance(len(c.cancelled) + len(c.skipped) + len(c.refused))
                    if pressed.is_set():
                        raise _Stopped

                result = cancel_runs(engine.shell, chosen, reason=args.reason, yes=args.yes, actor=actor(args),
                                     chunk=args.chunk, on_chunk=chunk_done, on_total=counted)
        except _Stopped:
            if args.json:
                emit_json({"applied": True, "interrupted": True, "cancelled": cancelled,
                           "total": total[0] if total else None})
            sys.stderr.write(f"composer-ops: interrupted: {so_far()}\n")
            return EXIT_FAILED
        except LockTimeout as exc:
            # A run held locked elsewhere past --lock-wait: its chunk rolled back, the chunks
            # before it stay cancelled (the error's line says how many; --json lists them).
            if args.json and args.yes:
                emit_json({"applied": True, "interrupted": True, "cancelled": cancelled,
                           "total": total[0] if total else None, "error": str(exc)})
            raise
        except KeyboardInterrupt:
            # Interrupted inside a statement: its transaction rolls back. The driver and
            # the pool would log what they clean up as they close; that is not news here.
            logging.getLogger("psycopg").setLevel(logging.CRITICAL)
            raise KeyboardInterrupt(f"at least {so_far()}") from None
    refused = result.refused if result.applied else result.would_refuse
    if args.json:
        emit_json({"applied": result.applied, "cancelled": result.cancelled, "skipped": result.skipped,
                   "chunks": len(result.chunks), "would_cancel": result.would_cancel, "more": result.more,
                   "locked": result.locked,
                   "refused": [{"run_id": r, "error": e} for r, e in refused], "decided": result.decided})
        return EXIT_FAILED if refused else EXIT_OK
    if not result.applied:
        for run_id in result.would_cancel:
            print(f"would cancel {run_id}")
        for run_id, why in refused:
            print(f"would refuse run {run_id}: {why}")
        for run_id in result.locked:
            print(f"run {run_id}: locked by another session: not decided")
        listed = len(result.would_cancel) + len(refused) + len(result.locked)
        more = f" (and more: only the first {listed} are listed)" if result.more else ""
        print(f"would cancel {len(result.would_cancel)} active run(s)"
              + (f" and refuse {len(refused)}" if refused else "")
              + (f", {len(result.locked)} locked, not decided" if result.locked else "")
              + f"{more}; nothing was changed "
              "(add --yes to cancel)")
        if not result.decided:
            print("listed, not decided: this role may only read, and a decided dry run takes the runs' locks "
                  "(run it as the operator role for the exact plan)")
        return EXIT_FAILED if refused else EXIT_OK
    for run_id, why in refused:
        print(f"refused run {run_id}: {why}")
    skipped = f", skipped {len(result.skipped)} that finished meanwhile" if result.skipped else ""
    refusals = f", refused {len(refused)} (above)" if refused else ""
    print(f"cancelled {len(result.cancelled)} run(s) in {len(result.chunks)} transaction(s){skipped}{refusals}")
    return EXIT_FAILED if refused else EXIT_OK


def _retry_record(result: Any) -> dict[str, Any]:
    return {"run_id": result.run_id, "applied": result.applied, "reset": list(result.reset),
            "created": list(result.created), "finished": result.finished}


def _retry_line(result: Any) -> str:
    verb = "retried" if result.applied else "would retry"
    return (f"{verb} run {result.run_id}: {', '.join(result.reset) or 'no task'} removed to run again; "
            f"{', '.join(result.created) or 'nothing'} created at once"
            + (f"; the run {result.finished} at once" if result.finished else ""))


def cmd_runs_retry(args: argparse.Namespace) -> int:
    from composer_ops.engine.admin import retry_runs

    selecting = any(v is not None for v in (args.workflow, args.status, args.since, args.until, args.where))
    if args.run_id is not None and selecting:
        raise Invalid("give RUN or a selection (--where, --workflow, --status, --since, --until), not both")
    if args.run_id is None:
        chosen = _selection(args)
        with open_engine(args) as engine:
            bulk = retry_runs(engine.shell, chosen, args.from_nodes, yes=args.yes, actor=actor(args),
                              limit=args.limit)
        if args.json:
            emit_json({"retried": [_retry_record(r) for r in bulk.retried],
                       "refused": [{"run_id": r, "error": e} for r, e in bulk.refused],
                       "left_to_parent": [{"run_id": r, "why": w} for r, w in bulk.left_to_parent]})
            return EXIT_OK
        for result in bulk.retried:
            print(_retry_line(result))
        for run_id, why in bulk.refused:
            print(f"refused run {run_id}: {why}")
        for run_id, why in bulk.left_to_parent:
            print(f"left child run {run_id} to its parent: {why}")
        verb = "retried" if args.yes else "would retry"
        print(f"{verb} {len(bulk.retried)} run(s), {len(bulk.refused)} refused"
              + (f", {len(bulk.left_to_parent)} child run(s) left to their parent" if bulk.left_to_parent else "")
              + ("" if args.yes else "; nothing was changed (add --yes to retry)"))
        return EXIT_OK
    with open_engine(args) as engine:
        result = engine.retry(args.run_id, args.from_nodes or None, yes=args.yes, actor=actor(args))
    if args.json:
        emit_json(_retry_record(result))
        return EXIT_OK
    print(_retry_line(result))
    if not result.applied:
        print("nothing was changed (add --yes to retry)")
    return EXIT_OK


def cmd_workers_list(args: argparse.Namespace) -> int:
    if args.window < 0:
        raise Invalid(f"--window must be 0 or more hours, got {args.window:g}")
    with open_engine(args) as engine:
        report = engine.workers(window_s=None if args.window == 0 else args.window * 3600)
    if args.json:
        out: dict[str, Any] = {
            "workers": [{**w.__dict__, "leases": [lease.__dict__ for lease in report.leases
                                                  if lease.lease_owner == w.id]} for w in report.workers],
            "unregistered_lease_owners": report.unregistered,
        }
        emit_json(out)
        return EXIT_OK
    if not report.workers:
        print("no worker registered" + (f" in the last {args.window:g} h" if args.window else ""))
    else:
        # Columns as wide as their widest value: a worker ID or queue list is never cut.
        queues = [",".join(w.queues) for w in report.workers]
        iw = max(40, *(len(w.id) for w in report.workers))
        qw = max(24, *map(len, queues))
        print(f"{'state':<8} {'worker':<{iw}} {'queues':<{qw}} {'slots':>5} {'leases':>6} {'expired':>7}  "
              f"{'last seen':<21} started")
        for w, queue_list in zip(report.workers, queues, strict=True):
            seen = f"{_ts(w.last_seen_at)} ({_ago(w.silent_s)} ago)" if w.state != "live" else _ts(w.last_seen_at)
            print(f"{w.state:<8} {w.id:<{iw}} {queue_list:<{qw}} {w.concurrency:>5} {w.running:>6} "
                  f"{w.expired:>7}  {seen:<21} {_ts(w.started_at)}")
    for w in report.workers:
        held = [lease for lease in report.leases if lease.lease_owner == w.id]
        if not held:
            continue
        print(f"\n{w.state} worker {w.id} left {len(held)} lease(s):")
        for lease in held:
            when = "expired" if lease.expired else "expires"
            print(f"  run {lease.run_id}  node {lease.node_id}  task {lease.task_id}  attempt {lease.attempt}  "
                  f"{when} {_ts(lease.lease_expires_at)}")
    if report.unregistered:
        print(f"\nlease owners that never registered: {', '.join(report.unregistered)}")
    return EXIT_OK
