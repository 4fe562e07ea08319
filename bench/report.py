"""The benchmark's output: rich tables on the terminal, and the JSON summary."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def figure(value: Any, digits: int = 0, suffix: str = "") -> str:
    """A table cell: ``-`` for None, a float to ``digits`` places with thousands separators."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def throughput_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Throughput, same server, same run: Composer runs/s vs Procrastinate jobs/s "
                        "(median of rounds; ratio = median of per-round ratios)")
    for col in ("workload", "W", "rounds", "composer runs/s", "transitions/s", "procrastinate jobs/s", "ratio",
                "CPU ms/run C srv+procs", "CPU ms/job P srv+procs", "empty claims"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for row in rows:
        c, p = row.get("composer"), row.get("procrastinate")
        label = {"one": "1 task", "fan": "10-task fan-out/in"}[row["workflow"]] + f", {row['mode']}"

        def cpu(side: dict[str, Any] | None) -> str:
            if not side:
                return "-"
            return f"{figure(side['server_cpu_ms_per_run'], 2)} + {figure(side['process_cpu_ms_per_run'], 2)}"

        table.add_row(label, str(row["workers"]), str((c or p or {}).get("rounds", "")),
                      figure(c and c["runs_per_s"], 0), figure(c and c["transitions_per_s"], 0),
                      figure(p and p["runs_per_s"], 0), figure(row.get("ratio"), 2), cpu(c), cpu(p),
                      figure(c and c.get("empty_claim_share") is not None and c["empty_claim_share"] * 100, 0, "%"))
    return table


def latency_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Latency (ms, database clock) per workload")
    for col in ("system", "workload", "W", "start->claim p50", "p99", "claim->complete p50", "p99"):
        table.add_column(col, justify="left" if col in ("system", "workload") else "right")
    for r in rows:
        u = r["units"]
        rate = f" @{r['target_rate']:.0f}/s" if r.get("target_rate") else ""
        table.add_row(r["system"], f"{r['workflow']}, {r['mode']}{rate}", str(r["workers"]),
                      figure(u["start_to_claim_p50_ms"], 1), figure(u["start_to_claim_p99_ms"], 1),
                      figure(u["claim_to_complete_p50_ms"], 1), figure(u["claim_to_complete_p99_ms"], 1))
    return table


def hot_table(hot: dict[str, Any]) -> Table:
    table = Table(title="task_instances: HOT updates and index writes (V004 seed schema -> latest)")
    for col in ("phase", "HOT before", "HOT after", "idx writes/row write before", "after",
                "WAL B/row write before", "after"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase in ("steady", "long_tasks", "heartbeats"):
        b, a = hot["before"]["phases"][phase], hot["after"]["phases"][phase]
        table.add_row(phase, figure(b["hot_ratio"] and b["hot_ratio"] * 100, 0, "%"),
                      figure(a["hot_ratio"] and a["hot_ratio"] * 100, 0, "%") if a["hot_ratio"] is not None else "-",
                      figure(b["index_writes_per_row_write"], 2), figure(a["index_writes_per_row_write"], 2),
                      figure(b["wal_bytes_per_row_write"], 0), figure(a["wal_bytes_per_row_write"], 0))
    return table


def ceiling_table(summary: dict[str, Any]) -> Table:
    table = Table(title="Ceiling and retention")
    table.add_column("figure")
    table.add_column("value", justify="right")
    pg = summary["results"].get("pgbench") or {}
    for clients, tps in (pg.get("tps_by_clients") or {}).items():
        table.add_row(f"pgbench -N TPS, {clients} clients", figure(tps, 0))
    if summary.get("composer_runs_per_s") and summary.get("pgbench_tps"):
        table.add_row("1-task runs/s x 3 commits / best pgbench TPS",
                      figure(summary["composer_runs_per_s"] * 3 / summary["pgbench_tps"] * 100, 0, "%"))
    ret = summary["results"].get("retention")
    if ret:
        table.add_row(f"drop a month ({ret['task_rows_per_month']:,} task rows), s", figure(ret["drop"]["seconds"], 2))
        table.add_row("DELETE the same rows, s", figure(ret["delete"]["seconds"], 2))
        table.add_row("  + VACUUM, s", figure(ret["delete"]["vacuum_seconds"], 2))
        table.add_row("DELETE / drop", figure(ret["delete_over_drop"], 0, "x"))
    return table


def notebooks_table(nb: dict[str, Any]) -> Table:
    table = Table(title=f"Reports, runbooks and ops functions on {nb.get('task_rows', 0):,} task rows "
                        f"({nb.get('date', '')})")
    table.add_column("what")
    table.add_column("seconds", justify="right")
    table.add_column("each round", justify="right")
    table.add_column("of which notebook", justify="right")
    table.add_column("rows returned", justify="right")
    table.add_column("peak kernel RSS MB", justify="right")
    table.add_column("ok")
    for item in nb.get("items", []):
        each = " / ".join(f"{t:.2f}" for t in item.get("seconds_each") or [])
        table.add_row(item["name"], figure(item.get("seconds"), 2), each, figure(item.get("notebook_seconds"), 2),
                      figure(item.get("rows")), figure(item.get("peak_rss_mb"), 0),
                      "" if item.get("ok", True) else "FAILED")
    return table


def render(summary: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=160)
    res = summary["results"]
    if res.get("throughput_summary"):
        console.print(throughput_table(res["throughput_summary"]))
        first = [r for r in res["throughput"] if r["workers"] == 1 and r.get("round", 0) == 0]
        console.print(latency_table(first + res.get("latency", [])))
    if res.get("hot"):
        console.print(hot_table(res["hot"]))
    console.print(ceiling_table(summary))
    if res.get("notebooks") and res["notebooks"].get("items"):
        console.print(notebooks_table(res["notebooks"]))
    if res.get("months"):
        console.print(months_table(res["months"]))
    if res.get("citus"):
        console.print(citus_table(res["citus"]))
    if res.get("flow"):
        from bench.flowcost import table as flow_table

        console.print(flow_table(res["flow"]))
    console.print(f"[bold]PostgreSQL {summary['server_version']}[/bold], leg took {summary['elapsed_s']:.0f} s")


def months_table(mon: dict[str, Any]) -> Table:
    table = Table(title=f"Months of history retained ({mon['runs_per_month']:,} runs per month; medians of "
                        f"{mon['rounds']} rounds; latency per call, one session)")
    for col in ("months", "partitions/table", "claim p50 ms", "p99", "server CPU ms", "heartbeat p50",
                "complete p50", "locks: claim", "heartbeat", "complete", "sweeper", "timer", "floor read",
                "1-task runs/s"):
        table.add_column(col, justify="right")
    for m, e in mon["by_months"].items():
        lk = e["locks"]
        table.add_row(m, str(e["partitions_per_table"]), figure(e["claim_p50_ms"], 2), figure(e["claim_p99_ms"], 2),
                      figure(e.get("claim_server_cpu_ms"), 3), figure(e["heartbeat_p50_ms"], 2),
                      figure(e["complete_p50_ms"], 2),
                      str(lk["claim"]), str(lk["heartbeat"]), str(lk["complete (event transaction)"]),
                      str(lk["sweeper scan"]), str(lk["timer scan"]), str(lk.get("active floor read", "-")),
                      figure(e["runs_per_s"], 0))
    return table


def citus_table(case: dict[str, Any]) -> Table:
    by_nodes = case.get("by_worker_nodes") or {str(case["nodes"] - 1): case}
    counts = " and ".join(by_nodes)
    table = Table(title=f"Citus {case['citus_version']}, a coordinator and {counts} worker nodes on this machine, "
                        f"{case['shard_count']} shards, vs one server of the same binaries "
                        f"(W=1, medians of {case['rounds']} rounds)")
    first = next(iter(by_nodes))
    for col in ("worker nodes", "mode", "single runs/s", "Citus runs/s", "Citus / single", "per round",
                f"vs {first} worker nodes", "CPU ms/run single", "CPU ms/run Citus"):
        table.add_column(col, justify="right")
    for nodes, entry in by_nodes.items():
        for mode, e in entry["summary"].items():
            table.add_row(nodes, mode, figure(e["single_runs_per_s"], 0), figure(e["citus_runs_per_s"], 0),
                          figure(e["ratio"], 2),
                          ", ".join(figure(r, 2) for r in entry["ratios"][mode]),
                          figure(e.get(f"ratio_to_{first}_worker_nodes"), 2), figure(e["single_cpu_ms_per_run"], 1),
                          figure(e["citus_cpu_ms_per_run"], 1))
    return table


def render_headline(summary: dict[str, Any], console: Console | None = None) -> None:
    """The issue's figures, one column per server."""
    console = console or Console(width=160)
    by = summary.get("by_server") or {}
    table = Table(title="Headline, per server (bench/results/<date>-<commit>.json)")
    table.add_column("key")
    for version in by:
        table.add_column(f"PostgreSQL {version}", justify="right")
    keys: list[str] = []
    for entry in by.values():
        keys += [k for k in entry if k not in keys and k != "server_version"]
    for key in keys:
        table.add_row(key, *(_cell(entry.get(key)) for entry in by.values()))
    console.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.0f}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def commit(root: Path) -> str:
    """The checkout's short commit, ``-dirty`` when tracked files (bench/results aside)
    differ from it; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                 ".", ":(exclude)bench/results"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if status.strip() else "")


def dated_path(results: Path, prefix: str = "") -> Path:
    """``results/<prefix><UTC date>-<commit>.json``: one results file per commit (and day)."""
    return results / f"{prefix}{time.strftime('%Y-%m-%d', time.gmtime())}-{commit(results.parents[1])}.json"


def write(summary: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def stderr_log(name: str) -> Callable[[str], None]:
    """A progress logger of one benchmark: ``[name HH:MM:SS] message`` on stderr."""
    def log(message: str) -> None:
        sys.stderr.write(f"[{name} {time.strftime('%H:%M:%S')}] {message}\n")
        sys.stderr.flush()

    return log


def measured_run(server_version: str, command: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What ``measure()`` returns, with the server's version, the UTC date, the command and
    the load average before and after it: one benchmark's results file."""
    return {"server_version": server_version, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command, "load_average_before": os.getloadavg(), **measure(),
            "load_average_after": os.getloadavg()}


def write_results(out: dict[str, Any], path: Path | None, results: Path, prefix: str) -> Path:
    """Write ``out`` to ``path``, or to ``results/<prefix><date>-<commit>.json``; the path."""
    path = path or dated_path(results, prefix)
    write(out, path)
    return path


def parser(prog: str, doc: str | None, results: str) -> argparse.ArgumentParser:
    """A one-benchmark CLI's parser with its two common options: ``--pgbin`` (a throwaway
    cluster of those binaries, else the embedded server; :func:`require_binaries` checks
    it) and ``--out`` (default ``bench/results/<results><date>-<commit>.json``)."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pgbin", type=Path, help="server binaries of a throwaway cluster (default: the embedded server)")
    p.add_argument("--out", type=Path, default=None, help=f"default bench/results/{results}<date>-<commit>.json")
    return p


def require_binaries(parser: argparse.ArgumentParser, pgbin: Path | str | None, hint: str = "") -> None:
    """A one-benchmark CLI's check of ``--pgbin``: the parser's error (exit 2, ``hint``
    after it) unless it is unset or empty (the embedded server) or holds ``initdb``."""
    if pgbin and not (Path(pgbin) / "initdb").exists():
        parser.error(f"no PostgreSQL server binaries in {pgbin}{hint}")


def publish(out: dict[str, Any], path: Path | None, results: Path, prefix: str, shown: Table,
            log: Callable[[str], None]) -> Path:
    """The end of a one-benchmark CLI: ``out`` written (:func:`write_results`), its table
    printed, and where it went logged; the path."""
    written = write_results(out, path, results, prefix)
    Console(width=200).print(shown)
    log(f"wrote {written}")
    return written
