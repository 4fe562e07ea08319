"""Where the CPU of a 1-task run goes: by process, by function, by statement.

    python -m bench.profile                          # PostgreSQL 15 (Debian's binaries), both systems
    python -m bench.profile --pgbin ''               # the embedded PostgreSQL 18 (no pg_stat_statements)
    python -m bench.profile --systems composer --seconds 20 --out /tmp/profile.json
    python -m bench.profile --systems composer --workflow fan   # the 10-task fan-out/fan-in, per run
    python -m bench.profile --workers 4              # W=4: four worker processes (their CPU summed)

For each system (Composer, then Procrastinate) it runs the sustained 1-task workload
of ``make bench`` (W=1 worker process of concurrency 4, or ``--workers`` W; Composer's
coordinator; a producer of 4 threads holding the backlog at 50 unfinished items) on a fresh
database, and after 2 s of warm-up measures two windows (three with ``--waits``) of
``--seconds`` each:

1. **CPU by process**, from /proc (psutil): each benchmark process (producer, worker,
   coordinator), and each server backend by the ``application_name`` of its session
   (background processes by type; ``server, other`` is what the postmaster's totals
   hold beyond the live backends: exited processes and anything unattributed). And
   **by statement**: ``pg_stat_statements`` (reset at the window's start, with
   ``track = all`` and ``track_planning = on``) on a server that can load it.
2. **By function**: ``py-spy record`` (sampling, 200 Hz, idle threads excluded) of
   each Composer process at once; samples of a function's frames anywhere on the
   stack (inclusive) and at the top (self), in ms of CPU per run.
3. With ``--waits``, **what the sessions wait for**: ``pg_stat_activity`` sampled about
   every 5 ms, each kind of session's mean count by state (the client's turn, in a
   transaction or between them) and, while active, by wait event (``CPU``: none), and
   the runs completed in that window.

Every figure is divided by the runs (jobs) completed inside its window. The windows
are separate because py-spy pauses the process it samples and the sampling session of
the third costs server CPU. The ``bench-backlog`` session is the producer's measuring
device (a count every 10 ms), the same for both systems. Writes ``bench/results/profile-pg<major>-<date>-<commit>.json``
(``profile-fan-pg...`` with ``--workflow fan``, ``profile-w4-pg...`` with ``--workers 4``;
or ``--out``) and prints tables. py-spy is not a dependency: ``pip install py-spy`` into
the environment first, or the function profile is left out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import psycopg
from rich.console import Console
from rich.table import Table

from bench import scenario
from bench.cpu import ServerCPU
from bench.procs import ROOT, db_now
from bench.report import dated_path, require_binaries
from bench.scenario import PRODUCER_THREADS, System
from composer_ops.testing.servers import Server

RESULTS = ROOT / "bench" / "results"
PY_SPY_RATE = 200
#: ``--waits``: the pause between two samples of pg_stat_activity in its window
WAIT_SAMPLE_S = 0.005
#: the producer goes on this long past the windows: py-spy's attaching to each process
#: makes its window longer than ``--seconds``
PRODUCER_SLACK_S = 10
STATEMENT_SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
                      "pg_stat_statements.track_planning": "on"}


def _role(argv: list[str]) -> str:
    text = " ".join(argv)
    if "bench.producer" in text:
        return "producer"
    if "coordinator" in text:
        return "coordinator"
    return "worker"


def _backends(url: str) -> dict[int, str]:
    """Every server process of this database's sessions, by application name, and the
    background processes by type."""
    with psycopg.connect(url, autocommit=True, application_name="bench-profile") as conn:
        rows = conn.execute("""
            SELECT pid, backend_type, application_name, datname = current_database()
              FROM pg_stat_activity WHERE pid <> pg_backend_pid()""").fetchall()
    out: dict[int, str] = {}
    for pid, backend_type, app, ours in rows:
        if backend_type == "client backend":
            if ours:
                out[int(pid)] = f"server, {app or 'unnamed'} sessions"
        else:
            out[int(pid)] = f"server, {backend_type}"
    return out


def _cpu(pids: dict[int, str]) -> dict[int, float]:
    seconds: dict[int, float] = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            seconds[pid] = t.user + t.system
        except psutil.Error:
            pass
    return seconds


def _completed(url: str, system: System, w0: Any, w1: Any) -> int:
    return system.runs_window(url, (w0, w1))[1]


def _statements(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url, autocommit=True, application_name="bench-profile") as conn:
        rows = conn.execute("""
            SELECT query, calls, total_exec_time, total_plan_time, rows, wal_bytes, toplevel
              FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND query NOT LIKE '%%pg_stat_statements%%'
             ORDER BY total_exec_time + total_plan_time DESC""").fetchall()
    return [{"query": " ".join(q.split()), "calls": c, "exec_ms": e, "plan_ms": p, "rows": r,
             "wal_bytes": int(w), "toplevel": t} for q, c, e, p, r, w, t in rows]


def _waits(url: str, seconds: float, every_s: float = WAIT_SAMPLE_S) -> dict[str, Any]:
    """Sample ``pg_stat_activity`` for ``seconds``, sleeping ``every_s`` between two
    samples (the interval is that and the query's time: ``interval_s`` is the mean): per
    session kind (application name), how many of its sessions were in each state on
    average (their sum is its mean number of sessions): ``idle`` (the client's turn,
    between transactions), ``idle in transaction`` (the client's turn inside one),
    ``active`` by wait event (``CPU`` when it waits for none: running or runnable).
    Where the time goes when CPU does not bind the rate."""
    counts: dict[str, Counter[str]] = {}
    samples = 0
    began = time.monotonic()
    with psycopg.connect(url, autocommit=True, application_name="bench-profile") as conn:
        query = """
            SELECT application_name, state, wait_event_type, wait_event FROM pg_stat_activity
             WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()"""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for app, state, wtype, wevent in conn.execute(query).fetchall():
                if state != "active":
                    what = state or "no state"
                elif wtype:
                    what = f"active: {wtype}:{wevent}"
                else:
                    what = "active: CPU"
                counts.setdefault(app or "unnamed", Counter[str]())[what] += 1
            samples += 1
            time.sleep(every_s)
    return {"samples": samples, "every_s": every_s, "interval_s": (time.monotonic() - began) / max(samples, 1),
            "sessions_by_state": {app: {k: v / samples for k, v in c.most_common()}
                                  for app, c in sorted(counts.items())}}


def _py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def _collapse(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    """py-spy's raw output: ``frame;frame;...;frame count`` per line, root first."""
    total, inclusive, own = 0, Counter[str](), Counter[str]()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                  for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return total, inclusive, own


def _add_samples(spied: dict[str, Any], role: str, part: tuple[int, Counter[str], Counter[str]]) -> None:
    """Add one process's samples (:func:`_collapse`) to its role's: W worker processes
    are summed as one role."""
    total, inclusive, own = spied.get(role, (0, Counter[str](), Counter[str]()))
    spied[role] = (total + part[0], inclusive + part[1], own + part[2])


def profile(system: System, server: Server, template: str, *, seconds: float, spy: str | None,
            statements: bool, workflow: str = "one", workers: int = 1, waits: bool = False) -> dict[str, Any]:
    db = f"bench_profile_{system.tag}"
    url = server.create_database(db, template=template)
    result: dict[str, Any] = {"system": system.tag, "window_s": seconds, "workflow": workflow, "workers": workers}
    try:
        server.checkpoint()
        with system.spawn(url, workers, system.root) as group:
            producer = group.spawn(["-m", "bench.producer", system.name, "--url", url, "--workflow", workflow,
                                    "--threads",
                                    str(PRODUCER_THREADS), "--max-backlog", "50", "--seconds",
                                    str(2 + (3 if waits else 2) * seconds + PRODUCER_SLACK_S)],
                                   stdout=subprocess.PIPE)
            time.sleep(2)
            roles = {p.pid: _role([str(a) for a in p.args]) for p in group.procs}  # type: ignore[union-attr]
            result["processes"] = dict(Counter(roles.values()))
            backends = _backends(url)
            server_cpu = ServerCPU(url)
            # window 1: CPU by process, statements
            if statements:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute("SELECT pg_stat_statements_reset()")
            c0, b0, s0, w0 = _cpu(roles), _cpu(backends), server_cpu.seconds(), db_now(url)
            time.sleep(seconds)
            c1, b1, s1, w1 = _cpu(roles), _cpu(backends), server_cpu.seconds(), db_now(url)
            stmts = _statements(url) if statements else None
            # window 2: py-spy on every process of the system
            spied: dict[str, Any] = {}
            if spy:
                tmp = Path(tempfile.mkdtemp(prefix="bench-profile-"))
                recorders = []
                v0 = db_now(url)
                for pid, role in roles.items():
                    out = tmp / f"{role}-{pid}.txt"
                    recorders.append((role, out, subprocess.Popen(
                        [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                         str(PY_SPY_RATE), "--gil", "--format", "raw", "--output", str(out)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
                for _, _, rec in recorders:
                    rec.wait(seconds + 60)
                v1 = db_now(url)
                spied["runs"] = _completed(url, system, v0, v1)
                for role, out, _ in recorders:
                    if out.exists():
                        _add_samples(spied, role, _collapse(out))
                shutil.rmtree(tmp, ignore_errors=True)
            if waits:     # window 3: what the sessions wait for, and the runs it saw finish
                v0 = db_now(url)
                result["waits"] = _waits(url, seconds)
                result["waits"]["runs"] = _completed(url, system, v0, db_now(url))
            producer.communicate(timeout=3 * seconds + 60 + PRODUCER_SLACK_S)
        runs = _completed(url, system, w0, w1)
        result["runs"] = runs
        result["runs_per_s"] = runs / seconds
        by_process: dict[str, float] = {}
        for pid, role in roles.items():
            if pid in c0 and pid in c1:
                by_process[role] = by_process.get(role, 0.0) + c1[pid] - c0[pid]
        attributed = 0.0
        for pid, label in backends.items():
            if pid in b0 and pid in b1:
                by_process[label] = by_process.get(label, 0.0) + b1[pid] - b0[pid]
                attributed += b1[pid] - b0[pid]
        if s0 is not None and s1 is not None:
            by_process["server, other"] = max(0.0, (s1 - s0) - attributed)
        ranked = sorted(by_process.items(), key=lambda kv: -kv[1])
        result["cpu_ms_per_run"] = {k: v / runs * 1000 for k, v in ranked} if runs else {}
        result["cpu_ms_per_run_total"] = sum(by_process.values()) / runs * 1000 if runs else None
        if stmts is not None:
            result["statements"] = [{**s, "calls_per_run": s["calls"] / runs if runs else None,
                                     "ms_per_run": (s["exec_ms"] + s["plan_ms"]) / runs if runs else None}
                                    for s in stmts[:40]]
        if spied:
            spy_runs = spied.pop("runs")
            result["py_spy"] = {"runs": spy_runs, "rate_hz": PY_SPY_RATE, "processes": {}}
            for role, (total, inclusive, own) in spied.items():
                scale = 1000 / PY_SPY_RATE / spy_runs if spy_runs else 0.0
                result["py_spy"]["processes"][role] = {
                    "samples": total, "ms_per_run": total * scale,
                    "inclusive_ms_per_run": {k: v * scale for k, v in inclusive.most_common(60)},
                    "self_ms_per_run": {k: v * scale for k, v in own.most_common(30)}}
        return result
    finally:
        server.drop_database(db)


def render(results: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="CPU ms per run (job), by process")
    table.add_column("process")
    for r in results:
        table.add_column(r["system"], justify="right")
    labels: list[str] = []
    for r in results:
        labels += [k for k in r["cpu_ms_per_run"] if k not in labels]
    for label in labels:
        table.add_row(label, *(f"{r['cpu_ms_per_run'].get(label, 0.0):.3f}" for r in results))
    table.add_row("total", *(f"{r['cpu_ms_per_run_total'] or 0:.3f}" for r in results))
    table.add_row("runs/s in the window", *(f"{r['runs_per_s']:.0f}" for r in results))
    console.print(table)
    for r in results:
        if r.get("statements"):
            st = Table(title=f"{r['system']}: pg_stat_statements per run (top 15 by time)")
            for col in ("calls/run", "exec+plan ms/run", "plan ms/run", "statement"):
                st.add_column(col, justify="left" if col == "statement" else "right")
            for s in r["statements"][:15]:
                st.add_row(f"{s['calls_per_run']:.2f}", f"{s['ms_per_run']:.3f}",
                           f"{s['plan_ms'] / max(r['runs'], 1):.3f}", s["query"][:110])
            console.print(st)
        if r.get("waits"):
            wt = Table(title=f"{r['system']}: sessions by state and wait event, mean of "
                             f"{r['waits']['samples']} samples, {r['waits']['runs']} runs finished (top 6 each)")
            wt.add_column("sessions")
            wt.add_column("state: mean sessions")
            for app, shares in r["waits"]["sessions_by_state"].items():
                wt.add_row(app, ", ".join(f"{k} {v:.2f}" for k, v in list(shares.items())[:6]))
            console.print(wt)
        for role, p in (r.get("py_spy") or {}).get("processes", {}).items():
            ft = Table(title=f"{r['system']} {role}: py-spy, {p['ms_per_run']:.3f} ms of samples per run "
                             "(inclusive, top 25)")
            ft.add_column("ms/run", justify="right")
            ft.add_column("function")
            for name, ms in list(p["inclusive_ms_per_run"].items())[:25]:
                ft.add_row(f"{ms:.3f}", name)
            console.print(ft)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pgbin", default=str(scenario.DEBIAN_PG15_BIN),
                        help="server binaries to start a cluster from ('' = the embedded server)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each window")
    parser.add_argument("--systems", default="composer,procrastinate")
    parser.add_argument("--workflow", default="one", choices=["one", "fan"],
                        help="Composer's workflow: one (1 task, the default) or fan (10 tasks); "
                             "Procrastinate always runs 1-task jobs")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes (W), each of concurrency 4; a role's processes are summed")
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--waits", action="store_true",
                        help="a third window: pg_stat_activity sampled about every 5 ms, each kind of "
                             "session's mean count by state and wait event")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/profile-pg<major>-<date>-<commit>.json")
    args = parser.parse_args(argv)
    from bench.workload import COMPOSER, make_template

    require_binaries(parser, args.pgbin, " (--pgbin '' for the embedded server)")
    if args.workers < 1 or args.seconds <= 0:
        parser.error(f"--workers must be at least 1 and --seconds above 0 (got {args.workers} and {args.seconds})")
    server = scenario.start_server(Path(args.pgbin) if args.pgbin else None, STATEMENT_SETTINGS)
    statements = False
    with psycopg.connect(server.admin_url) as conn:
        statements = bool(conn.execute("SELECT count(*) FROM pg_available_extensions "
                                       "WHERE name = 'pg_stat_statements'").fetchone()[0])  # type: ignore[index]
        preload = conn.execute("SHOW shared_preload_libraries").fetchone()
        statements = statements and preload is not None and "pg_stat_statements" in str(preload[0])
    systems: list[tuple[System, str]] = []
    if "composer" in args.systems:
        systems.append((COMPOSER, make_template(server, "bench_tpl_profile")))
    if "procrastinate" in args.systems:
        from bench import peer_procrastinate

        systems.append((peer_procrastinate.PROCRASTINATE,
                        peer_procrastinate.make_template(server, "bench_tpl_profile_peer")))
    if statements:
        for _, tpl in systems:
            with psycopg.connect(server.url(tpl), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    spy = None if args.no_py_spy else _py_spy()
    results = []
    for system, tpl in systems:
        sys.stderr.write(f"[profile] {system.tag} on PostgreSQL {server.version}\n")
        results.append(profile(system, server, tpl, seconds=args.seconds,
                               spy=spy if system.name == "composer" else None, statements=statements,
                               workflow=args.workflow if system.name == "composer" else "one",
                               workers=args.workers, waits=args.waits))
    out = {"server_version": server.version, "py_spy": spy is not None, "pg_stat_statements": statements,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    kind = ("" if args.workflow == "one" else f"{args.workflow}-") + ("" if args.workers == 1 else f"w{args.workers}-")
    path = args.out or dated_path(RESULTS, f"profile-{kind}pg{server.version_num // 10000}-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    render(results, Console(width=200))
    sys.stderr.write(f"[profile] wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
