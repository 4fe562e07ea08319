"""The claim's cost with and without flow control: does a run pay for settings it does not use?

Five databases cloned from one migrated template, one per configuration of a 1-task
run whose task is on queue ``default`` (limits set high enough never to bind):

- ``a_none``: no flow settings at all;
- ``b_max_running``: a ``queue_settings`` row for ``default``, max_running 1,000,000;
- ``c_concurrency``: the TASK has ``concurrency {key: $.input.customer, limit: 1000}``,
  every run a customer of its own;
- ``d_rate_limit``: the TASK has ``rate_limit {key: bench-api, per_s: 1e6, burst: 1e6}``,
  one bucket for every run;
- ``e_others``: as ``a_none``, plus ``--other-queues`` other queues with a settings row
  (max_running) and a paused queue ``held`` holding ``--held`` queued tasks: a run without
  flow control must not pay for other queues' settings.

In rounds (the order rotated by one each round and reversed every other round, so
drift in the machine's load spreads over all five), each configuration makes
``--runs`` claims of 1-task runs in two modes (:data:`MODES`): ``backlog``, every run
started first and then claimed one at a time (the outbox holds ``runs`` ready
dispatches down to 1), and ``one_ready``, each run started and then claimed (one
ready dispatch at each claim): a cost that grows with the ready dispatches shows as
a ``backlog`` ratio above the ``one_ready`` one. A claim is ``Engine.claim``, limit 1,
one session (what a busy worker mostly does); the tasks are completed after the
claims. Only the claims are measured: the on-CPU time of the session's server
process around each claim call (/proc, :class:`OnCpu`), the client's wall time per
claim (p50), and, when the server preloads ``pg_stat_statements``, the claim
statement's execution and planning time per claimed task. Each ratio x/a is taken
within a round and mode (the five ran back to back); the figure is the median over
the rounds, with the smallest and largest.

Before a configuration's numbers count, it is checked to be what it says: its
dispatches carry the concurrency or rate-limit key (or none), and after the claims
the flow slots held are one per claimed task where a limit applies and none elsewhere.

    python -m bench.flowcost                   # the embedded PostgreSQL 18 (server CPU only)
    python -m bench.flowcost --pgbin DIR       # a cluster of DIR's binaries, with pg_stat_statements

Writes ``bench/results/flowcost-pg<major>-<date>-<commit>.json`` (or ``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
from rich.table import Table

from bench import scenario
from bench.months import _Backend, _percentile
from bench.report import measured_run, publish, require_binaries, stderr_log
from composer_ops.testing.servers import Server

RESULTS = Path(__file__).resolve().parent / "results"
QUEUE = "default"
WORKFLOW = "bench-flow"
NEVER_BINDING = 1_000_000
CONFIGS: dict[str, str] = {
    "a_none": "no flow settings",
    "b_max_running": f"queue_settings row for {QUEUE}, max_running {NEVER_BINDING:,}",
    "c_concurrency": "concurrency key per run ($.input.customer), limit 1,000",
    "d_rate_limit": f"rate_limit bench-api, per_s and burst {NEVER_BINDING:,}",
    "e_others": "as a, with other queues' settings rows and a paused queue holding tasks",
}
BASE = "a_none"
_FLOW: dict[str, dict[str, Any]] = {
    "c_concurrency": {"concurrency": {"key": "$.input.customer", "limit": 1000}},
    "d_rate_limit": {"rate_limit": {"key": "bench-api", "per_s": NEVER_BINDING, "burst": NEVER_BINDING}},
}
_HELD_SPEC = {"id": "bench-held", "nodes": [{"id": "work", "type": "TASK", "task": "noop", "queue": "held"}]}
STATEMENT_SETTINGS = {"shared_preload_libraries": "pg_stat_statements"}


class OnCpu:
    """On-CPU seconds of one server process: /proc/<pid>/schedstat (nanoseconds) where
    the kernel has it, else user + system time from /proc/<pid>/stat (10 ms ticks,
    :class:`bench.months._Backend`), which over a few hundred claims of about 1 ms is
    too coarse to tell configurations apart."""

    def __init__(self, pid: int) -> None:
        self._path = Path(f"/proc/{pid}/schedstat")
        self._ticks = _Backend(pid)
        try:
            float(self._path.read_text().split()[0])
            self.exact = True
        except (OSError, ValueError, IndexError):
            self.exact = False

    @property
    def readable(self) -> bool:
        return self.exact or self._ticks.readable

    def seconds(self) -> float:
        if self.exact:
            return float(self._path.read_text().split()[0]) / 1e9
        return self._ticks.seconds()


def _spec(config: str) -> dict[str, Any]:
    return {"id": WORKFLOW, "name": CONFIGS[config],
            "nodes": [{"id": "work", "type": "TASK", "task": "noop", "queue": QUEUE, **_FLOW.get(config, {})}]}


def order(rounds: int) -> Iterator[list[str]]:
    """Each round's order: rotated by one each round, reversed every other round."""
    names = list(CONFIGS)
    for r in range(rounds):
        k = r % len(names)
        rotated = names[k:] + names[:k]
        yield rotated if r % 2 == 0 else rotated[::-1]


def _statements_loaded(server: Server) -> bool:
    with psycopg.connect(server.admin_url, autocommit=True) as conn:
        row = conn.execute("SHOW shared_preload_libraries").fetchone()
    return row is not None and "pg_stat_statements" in str(row[0])


def _claim_statement_ms(url: str) -> float:
    """Execution + planning ms of the claim statements run so far in this database."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("""
            SELECT COALESCE(sum(total_exec_time + total_plan_time), 0) FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND toplevel AND query LIKE '%%composer_claim(%%'""").fetchone()
    return float(row[0]) if row else 0.0


def setup(server: Server, template: str, config: str, name: str, *, other_queues: int, held: int) -> str:
    """A database of ``config``: cloned from ``template``, the workflow deployed, the
    queue settings written through ``engine.queues`` as an operator would."""
    from composer_ops import Engine

    url = server.create_database(name, template=template)
    with Engine.connect(url, pool_size=1, application_name="bench-setup") as engine:
        engine.deploy(_spec(config))
        if config == "b_max_running":
            engine.queues.set_limit(QUEUE, NEVER_BINDING)
        if config == "e_others":
            for i in range(other_queues):
                engine.queues.set_limit(f"other-{i}", 10)
            engine.deploy(_HELD_SPEC)
            engine.queues.pause("held", reason="bench.flowcost: another queue paused")
            for _ in range(held):
                engine.start("bench-held")
    return url


def facts(url: str) -> dict[str, int]:
    """What the flow control holds now: dispatches of ``default`` with a concurrency /
    rate-limit key, and slots held per kind of limit."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("""
            SELECT (SELECT count(*) FROM task_outbox WHERE queue = %(q)s AND ckey IS NOT NULL),
                   (SELECT count(*) FROM task_outbox WHERE queue = %(q)s AND rkey IS NOT NULL),
                   (SELECT count(*) FROM flow_slots WHERE key = 'queue:' || %(q)s),
                   (SELECT count(*) FROM flow_slots WHERE key LIKE 'c:%%'),
                   (SELECT count(*) FROM queue_settings),
                   (SELECT count(*) FROM queue_settings WHERE paused)""", {"q": QUEUE}).fetchone()
    assert row is not None
    return dict(zip(("ckey_dispatches", "rkey_dispatches", "queue_slots", "key_slots", "settings_rows",
                     "paused_queues"), (int(x) for x in row), strict=True))


def verify(config: str, before: dict[str, int], after: dict[str, int], ready: int, claimed: int,
           other_queues: int) -> None:
    """Refuse a configuration that is not what it says (a setting not applied would make
    its ratio compare nothing): ``before`` is read with ``ready`` dispatches of ``default``
    queued, ``after`` once ``claimed`` tasks are claimed and none completed."""
    want_before = {"ckey_dispatches": ready if config == "c_concurrency" else 0,
                   "rkey_dispatches": ready if config == "d_rate_limit" else 0,
                   "settings_rows": {"b_max_running": 1, "e_others": other_queues + 1}.get(config, 0),
                   "paused_queues": 1 if config == "e_others" else 0}
    want_after = {"queue_slots": claimed if config == "b_max_running" else 0,
                  "key_slots": claimed if config == "c_concurrency" else 0}
    wrong = [f"{k} {before[k]} (expected {v}) with {ready} queued" for k, v in want_before.items() if before[k] != v]
    wrong += [f"{k} {after[k]} (expected {v}) after {claimed} claims" for k, v in want_after.items() if after[k] != v]
    if wrong:
        raise RuntimeError(f"bench.flowcost: configuration {config} is not what it says: {'; '.join(wrong)}")


#: How deep the outbox is at each claim: ``backlog``, every run started first, then
#: claimed one at a time (from ``runs`` ready dispatches down to 1); ``one_ready``, each
#: run started and then claimed (one ready dispatch at each claim).
MODES = ("backlog", "one_ready")


def _one(engine: Any, backend: OnCpu, url: str, config: str, mode: str, r: int, runs: int, other_queues: int,
         statements: bool) -> dict[str, Any]:
    """``runs`` claims of ``config`` in ``mode``; only the claim calls are measured."""
    timings: list[float] = []
    claims: list[Any] = []
    cpu = 0.0
    empty = 0

    def start(i: int) -> None:
        engine.start(WORKFLOW, input={"customer": f"customer-{mode}-{r}-{i}"})

    def claim_one() -> None:
        nonlocal cpu, empty
        while True:
            c0, t0 = backend.seconds(), time.perf_counter()
            got = engine.claim([QUEUE], "bench-flowcost", 1, task_names=["noop"])
            t1, c1 = time.perf_counter(), backend.seconds()
            timings.append((t1 - t0) * 1000)
            cpu += c1 - c0
            if got:
                claims.extend(got)
                return
            empty += 1
            if empty > 50:
                raise RuntimeError(f"bench.flowcost: {config} ({mode}) claimed {len(claims)} of {runs} tasks")
            time.sleep(0.01)

    stmt0 = _claim_statement_ms(url) if statements else 0.0
    if mode == "backlog":
        for i in range(runs):
            start(i)
        before = facts(url)
        for _ in range(runs):
            claim_one()
    else:
        start(0)
        before = facts(url)
        claim_one()
        for i in range(1, runs):
            start(i)
            claim_one()
    stmt1 = _claim_statement_ms(url) if statements else 0.0
    after = facts(url)
    verify(config, before, after, runs if mode == "backlog" else 1, runs, other_queues)
    for claim in claims:
        engine.complete(claim, None)
    return {"server_cpu_ms_per_claim": cpu / runs * 1000 if backend.readable else None,
            "claim_p50_ms": _percentile(timings, 0.5), "claim_p90_ms": _percentile(timings, 0.9),
            "statement_ms_per_claim": (stmt1 - stmt0) / runs if statements else None,
            "empty_claims": empty, "facts_before": before, "facts_after": after}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values} \
        if values else {"median": None, "min": None, "max": None, "rounds": []}


METRICS = ("server_cpu_ms_per_claim", "statement_ms_per_claim", "claim_p50_ms")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and configuration the medians over rounds; per mode, x/a and metric, the
    within-round ratios' median, smallest and largest (left out where a side is missing or 0)."""
    by_config: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for mode in MODES:
        got = [rd["by_config"][mode] for rd in rounds]
        by_config[mode] = {c: {m: (statistics.median(v) if (v := [g[c][m] for g in got if g[c][m] is not None])
                                   else None) for m in METRICS} for c in CONFIGS}
        ratios[mode] = {f"{c[0]}/{BASE[0]}": {m: _spread([g[c][m] / g[BASE][m] for g in got
                                                          if g[c][m] is not None and g[BASE][m]])
                                              for m in METRICS}
                        for c in CONFIGS if c != BASE}
    return {"by_config": by_config, "ratios": ratios}


def measure(server: Server, *, runs: int = 80, rounds: int = 4, other_queues: int = 50, held: int = 50,
            warmup: int = 10, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The five configurations side by side in both modes (see the module doc)."""
    from composer_ops import Engine
    from composer_ops.db.migrate import migrate

    began = time.monotonic()
    statements = _statements_loaded(server)
    template = "bench_flow_tpl"
    migrate(server.create_database(template))
    if statements:
        with psycopg.connect(server.url(template), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    names = {c: f"bench_flow_{c}" for c in CONFIGS}
    results: list[dict[str, Any]] = []
    cpu_source = "none"
    try:
        urls = {c: setup(server, template, c, names[c], other_queues=other_queues, held=held) for c in CONFIGS}
        with ExitStack() as stack:
            engines = {c: stack.enter_context(Engine.connect(u, pool_size=1, application_name="bench-flowcost"))
                       for c, u in urls.items()}
            backends: dict[str, OnCpu] = {}
            for c, engine in engines.items():
                with engine.pool.connection() as conn:
                    row = conn.execute("SELECT pg_backend_pid()").fetchone()
                backends[c] = OnCpu(int(row[0]) if row else 0)
                # warm: definitions cached, statements prepared (psycopg prepares after 5 uses)
                for mode in MODES:
                    _one(engine, backends[c], urls[c], c, mode, -1, warmup, other_queues, statements=False)
            cpu_source = "schedstat" if all(b.exact for b in backends.values()) else "stat ticks"
            for r, configs in enumerate(order(rounds)):
                entry: dict[str, Any] = {"round": r, "order": configs, "by_config": {m: {} for m in MODES}}
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    for c in configs:
                        log(f"flow control's cost in the claim, round {r + 1}/{rounds}: {c}, {mode} ({runs} claims)")
                        entry["by_config"][mode][c] = _one(engines[c], backends[c], urls[c], c, mode, r, runs,
                                                           other_queues, statements)
                results.append(entry)
    finally:
        for name in (*names.values(), template):
            server.drop_database(name)
    return {"runs": runs, "rounds": rounds, "other_queues": other_queues, "held": held, "configs": CONFIGS,
            "modes": MODES, "pg_stat_statements": statements, "cpu_source": cpu_source,
            "elapsed_s": time.monotonic() - began, **summarize(results), "rounds_detail": results}


def headline(result: dict[str, Any]) -> dict[str, float | None]:
    """Median server CPU per claim of each configuration over a_none's, per mode
    (``make bench``'s key): ``{"backlog b/a": ..., "one_ready b/a": ...}``."""
    return {f"{mode} {k}": v["server_cpu_ms_per_claim"]["median"]
            for mode, by in (result.get("ratios") or {}).items() for k, v in by.items()}


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"Flow control's cost in the claim: {result['runs']} claims of 1-task runs per configuration, "
                    f"mode and round, {result['rounds']} rounds; ratios x/a within a round, median (min to max)")
    for col in ("mode", "configuration", "server CPU ms/claim", "x/a", "statement ms/claim", "x/a",
                "claim p50 ms", "x/a"):
        t.add_column(col, justify="left" if col in ("mode", "configuration") else "right")

    def cell(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    for mode in result["modes"]:
        for c in CONFIGS:
            row = [mode, f"{c}: {CONFIGS[c]}"]
            ratio = result["ratios"][mode].get(f"{c[0]}/{BASE[0]}")
            for m in METRICS:
                row.append(cell(result["by_config"][mode][c][m]))
                s = ratio[m] if ratio else None
                row.append("1" if c == BASE else "-" if not s or s["median"] is None
                           else f"{s['median']:.2f} ({s['min']:.2f} to {s['max']:.2f})")
            t.add_row(*row)
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.flowcost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pgbin", type=Path, help="server binaries of a throwaway cluster, which loads "
                                              "pg_stat_statements (default: the embedded server, CPU only)")
    p.add_argument("--runs", type=int, default=80, help="claims per configuration, mode and round (default 80)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--other-queues", type=int, default=50, help="other queues' settings rows in e (default 50)")
    p.add_argument("--held", type=int, default=50, help="tasks queued in e's paused queue (default 50)")
    p.add_argument("--out", type=Path, default=None,
                   help="default bench/results/flowcost-pg<major>-<date>-<commit>.json")
    args = p.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.other_queues < 0 or args.held < 0:
        p.error("--runs and --rounds must be at least 1, --other-queues and --held at least 0")
    require_binaries(p, args.pgbin)
    server = scenario.start_server(args.pgbin, STATEMENT_SETTINGS if args.pgbin else None)
    log = stderr_log("flowcost")
    out = measured_run(server.version,
                       "python -m bench.flowcost " + " ".join(argv if argv is not None else sys.argv[1:]),
                       lambda: measure(server, runs=args.runs, rounds=args.rounds, other_queues=args.other_queues,
                                       held=args.held, log=log))
    publish(out, args.out, RESULTS, f"flowcost-pg{server.version_num // 10000}-", table(out), log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
