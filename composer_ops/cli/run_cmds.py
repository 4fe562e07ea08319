"""``deploy``, ``start``, ``signal``, ``cancel``, ``runs show``, ``coordinator``, ``worker``."""


from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import importlib
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

from composer_ops.cli import admin_cmds
from composer_ops.cli._common import (
    EXIT_OK,
    above,
    add_command,
    add_json_option,
    add_lock_wait_option,
    add_run_argument,
    add_yes_option,
    at_least,
    emit_json,
    env_option,
    json_arg,
    json_text,
    open_engine,
    say,
)
from composer_ops.cli.partition_cmds import add_months_ahead_option
from composer_ops.core.attempts import Attempt, HistoryRow, attempts
from composer_ops.core.cutoff import parse_cutoff
from composer_ops.db.errors import first_line
from composer_ops.engine import Engine, Worker
from composer_ops.engine.webhooks import RelayPolicy
from composer_ops.engine.worker import SHORT_HANDLER_S
from composer_ops.engine.worker_options import DEFAULT_SHUTDOWN_TIMEOUT_S, MAX_PREFETCH, check_shutdown_timeout
from composer_ops.errors import ComposerError, Invalid, ShutdownTimeout


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    dep = add_command(sub, "deploy", cmd_deploy,
                      help="validate a definition (JSON or YAML file) and deploy it as a new version")
    dep.add_argument("file", help="path of the definition, or - for standard input")

    start = add_command(sub, "start", cmd_start, help="start a run of a deployed workflow; prints the run ID")
    start.add_argument("workflow", help="workflow id")
    start.add_argument("--input", help="run input as JSON")
    start.add_argument("--version", type=int, help="definition version (default: the deployed one)")
    start.add_argument("--run-id", help="client-supplied run ID: a recent lowercase UUIDv7 (idempotency key)")

    sig = add_command(sub, "signal", cmd_signal, help="send a signal to a run (buffered if no node waits for it yet)")
    add_run_argument(sig)
    sig.add_argument("name")
    sig.add_argument("--payload", help="signal payload as JSON")
    sig.add_argument("--key", help="idempotency key: sending again with the same key (to the same run) "
                                   "resolves nothing more and prints the first outcome")
    add_lock_wait_option(sig)

    cancel = add_command(sub, "cancel", cmd_cancel, help="cancel a run and its active tasks")
    add_run_argument(cancel)
    cancel.add_argument("--reason", default="cancelled by operator", help="recorded as the run's error")
    add_lock_wait_option(cancel)

    runs = sub.add_parser("runs", help="inspect, find and act on runs")
    rsub = runs.add_subparsers(dest="runs_command", required=True, metavar="{show,delete,list,cancel,retry}")
    show = add_command(rsub, "show", cmd_runs_show, database="reads",
                       help="a run, its output or error, its tasks, every attempt and its history")
    add_run_argument(show)
    add_json_option(show)
    delete = add_command(
        rsub, "delete", cmd_runs_delete, help="soft-delete a finished run (dry-run unless --yes)",
        description="Hide a finished run from every read, loop and report; its rows leave with its month "
                    "(partitions drop). An active run is refused: cancel it first. A pending webhook delivery "
                    "of the run is given up.")
    add_run_argument(delete)
    add_yes_option(delete, "delete it (without: show what would be deleted)")
    add_lock_wait_option(delete)
    add_json_option(delete)
    admin_cmds.register_runs(rsub)

    coord = add_command(
        sub, "coordinator", cmd_coordinator,
        help="run the background loops (timers, leases, partitions, webhooks, schedules, children)",
        epilog="Webhooks are signed (X-Composer-Signature, HMAC-SHA256) when COMPOSER_WEBHOOK_SECRET is set; "
               "the secret is read from the environment only, never from the command line.")
    coord.add_argument("--once", action="store_true", help="one pass of every loop, then exit")
    env_option(coord, "--interval", env="COMPOSER_COORDINATOR_INTERVAL", type=float, default=0.5,
               accepts=above(0), metavar_default="0.5", help="seconds between passes when idle")
    add_months_ahead_option(coord, "partition months kept ahead")
    env_option(coord, "--webhook-connect-timeout", env="COMPOSER_WEBHOOK_CONNECT_TIMEOUT_S", type=float,
               default=3.0, help="seconds to connect to a webhook endpoint")
    env_option(coord, "--webhook-timeout", env="COMPOSER_WEBHOOK_TIMEOUT_S", type=float, default=5.0,
               help="seconds per read of a webhook response")
    env_option(coord, "--webhook-deadline", env="COMPOSER_WEBHOOK_DEADLINE_S", type=float, default=10.0,
               help="seconds for a whole webhook POST")
    env_option(coord, "--webhook-keep-days", env="COMPOSER_WEBHOOK_KEEP_DAYS", type=float, default=7.0,
               accepts=at_least(0), metavar_default="7",
               help="days a delivered (or given up) webhook delivery is kept before the coordinator deletes it")
    env_option(coord, "--event-lock-wait", env="COMPOSER_COORDINATOR_EVENT_LOCK_WAIT_S", type=float, default=1.0,
               accepts=above(0), metavar="SECONDS", metavar_default="1",
               help="seconds a timer or lease event waits for a lock of its run before it is backed off and the "
                    "pass goes on (a run locked by a transaction left open or, on Citus, left prepared by a "
                    "crashed node)")
    env_option(coord, "--retention", env="COMPOSER_COORDINATOR_RETENTION", metavar="WHEN",
               help="also drop partition months older than WHEN, hourly (as `partitions drop --older-than WHEN "
                    "--yes`; needs the owner role); unset: no retention")
    add_connect_wait_option(coord)
    add_shutdown_timeout_option(coord, "for the loop pass in progress (a webhook POST, a sweep) to finish")

    work = add_command(sub, "worker", cmd_worker, help="run a Worker defined in your code: --app module:attribute")
    env_option(work, "--app", env="COMPOSER_WORKER_APP", required=False,
               help="module:attribute naming a Worker, or a function taking an Engine and returning one")
    env_option(work, "--concurrency", env="COMPOSER_WORKER_CONCURRENCY", type=int,
               help="override the Worker's concurrency")
    env_option(work, "--prefetch", env="COMPOSER_WORKER_PREFETCH", type=int, metavar="N",
               help="override the Worker's prefetch: tasks its claims may take beyond its free slots while "
                    f"its handlers are short (each of its last ones within {SHORT_HANDLER_S:g} s) and its last claim "
                    "for all its free slots got all it asked for, held for the "
                    f"next slot that frees, their leases extended meanwhile (0 to {MAX_PREFETCH}; 0: free slots "
                    "only)")
    env_option(work, "--poll-interval", env="COMPOSER_WORKER_POLL_INTERVAL", type=float, metavar="SECONDS",
               help="override the Worker's poll interval (1): the longest an idle worker waits between claims "
                    "without a wake-up; a rate-limited task held for a token goes at the next claim, so a "
                    "rate_limit's burst below per_s x this caps the rate (docs/spec.md)")
    env_option(work, "--registry-interval", env="COMPOSER_WORKER_REGISTRY_INTERVAL", type=float, metavar="SECONDS",
               help="override the seconds between the worker's heartbeats in the workers registry (10); "
                    "`workers list` calls a worker dead after three intervals without one")
    add_connect_wait_option(work)
    add_shutdown_timeout_option(work, "for running handlers to finish; a handler still running then is "
                                      "abandoned (its lease is no longer extended, the task is retried "
                                      "elsewhere after the lease) and the worker exits 1 naming it")


def add_connect_wait_option(parser: argparse.ArgumentParser) -> None:
    env_option(parser, "--connect-wait", env="COMPOSER_CONNECT_WAIT_S", type=float, default=60.0, metavar="SECONDS",
               metavar_default="60",
               help="seconds to wait at start-up for a database that is down, starting or shutting down "
                    "(0: exit at once); a bad password or database name exits at once either way")


def add_shutdown_timeout_option(parser: argparse.ArgumentParser, what: str) -> None:
    env_option(parser, "--shutdown-timeout", env="COMPOSER_SHUTDOWN_TIMEOUT", type=float,
               default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar_default=f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}",
               metavar="SECONDS", help=f"on SIGTERM or SIGINT, stop taking work and wait at most SECONDS {what}")


def _shutdown_timeout(args: argparse.Namespace) -> float:
    check_shutdown_timeout(args.shutdown_timeout)
    return float(args.shutdown_timeout)


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT call ``stop`` while the block runs, and SIGUSR1 writes every
    thread's stack to stderr (what a process that does not stop is waiting on); the
    handlers that were installed before are put back afterwards. Only this entry point
    installs handlers: a Worker or Coordinator used as a library leaves its host's
    signals alone.

    ``stop`` runs on a thread of its own; the handler only writes a byte to a pipe that
    thread reads (``os.write`` takes no Python lock). A handler runs on the main thread
    between two of its bytecodes, possibly while that thread holds a lock ``stop`` takes:
    a worker's main thread inside its wake-up Event's wait or clear, whose ``set()`` from
    the handler then waited on its own thread forever (the flaky-test finder saw a worker
    ignore SIGTERM until it was killed). A process forked from this one (a task using
    multiprocessing) inherits the handler but not the thread: there the handler puts the
    handler from before the block back and raises the signal again, so the child does what
    it would have done, and its signal never reaches this process's pipe."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    owner = os.getpid()
    previous: dict[int, Any] = {}

    def handler(signum: int, _frame: object) -> None:
        if os.getpid() != owner:
            signal.signal(signum, previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        with contextlib.suppress(OSError):      # a full pipe: a stop is on its way already
            os.write(write_end, b"s")

    def watch() -> None:
        while True:
            try:
                got = os.read(read_end, 64)
            except OSError:
                return
            if not got:                         # the write end closed: the block ended
                return
            try:
                stop()
            except Exception as exc:            # the next signal still gets its stop()
                sys.stderr.write(f"composer-ops: stopping on a signal failed: {exc!r}\n")

    watcher = threading.Thread(target=watch, name="composer-signals", daemon=True)
    watcher.start()
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, handler)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        for number, old in previous.items():
            signal.signal(number, old)
        os.close(write_end)
        watcher.join(5)
        if not watcher.is_alive():              # else a stop() still running may read again
            os.close(read_end)


def _connect_wait(args: argparse.Namespace) -> float:
    if args.connect_wait < 0:
        raise Invalid(f"--connect-wait must be 0 or more seconds, got {args.connect_wait:g}")
    return float(args.connect_wait)


@functools.cache
def _yaml_loader() -> Any:
    """YAML's safe loader, less its timestamps: an unquoted date or instant (``until:
    2030-01-01T00:00:00Z``) stays the text written, as in JSON, which has no dates."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    return Loader


def load_definition(path: str) -> Any:
    """Read a JSON or YAML definition, with errors that name the file and position."""
    if path == "-":
        text, name = sys.stdin.read(), "<stdin>"
    else:
        file = Path(path)
        if file.is_dir():
            raise Invalid(f"{path}: a directory, not a definition file")
        if not file.is_file():
            raise Invalid(f"{path}: no such file")
        text, name = file.read_text(encoding="utf-8"), path
    if name.endswith((".yaml", ".yml")) or (not text.lstrip().startswith(("{", "["))):
        import yaml

        try:
            return yaml.load(text, Loader=_yaml_loader())   # a SafeLoader
        except RecursionError:
            raise Invalid(f"{name}: YAML nests too deeply to be a workflow definition") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
            raise Invalid(f"{name}: not valid YAML{where}: {problem}") from None
    return json_arg(text, name)


def cmd_deploy(args: argparse.Namespace) -> int:
    spec = load_definition(args.file)
    with open_engine(args, pool_size=2) as engine:
        workflow_id, version = engine.deploy(spec)
    print(f"deployed {workflow_id} v{version}")
    return EXIT_OK


def cmd_start(args: argparse.Namespace) -> int:
    payload = json_arg(args.input, "--input")
    with open_engine(args, pool_size=2) as engine:
        print(engine.start(args.workflow, input=payload, version=args.version, run_id=args.run_id))
    return EXIT_OK


def cmd_signal(args: argparse.Namespace) -> int:
    payload = json_arg(args.payload, "--payload")
    with open_engine(args, pool_size=2) as engine:
        outcome = engine.signal(args.run_id, args.name, payload, key=args.key)
    print("already signalled with this key" if outcome.duplicate else "signalled")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with open_engine(args, pool_size=2) as engine:
        outcome = engine.cancel(args.run_id, reason=args.reason)
    print("cancelled" if outcome.applied else f"unchanged: {outcome.stale}")
    return EXIT_OK


def cmd_runs_show(args: argparse.Namespace) -> int:
    from composer_ops.errors import NotFound

    with open_engine(args, pool_size=2) as engine:
        try:
            run = engine.get_run(args.run_id)
        except NotFound as exc:
            raise NotFound(f"{exc}{_maybe_archived(engine, args.run_id)}") from exc
    tried = attempts(run.history)
    if args.json:
        emit_json({**{k: v for k, v in run.__dict__.items() if k not in ("tasks", "history", "children")},
                   "children": [c.__dict__ for c in run.children],
                   "tasks": [t.__dict__ for t in run.tasks],
                   "attempts": [a.as_dict() for a in tried],
                   "history": [{k: v for k, v in h.__dict__.items() if k != "request"} for h in run.history]})
        return EXIT_OK
    print(f"run {run.id}  {run.workflow_id} v{run.workflow_version}  {run.status}")
    if not run.definition_found:
        print(f"odd data: {run.workflow_id} v{run.workflow_version} is not in workflow_definitions, so no event of "
              "this run can be decided (restore that version's definition row, or cancel the run)")
    done = f"{run.completed_at:%Y-%m-%d %H:%M:%S%z}" if run.completed_at else "-"
    print(f"created {run.created_at:%Y-%m-%d %H:%M:%S%z}  completed {done}")
    if run.error:
        print(f"error: {_error_text(run.error)}")
    if run.output is not None:
        print(f"output: {json_text(run.output, ensure_ascii=False)}")
    if run.parent_run_id:
        print(f"parent: run {run.parent_run_id} (node {run.parent_node_id})")
    for child in run.children:
        print(f"child: run {child.id} of {child.workflow_id} (node {child.node_id})  {child.status}")
    retried = sum(h.kind == "retried" for h in run.history)
    print(f"{'node':<24} {'type':<15} {'state':<10} {'attempt':>7}  detail")
    items: dict[str, Counter[str]] = {}
    for t in run.tasks:
        if t.item_index is not None:          # a MAP item: counted per node below, not listed
            items.setdefault(t.node_id, Counter())[t.state] += 1
            continue
        # A task that failed an attempt and went on keeps that attempt's error: not its own.
        error = (_error_text(t.error) if t.state in ("FAILED", "CANCELLED") or not t.error
                 else f"an earlier attempt's error: {_error_text(t.error)}")
        detail = error or (f"waits for {t.signal_name!r}" if t.state == "WAITING" and t.signal_name else "")
        if t.state == "WAITING" and t.wake_at:
            detail = f"{detail} until {t.wake_at:%Y-%m-%d %H:%M:%S%z}".strip()
        print(f"{t.node_id:<24} {t.node_type:<15} {t.state:<10} {t.attempt:>7}  {detail}")
    for node_id, counts in items.items():
        print(f"{node_id + '[items]':<24} {'MAP':<15} {sum(counts.values())} items: "
              + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
    if retried:
        print(f"(the run was retried {retried} time(s): a retried node's attempts count from 0 again, "
              "shown as 'N (retry R)' below)")
    print("attempts:" if tried else "attempts: none")
    item_of = {t.id: t.item_index for t in run.tasks if t.item_index is not None}
    for a in tried:
        print(f"  {describe_attempt(a, item=item_of.get(a.task_id))}")
    print("history:" if run.history else "history: none")
    generation = 0
    for h in run.history:
        generation += h.kind == "retried"
        print(f"  {h.at:%Y-%m-%d %H:%M:%S.%f%z}  {describe_history(h, retry=generation)}")
    return EXIT_OK


def _maybe_archived(engine: Engine, run_id: str) -> str:
    """For a run whose month has no partition (retention dropped it): where it may be now."""
    from composer_ops.core.runids import month_of, validate_run_id

    month = month_of(validate_run_id(run_id, normalise=True))
    if month in {p.month for p in engine.list_partitions()}:
        return ""
    return (f"; its month {month} has no partition (retention dropped it?): if it was archived, restore the "
            f"month with `composer-ops partitions restore {month} --from DIR` (DIR: the archive directory, "
            "e.g. COMPOSER_ARCHIVE_DIR; without --yes it only checks the archive), then run `runs show` again")


def cmd_runs_delete(args: argparse.Namespace) -> int:
    from composer_ops.core.model import TERMINAL_RUN_STATUSES
    from composer_ops.errors import Conflict

    with open_engine(args, pool_size=2) as engine:
        if args.yes:
            done = engine.delete_run(args.run_id, actor=admin_cmds.actor(args))
            record = {"run_id": done.run_id, "status": done.status, "action": "already deleted" if done.already
                      else "deleted", "deleted_at": done.deleted_at, "webhooks_given_up": done.webhooks_given_up}
            text = (f"run {done.run_id} ({done.status}) was already deleted at {done.deleted_at:%Y-%m-%d %H:%M:%S%z}"
                    if done.already else f"deleted run {done.run_id} ({done.status})"
                    + (", its pending webhook given up" if done.webhooks_given_up else ""))
        else:
            run = engine.get_run(args.run_id)
            if run.status not in TERMINAL_RUN_STATUSES:
                raise Conflict(f"run {run.id} is {run.status}: only finished runs can be deleted (cancel it first)")
            record = {"run_id": run.id, "status": run.status, "action": "would delete", "tasks": len(run.tasks)}
            text = (f"would delete run {run.id} ({run.workflow_id} v{run.workflow_version}, {run.status}, "
                    f"{len(run.tasks)} tasks); nothing was changed (add --yes to delete)")
    if args.json:
        emit_json(record)
    else:
        print(text)
    return EXIT_OK


def _error_text(doc: Any) -> str:
    """A stored error document (``{"error": text}``) as its text; anything else as JSON."""
    if isinstance(doc, dict) and set(doc) == {"error"} and isinstance(doc["error"], str):
        return doc["error"]
    return json_text(doc, ensure_ascii=False)


def describe_attempt(a: Attempt, *, item: int | None = None) -> str:
    """One line for an attempt of a task (:func:`composer_ops.core.attempts.attempts`);
    ``item``: the MAP item's index, when the task is one."""
    node = a.node_id or "-"
    if item is not None:
        node = f"{node}[{item}]"
    began = f"{a.claimed_at:%Y-%m-%d %H:%M:%S%z}" if a.claimed_at else "-"
    ended = f"{a.ended_at:%Y-%m-%d %H:%M:%S%z}" if a.ended_at else "-"
    then = "" if a.requeued is None else (" (re-queued)" if a.requeued else " (gave up)")
    error = f": {a.error}" if a.error else ""
    lost = f"; the worker noted: {a.lost}" if a.lost else ""
    return (f"{node:<24} {a.label:>11}  {a.worker or '-':<36} {began}  {ended}  "
            f"{a.outcome}{then}{error}{lost}")


def _by_operator(d: dict[str, Any]) -> str:
    op = d.get("operator")
    if not isinstance(op, dict):
        return ""
    where = f" on {op['host']}" if op.get("host") else ""
    return f" [operator: {op.get('command') or op.get('action')}{where}]"


def describe_history(h: HistoryRow, *, retry: int = 0) -> str:
    """One line for a row of a run's history; ``retry``: the run's retries before it."""
    d: dict[str, Any] = h.detail if isinstance(h.detail, dict) else {}
    generation = f" (retry {retry})" if retry and h.kind != "retried" else ""
    node = f"{h.node_id}" + (f" attempt {h.attempt}{generation}" if h.attempt is not None else "") if h.node_id else ""
    by = f" by {h.worker}" if h.worker else ""
    then = f"; run {d['finished']}" if "finished" in d else ""
    if h.kind in ("failed", "lease_expired"):
        what = "re-queued" if d.get("requeued") else "gave up"
        label = "failed" if h.kind == "failed" else "lease expired"
        return f"{label:<15} {node}{by}: {d.get('error', '')} ({what}){then}"
    if h.kind == "signal":
        key = f" (key {d['key']!r})" if "key" in d else ""
        name = f"signal {d.get('name', '')!r}{key}"
        if "refused" in d:
            return f"{'signal':<15} {name} refused: {d['refused']}"
        if "buffered" in d:
            return f"{'signal':<15} {name} buffered{then}"
        return f"{'signal':<15} {name} resolved {h.node_id}{then}"
    if h.kind == "signal_consumed":
        return f"{'signal':<15} buffered signal consumed by {h.node_id}{then}"
    if h.kind == "timer":
        at_signal = " (overdue when a signal came)" if d.get("judged_at") == "signal" else ""
        error = f": {d['error']}" if "error" in d else ""
        return f"{'timer':<15} {h.node_id} {d.get('state', '')}{error}{at_signal}{then}"
    if h.kind == "cancelled":
        return (f"{'cancelled':<15} {d.get('reason', '')} ({d.get('tasks', 0)} active task(s) cancelled)"
                f"{_by_operator(d)}")
    if h.kind == "retried":
        start = ", ".join(d.get("from") or []) or "the failed nodes"
        reset = ", ".join(d.get("reset") or []) or "none"
        return f"{'retried':<15} from {start}; run again: {reset}{then}{_by_operator(d)}"
    if h.kind == "deleted":
        return f"{'deleted':<15} the run ({d.get('status', '')}){_by_operator(d)}"
    if h.kind == "lease_lost":
        return f"{'lease lost':<15} {node}{by}: {d.get('reason', '')}"
    extra = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("finished", "operator"))
    return f"{h.kind:<15} {node}{by}{': ' + extra if extra else ''}{then}".rstrip()


def _require_migrated(engine: Engine) -> None:
    """A worker or coordinator serves nothing on a database without this version's
    migrations (every claim or pass would fail, for ever): one line, exit 1, first."""
    from composer_ops.db import migrate

    with engine.pool.connection() as conn:
        migrate.require_current(conn)


def cmd_coordinator(args: argparse.Namespace) -> int:
    relay = RelayPolicy(connect_timeout_s=args.webhook_connect_timeout, timeout_s=args.webhook_timeout,
                        deadline_s=args.webhook_deadline)   # bad values are refused before connecting
    retention = parse_cutoff(args.retention) if args.retention else None
    wait = _connect_wait(args)
    shutdown_timeout = _shutdown_timeout(args)
    with Engine.connect(args.database_url, pool_size=4, application_name="composer-coordinator",
                        connect_wait_s=wait) as engine:
        _require_migrated(engine)
        coord = engine.coordinator(interval=args.interval, months_ahead=args.months_ahead, relay=relay,
                                   retention=retention, webhook_keep_days=args.webhook_keep_days,
                                   event_lock_wait_s=args.event_lock_wait)
        if args.once:
            stats = coord.run_once()
            print(f"timers fired {stats.timers_fired}, leases expired {stats.leases_expired}, "
                  f"stale {stats.stale}, partitions created {stats.partitions_created}, "
                  f"webhooks delivered {stats.webhooks_delivered} (failed {stats.webhooks_failed})"
                  + (f", months dropped by retention {', '.join(stats.months_dropped)}" if stats.months_dropped
                     else "")
                  + (f", backed off behind a locked run {stats.busy}" if stats.busy else ""))
            for err in stats.errors:
                say(str(err))
            return 1 if stats.errors else EXIT_OK
        # The loops run in a daemon thread so that a pass stuck past the deadline
        # (a hung endpoint, a lock) cannot keep the process from exiting.
        loops = threading.Thread(target=coord.run, name="composer-coordinator", daemon=True)
        stopped = threading.Event()

        def stop() -> None:
            stopped.set()
            coord.stop()

        say(f"coordinator running every {coord.interval:g}s on {_where(engine)}; SIGTERM or SIGINT stops it")
        with stop_on_signals(stop):
            loops.start()
            while loops.is_alive() and not stopped.is_set():
                loops.join(0.5)
            deadline = time.monotonic() + shutdown_timeout
            while loops.is_alive() and time.monotonic() < deadline:
                loops.join(min(0.5, max(0.0, deadline - time.monotonic())))
        if loops.is_alive():
            raise ShutdownTimeout(f"coordinator: the loop pass in progress did not finish within "
                                  f"{shutdown_timeout:g}s of the stop signal; exiting without it (whatever it "
                                  "held, webhook deliveries or a sweep, is picked up again by any coordinator)")
        say("coordinator stopped")
    return EXIT_OK


def find_app(spec: str) -> object:
    """Import ``module:attribute`` and return the attribute (a Worker or a factory),
    before any connection is made: a typo fails at once, not after waiting for the
    database."""
    if not spec or ":" not in spec:
        raise Invalid(f"--app must look like module:attribute, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise Invalid(f"--app {spec}: cannot import {module_name!r}: {exc}") from None
    except Exception as exc:    # the module's own code failed (SyntaxError, NameError, ...): --debug shows where
        raise Invalid(f"--app {spec}: importing {module_name!r} raised {type(exc).__name__}: "
                      f"{first_line(exc)}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise Invalid(f"--app {spec}: module {module_name!r} has no attribute {attr!r}")
    if not isinstance(target, Worker) and not callable(target):
        raise Invalid(f"--app {spec}: expected a Worker or a function returning one, got {type(target).__name__}")
    return target


def load_app(spec: str, target: object, engine: Engine) -> Worker:
    """The Worker ``find_app(spec)`` found, or the one its factory builds with the Engine."""
    # A factory gets this command's Engine (and so --database-url); a ready-made
    # Worker keeps the Engine it was built with.
    if isinstance(target, Worker):
        return target
    try:
        worker = target(engine) if callable(target) else None
    except ComposerError:       # the database (unavailable, refused): reported as such, not as bad input
        raise
    except Exception as exc:    # the factory's own code (or a callable that is no factory): --debug shows where
        raise Invalid(f"--app {spec}: calling it with the Engine raised {type(exc).__name__}: "
                      f"{first_line(exc)}") from exc
    if not isinstance(worker, Worker):
        raise Invalid(f"--app {spec}: expected a Worker or a function returning one, got {type(target).__name__} "
                      f"returning {type(worker).__name__}")
    return worker


def cmd_worker(args: argparse.Namespace) -> int:
    if not args.app:
        raise Invalid("worker needs --app module:attribute (or COMPOSER_WORKER_APP)")
    if args.concurrency is not None and args.concurrency < 1:
        raise Invalid(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.prefetch is not None and not 0 <= args.prefetch <= MAX_PREFETCH:
        raise Invalid(f"--prefetch must be from 0 to {MAX_PREFETCH} tasks, got {args.prefetch}")
    if args.poll_interval is not None and not 0 < args.poll_interval <= 3600:
        raise Invalid(f"--poll-interval must be more than 0 and at most 3600 seconds, got {args.poll_interval:g}")
    if args.registry_interval is not None and not 0 < args.registry_interval <= 3600:
        raise Invalid(f"--registry-interval must be more than 0 and at most 3600 seconds, "
                      f"got {args.registry_interval:g}")
    target = find_app(args.app)
    wait = _connect_wait(args)
    shutdown_timeout = _shutdown_timeout(args)
    with Engine.connect(args.database_url, application_name="composer-worker", connect_wait_s=wait) as engine:
        _require_migrated(engine)
        worker = load_app(args.app, target, engine)
        if args.concurrency:
            worker.concurrency = args.concurrency
        if args.prefetch is not None:
            worker.prefetch = args.prefetch
        worker.shutdown_timeout = shutdown_timeout
        if args.poll_interval is not None:
            worker.poll_interval = args.poll_interval
        if args.registry_interval is not None:
            worker.registry_interval = args.registry_interval
        say(f"worker {worker.worker_id} serving queue(s) {', '.join(worker.queues)} "
             f"({len(worker.task_names)} task name(s)) with {worker.concurrency} slot(s) on "
             f"{_where(engine)}; SIGTERM or SIGINT stops it")
        with stop_on_signals(worker.stop):
            worker.run()
        say(f"worker {worker.worker_id} stopped")
    return EXIT_OK


def _where(engine: Engine) -> str:
    """The engine's database, as host, port and name: never the URL, which may hold a
    password."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(engine.url or "")
    except psycopg.ProgrammingError:
        return "its database"
    host = str(info.get("host") or "local socket")
    return f"database {info.get('dbname') or '?'} at {host}" + (f":{info['port']}" if info.get("port") else "")
