"""Reports, runbooks and ops functions on a database of at least 10 million task rows.

``python -m bench.notebooks`` builds (or reuses) a database of 12 months of history
with the simulator's backfill (``composer-ops simulate --history-months 12
--runs-per-month N --no-live``: about 7 task rows per run, so N = 125,000 gives
about 10.4 million), adds a little live traffic so there are RUNNING and WAITING
tasks to look at, runs ANALYZE as an operator would after a bulk load, then times:

- every function of :mod:`composer_ops.ops` the notebooks call (in this process);
- every report, ``composer-ops report NAME`` as the scheduled job runs it (its own
  process and kernel), ``--rounds`` times (default 3, round-robin; the median is the
  figure): the whole command, the notebook's own execution (papermill's metadata:
  without process and kernel start-up and HTML rendering), and the kernel's peak
  resident memory (polled every 0.1 s);
- every runbook, ``composer-ops runbook NAME`` as the on-call engineer runs it
  (diagnose and plan, no ``confirm``), with its default parameters, and ``find_run``
  also as an incident asks it, by an order ID that no run has (every month is read)
  and by a customer (:data:`RUNBOOK_CASES`); timed as the reports are.

Building takes 5-15 minutes on 2 cores (machine load), so it is not part of ``make bench``; its
result, ``bench/results/notebooks-<date>-<commit>.json`` with a copy in
``notebooks-latest.json``, is included in the next ``make bench``'s results.
``--database-url`` reuses a database already built (with ``--skip-build``), e.g. the
one ``--keep`` left behind. ``--before DIR`` times the
reports of another checkout (e.g. ``git worktree add DIR <commit>``) side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg

from bench.procs import ROOT
from bench.report import dated_path, notebooks_table

RESULT = ROOT / "bench" / "results" / "notebooks-latest.json"


def _cli(url: str, *args: str, timeout: float = 7200) -> tuple[float, str]:
    env = {**os.environ, "COMPOSER_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "composer_ops", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"composer-ops {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-1500:]}")
    return time.monotonic() - start, out.stdout


def task_rows(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM task_instances").fetchone()
    return int(row[0]) if row else 0


def build(url: str, *, runs_per_month: int, months: int, live_runs: int, history: bool = True) -> dict[str, Any]:
    from composer_ops.db.migrate import migrate

    migrate(url)
    history_s, out = 0.0, ""
    if history:
        history_s, out = _cli(url, "simulate", "--history-months", str(months), "--runs-per-month",
                              str(runs_per_month), "--no-live", "--no-progress")
    live_s = 0.0
    if live_runs:
        live_s, _ = _cli(url, "simulate", "--runs", str(live_runs), "--duration-s", "20", "--kill-workers", "1",
                         "--no-progress")
    with psycopg.connect(url, autocommit=True) as conn:
        start = time.monotonic()
        conn.execute("ANALYZE")
        analyze_s = time.monotonic() - start
    return {"history_s": history_s, "live_s": live_s, "analyze_s": analyze_s,
            "history_summary": out.strip().splitlines()[-20:]}


def _ops_calls() -> list[tuple[str, Callable[[psycopg.Connection[Any]], Any]]]:
    from composer_ops import ops

    def story(conn: psycopg.Connection[Any]) -> Any:
        run_id = ops.latest_run_id(conn) or ops.latest_run_id(conn, status=None)
        return ops.run_story(conn, run_id) if run_id else None

    return [
        ("partition_inventory", lambda c: ops.partition_inventory(c)),
        ("partition_inventory(exact=True)", lambda c: ops.partition_inventory(c, exact=True)),
        ("lookahead", lambda c: ops.lookahead(c)),
        ("growth", lambda c: ops.growth(c)),
        ("active_tasks", lambda c: ops.active_tasks(c)),
        ("active_by_group", lambda c: ops.active_by_group(c)),
        ("age_histogram", lambda c: ops.age_histogram(c)),
        ("top_runs", lambda c: ops.top_runs(c)),
        ("active_run_count", lambda c: ops.active_run_count(c)),
        ("outbox_backlog", lambda c: ops.outbox_backlog(c)),
        ("running_leases", lambda c: ops.running_leases(c)),
        ("attempt_distribution", lambda c: ops.attempt_distribution(c)),
        ("recent_requeues", lambda c: ops.recent_requeues(c)),
        ("retention_plan", lambda c: ops.retention_plan(c, "6 months")),
        ("latest_run_id + run_story", story),
    ]


def time_ops(url: str) -> list[dict[str, Any]]:
    items = []
    for name, call in _ops_calls():
        with psycopg.connect(url, autocommit=True) as conn:
            start = time.monotonic()
            value = call(conn)
            seconds = time.monotonic() - start
        rows = getattr(value, "height", None)
        items.append({"name": f"ops.{name}", "seconds": seconds, "rows": rows})
    return items


def _peak_rss(proc: subprocess.Popen[bytes]) -> tuple[float, float]:
    """Wait for ``proc``; return (peak RSS of its kernel process in MB, seconds)."""
    start = time.monotonic()
    peak = 0
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                try:
                    if "ipykernel" in " ".join(child.cmdline()) or "kernel" in child.name():
                        peak = max(peak, child.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        time.sleep(0.1)
    return peak / 2**20, time.monotonic() - start


def _executed_seconds(folder: Path) -> float | None:
    """The notebook's own execution time (papermill's metadata), without the process
    and kernel start-up and the HTML rendering around it."""
    found = sorted(folder.glob("*.ipynb"))
    if not found:
        return None
    meta = json.loads(found[-1].read_text()).get("metadata", {}).get("papermill", {})
    duration = meta.get("duration")
    return float(duration) if duration is not None else None


def _timed(args: list[str], url: str, record: Path, root: Path = ROOT) -> dict[str, Any]:
    """``composer-ops ARGS`` of the tree at ``root`` (its package first on the path),
    timed, its kernel's peak memory polled; ``record``: the folder its executed notebook
    is kept in (the notebook's own execution time is read from it)."""
    env = {**os.environ, "COMPOSER_DATABASE_URL": url, "PYTHONPATH": str(root), "COMPOSER_REPORT_PROGRESS": "0"}
    # stderr to a file, not a pipe: nothing reads a pipe while the command runs, so one
    # that filled it would block the command for good.
    with tempfile.TemporaryFile() as stderr, \
            subprocess.Popen([sys.executable, "-m", "composer_ops", *args], cwd=root, env=env,
                             stdout=subprocess.DEVNULL, stderr=stderr) as proc:
        peak_mb, seconds = _peak_rss(proc)
        stderr.seek(0)
        err = stderr.read().decode(errors="replace")
    return {"seconds": seconds, "peak_rss_mb": peak_mb or None, "notebook_seconds": _executed_seconds(record),
            "ok": proc.returncode == 0, "error": err.strip()[-500:] if proc.returncode else None}


def _one_report(url: str, name: str, out: str, root: Path = ROOT) -> dict[str, Any]:
    """``composer-ops report NAME``."""
    return _timed(["report", name, "--out", out], url, Path(out) / name, root)


def _one_runbook(url: str, name: str, params: tuple[tuple[str, str], ...], out: str) -> dict[str, Any]:
    """``composer-ops runbook NAME -p KEY VALUE ...`` (diagnose and plan: no confirm)."""
    pairs = [arg for key, value in params for arg in ("-p", key, value)]
    return _timed(["runbook", name, *pairs, "--out", out], url, Path(out) / "runbooks" / name)


def _summary(label: str, got: list[dict[str, Any]]) -> dict[str, Any]:
    times = [r["seconds"] for r in got]
    executed = [r["notebook_seconds"] for r in got if r["notebook_seconds"] is not None]
    failed = [r for r in got if not r["ok"]]
    return {"name": label, "seconds": statistics.median(times), "seconds_each": times,
            "notebook_seconds": statistics.median(executed) if executed else None,
            "peak_rss_mb": max((r["peak_rss_mb"] or 0 for r in got), default=0) or None,
            "ok": not failed, "error": failed[0]["error"] if failed else None}


def time_reports(url: str, rounds: int = 3, before: Path | None = None) -> list[dict[str, Any]]:
    """Each report ``rounds`` times (round-robin, so a burst of load on the shared
    machine hits every report alike); ``seconds`` is the median of the rounds. With
    ``before`` (another checkout), that tree's report runs next to this one's in every
    round, the order flipping each round, and its items are labelled ``before``."""
    from composer_ops.reports import available

    names = available()
    trees = [("", ROOT)] + ([(" (before)", before)] if before else [])
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_no in range(rounds):
        for name in names:
            for label, root in (trees if round_no % 2 == 0 else trees[::-1]):
                with tempfile.TemporaryDirectory(prefix="composer-bench-reports-") as out:
                    runs.setdefault(f"report {name}{label}", []).append(_one_report(url, name, out, root))
    return [_summary(label, got) for label, got in sorted(runs.items())]


def runbook_cases() -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """(label, runbook, parameters): every runbook with its defaults, and ``find_run``
    as an incident asks it: by an order ID no run has (the simulator's are ORD- and 7
    digits), so every month is read, and by one customer (C-00042; the simulator draws
    25,000)."""
    from composer_ops.runbooks.catalogue import RUNBOOKS

    cases: list[tuple[str, str, tuple[tuple[str, str], ...]]] = [(f"runbook {r.name}", r.name, ()) for r in RUNBOOKS]
    cases += [("runbook find_run, an order ID no run has", "find_run", (("where", "input.order_id=ORD-NONE"),)),
              ("runbook find_run, a customer", "find_run", (("where", "input.customer=C-00042"),))]
    return cases


def time_runbooks(url: str, rounds: int = 3,
                  cases: list[tuple[str, str, tuple[tuple[str, str], ...]]] | None = None) -> list[dict[str, Any]]:
    """Each of ``cases`` (default :func:`runbook_cases`) ``rounds`` times, round-robin;
    ``seconds`` is the median of the rounds."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for label, name, params in cases if cases is not None else runbook_cases():
            with tempfile.TemporaryDirectory(prefix="composer-bench-runbooks-") as out:
                runs.setdefault(label, []).append(_one_runbook(url, name, params, out))
    return [_summary(label, got) for label, got in runs.items()]


def measure(url: str, rounds: int = 3, before: Path | None = None) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        months = conn.execute("""SELECT count(*) FROM pg_inherits
                                  WHERE inhparent = 'task_instances'::regclass""").fetchone()[0]  # type: ignore[index]
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]  # type: ignore[index]
    rows = task_rows(url)
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "server_version": version,
            "task_rows": rows, "task_partitions": int(months), "database_bytes": int(size),
            "report_rounds": rounds, "before_tree": str(before) if before else None,
            "items": time_ops(url) + time_reports(url, rounds, before) + time_runbooks(url, rounds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="use this database (default: a new one on a throwaway server)")
    parser.add_argument("--skip-build", action="store_true", help="the database is already filled")
    parser.add_argument("--skip-history", action="store_true",
                        help="the history is there: only add live traffic and ANALYZE")
    parser.add_argument("--runs-per-month", type=int, default=125_000)
    parser.add_argument("--months", type=int, default=12)
    parser.add_argument("--live-runs", type=int, default=150)
    parser.add_argument("--keep", action="store_true", help="keep the throwaway server running at the end "
                                                            "(prints its URL; stop it with kill)")
    parser.add_argument("--rounds", type=int, default=3, help="times each report runs; the median is reported")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="also time the reports of the checkout in DIR, side by side in every round")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default bench/results/notebooks-<date>-<commit>.json; "
                             "notebooks-latest.json, which make bench reports, is a copy)")
    args = parser.parse_args(argv)
    url = args.database_url
    if url is None:
        from composer_ops.testing import servers

        server = servers.session().primary
        url = server.create_database("bench_notebooks")
    built: dict[str, Any] = {}
    if not args.skip_build:
        what = "live traffic" if args.skip_history else f"{args.months} months x {args.runs_per_month:,} runs"
        sys.stderr.write(f"[notebooks] building: {what}\n")
        built = build(url, runs_per_month=args.runs_per_month, months=args.months, live_runs=args.live_runs,
                      history=not args.skip_history)
    sys.stderr.write("[notebooks] timing ops functions and reports\n")
    result = {**measure(url, args.rounds, args.before), "build": built,
              "command": "python -m bench.notebooks " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = args.out or dated_path(RESULT.parent, "notebooks-")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.out is None:
        shutil.copyfile(out, RESULT)
    from rich.console import Console

    Console(width=150).print(notebooks_table(result))
    if args.keep and args.database_url is None:
        sys.stderr.write(f"[notebooks] database kept at {url}; press Ctrl-C to stop the server\n")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
