"""What the parts of the engine's claim cost: the server's CPU for a claim of one task by
``composer_claim`` (sql/R__claim.sql) against copies of it with one part replaced, and
against :mod:`bench.layers`' plain statement.

``python -m bench.claim_parts [--pgbin DIR] [--claims 250] [--rounds 4] [--out FILE]``

A design measurement, not a second claim. The copies are made from the function's own
source as the server holds it (``pg_get_functiondef``), each with one text replaced, and
each replacement checked to have happened (a changed function makes this tool fail,
not measure the original under another name). They are right for what is measured
here only (one queue, no flow control, no busy runs, no hand-offs), which is the 1-task
benchmark's claim:

- ``engine, not registering``: ``composer_claim`` with ``p_channel`` NULL, as a caller
  that is not a listening worker calls it;
- ``engine, registering``: as a worker's claims call it, its claim loop's and its
  reports' (the worker's registration read and written; not woken, no runs in flight);
- ``month function called directly``: the call of the month's function written into
  the copy for this month, instead of built by ``format`` and run by ``EXECUTE``;
- ``pick as one statement``: ``composer_pick`` (a PL/pgSQL walk with a cursor per
  queue) replaced by one ``SELECT ... ORDER BY ... LIMIT ... FOR UPDATE SKIP LOCKED`` of
  the queue;
- both of the last two;
- ``plain statement``: :data:`bench.layers.CLAIM`, the claim's rows in one statement.

A database of 6 x (``--claims`` x ``--rounds`` + 10) ready runs (started by
:class:`bench.layers.Plain`) is claimed from on one connection, every variant's block of
``--claims`` claims in turn, ``--rounds`` times; each block's backend CPU per claim
(``/proc/PID/schedstat``; where the kernel has none, 10 ms ticks, too coarse for this:
the results say which, ``cpu_exact``). The copies are called as ``engine, not
registering`` calls the function, and compare with it. Prints the medians; ``--out``
writes them as JSON.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from rich.table import Table

from bench import scenario
from bench.flowcost import OnCpu
from bench.layers import CLAIM, ENGINE_CLAIM, WARM, Plain
from bench.report import measured_run, parser, publish, require_binaries, stderr_log
from bench.workload import make_template
from composer_ops.core.runids import month_of
from composer_ops.engine.ids import uuid7_text
from composer_ops.testing.servers import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

_MONTH_CALL = re.compile(r"IF m_month IS NOT NULL AND to_regproc\(.*?END IF;(\s*GET DIAGNOSTICS)", re.S)
_PICK = "SELECT p.id FROM composer_pick(pick_queues, p_names, room, NULL, p_busy, me) AS p(id)"
_ONE_PICK = ("SELECT o.id FROM task_outbox o WHERE o.queue = pick_queues[1] AND o.available_at <= now() "
             "AND (p_names IS NULL OR o.task_name = ANY(p_names)) "
             "ORDER BY o.priority DESC, o.available_at, o.id LIMIT room FOR UPDATE SKIP LOCKED")


def _replace(text: str, old: str | re.Pattern[str], new: str, what: str) -> str:
    changed = old.sub(new, text, count=1) if isinstance(old, re.Pattern) else text.replace(old, new, 1)
    if changed == text:
        raise RuntimeError(f"composer_claim has changed: {what} is not where bench.claim_parts looks for it")
    return changed


def variants(conn: psycopg.Connection[Any], month: str) -> dict[str, str]:
    """Make the copies on ``conn``'s database; the statement of each variant."""
    row = conn.execute("SELECT pg_get_functiondef(p.oid) FROM pg_proc p "
                       "WHERE p.proname = 'composer_claim' AND p.pronargs = 10").fetchone()
    if row is None:
        raise RuntimeError("no ten-argument composer_claim: is the database migrated?")
    source: str = row[0]
    direct = (f"RETURN QUERY SELECT * FROM composer_claim_tasks_p{month}(p_owner, p_claim, limited, m_runs, "
              "m_ids, m_attempts, m_names, m_leases, m_queues, m_maxruns, m_ckeys);\\1")
    copies = {"bench_claim_direct": _replace(source, _MONTH_CALL, direct, "the call of the month's function")}
    copies["bench_claim_one_pick"] = _replace(source, _PICK, _ONE_PICK, "the pick")
    copies["bench_claim_both"] = _replace(copies["bench_claim_direct"], _PICK, _ONE_PICK, "the pick")
    for name, text in copies.items():
        conn.execute(_replace(text, "FUNCTION public.composer_claim(", f"FUNCTION public.{name}(", "its name"))
    return {
        "engine, not registering": ENGINE_CLAIM.format(fn="composer_claim", channel="NULL", seen="NULL"),
        "engine, registering": ENGINE_CLAIM.format(fn="composer_claim", channel="'bench_claim_parts'", seen="0"),
        "month function called directly": ENGINE_CLAIM.format(fn="bench_claim_direct", channel="NULL", seen="NULL"),
        "pick as one statement": ENGINE_CLAIM.format(fn="bench_claim_one_pick", channel="NULL", seen="NULL"),
        "both": ENGINE_CLAIM.format(fn="bench_claim_both", channel="NULL", seen="NULL"),
        "plain statement": CLAIM.format(m=month),
    }


def measure(server: Server, template: str, *, claims: int = 250, rounds: int = 4,
            log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    db = "bench_claim_parts"
    url = server.create_database(db, template=template)
    try:
        month = month_of(uuid7_text())
        plain = Plain(url, application_name="bench-claim-parts")   # its session settings: the engine's claim's
        try:
            conn = plain.auto
            made = variants(conn, month)
            need = len(made) * (claims * rounds + WARM)
            for i in range(need):
                plain.start()
                if (i + 1) % 2000 == 0:
                    log(f"started {i + 1} of {need} runs")
            cpu = OnCpu(plain.pid)
            per: dict[str, list[float]] = {name: [] for name in made}

            def claim(statement: str) -> None:
                got = conn.execute(statement, {"claim": uuid7_text(), "names": ["noop"], "owner": "bench-claim-parts"},
                                   prepare=True).fetchall()
                if len(got) != 1:
                    raise RuntimeError(f"a claim took {len(got)} tasks, not 1")

            for statement in made.values():
                for _ in range(WARM):
                    claim(statement)
            for r in range(rounds):
                order = list(made) if r % 2 == 0 else list(made)[::-1]
                for name in order:
                    c0 = cpu.seconds()
                    for _ in range(claims):
                        claim(made[name])
                    per[name].append((cpu.seconds() - c0) / claims * 1e3)
                log(f"round {r + 1} of {rounds}: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in per.items()))
            if month_of(uuid7_text()) != month:
                raise RuntimeError(f"the month turned during the measurement ({month})")
        finally:
            plain.close()
    finally:
        server.drop_database(db)
    medians = {name: statistics.median(v) for name, v in per.items()}
    base = medians["engine, not registering"]
    return {"claims": claims, "rounds": rounds, "cpu_exact": cpu.exact, "server_ms_per_claim": per, "median": medians,
            "over_engine": {name: m / base if base else None for name, m in medians.items()}}


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"server CPU ms per claim of one task, medians of {result['rounds']} rounds of "
                    f"{result['claims']} (PostgreSQL {result.get('server_version', '?')})")
    for col in ("claim", "ms", "/ engine, not registering"):
        t.add_column(col, justify="left" if col == "claim" else "right")
    for name, m in result["median"].items():
        ratio = result["over_engine"][name]
        t.add_row(name, f"{m:.3f}", "-" if ratio is None else f"{ratio:.2f}")
    return t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser("python -m bench.claim_parts", __doc__, "claim-parts-pg<major>-")
    p.add_argument("--claims", type=int, default=250, help="claims per variant and round (default 250)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    args = p.parse_args(argv)
    if args.claims < 1 or args.rounds < 1:
        p.error("--claims and --rounds must be at least 1")
    require_binaries(p, args.pgbin)
    server = scenario.start_server(args.pgbin)
    log = stderr_log("claim_parts")
    out = measured_run(server.version, "python -m bench.claim_parts " + " ".join(argv),
                       lambda: measure(server, make_template(server, "bench_tpl_claim_parts"), claims=args.claims,
                                       rounds=args.rounds, log=log))
    publish(out, args.out, RESULTS, f"claim-parts-pg{server.version_num // 10000}-", table(out), log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
