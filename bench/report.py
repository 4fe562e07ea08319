"""The benchmark's output: rich tables on the terminal, and the JSON summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _f(value: Any, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def throughput_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Throughput, same server, same run: Composer runs/s vs Procrastinate jobs/s "
                        "(median of rounds; ratio = median of per-round ratios)")
    for col in ("workload", "W", "rounds", "composer runs/s", "transitions/s", "procrastinate jobs/s", "ratio",
                "CPU ms/run C srv+procs", "CPU ms/job P srv+procs"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for row in rows:
        c, p = row.get("composer"), row.get("procrastinate")
        label = {"one": "1 task", "fan": "10-task fan-out/in"}[row["workflow"]] + f", {row['mode']}"

        def cpu(side: dict[str, Any] | None) -> str:
            if not side:
                return "-"
            return f"{_f(side['server_cpu_ms_per_run'], 2)} + {_f(side['process_cpu_ms_per_run'], 2)}"

        table.add_row(label, str(row["workers"]), str((c or p or {}).get("rounds", "")),
                      _f(c and c["runs_per_s"], 0), _f(c and c["transitions_per_s"], 0),
                      _f(p and p["runs_per_s"], 0), _f(row.get("ratio"), 2), cpu(c), cpu(p))
    return table


def latency_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Latency (ms, database clock) per workload")
    for col in ("system", "workload", "W", "start->claim p50", "p99", "claim->complete p50", "p99"):
        table.add_column(col, justify="left" if col in ("system", "workload") else "right")
    for r in rows:
        u = r["units"]
        rate = f" @{r['target_rate']:.0f}/s" if r.get("target_rate") else ""
        table.add_row(r["system"], f"{r['workflow']}, {r['mode']}{rate}", str(r["workers"]),
                      _f(u["start_to_claim_p50_ms"], 1), _f(u["start_to_claim_p99_ms"], 1),
                      _f(u["claim_to_complete_p50_ms"], 1), _f(u["claim_to_complete_p99_ms"], 1))
    return table


def hot_table(hot: dict[str, Any]) -> Table:
    table = Table(title="task_instances: HOT updates and index writes (V004 seed schema -> latest)")
    for col in ("phase", "HOT before", "HOT after", "idx writes/row write before", "after",
                "WAL B/row write before", "after"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase in ("steady", "long_tasks", "heartbeats"):
        b, a = hot["before"]["phases"][phase], hot["after"]["phases"][phase]
        table.add_row(phase, _f(b["hot_ratio"] and b["hot_ratio"] * 100, 0, "%"),
                      _f(a["hot_ratio"] and a["hot_ratio"] * 100, 0, "%") if a["hot_ratio"] is not None else "-",
                      _f(b["index_writes_per_row_write"], 2), _f(a["index_writes_per_row_write"], 2),
                      _f(b["wal_bytes_per_row_write"], 0), _f(a["wal_bytes_per_row_write"], 0))
    return table


def ceiling_table(summary: dict[str, Any]) -> Table:
    table = Table(title="Ceiling and retention")
    table.add_column("figure")
    table.add_column("value", justify="right")
    pg = summary["results"].get("pgbench") or {}
    for clients, tps in (pg.get("tps_by_clients") or {}).items():
        table.add_row(f"pgbench -N TPS, {clients} clients", _f(tps, 0))
    if summary.get("composer_runs_per_s") and summary.get("pgbench_tps"):
        table.add_row("1-task runs/s x 3 commits / best pgbench TPS",
                      _f(summary["composer_runs_per_s"] * 3 / summary["pgbench_tps"] * 100, 0, "%"))
    ret = summary["results"].get("retention")
    if ret:
        table.add_row(f"drop a month ({ret['task_rows_per_month']:,} task rows), s", _f(ret["drop"]["seconds"], 2))
        table.add_row("DELETE the same rows, s", _f(ret["delete"]["seconds"], 2))
        table.add_row("  + VACUUM, s", _f(ret["delete"]["vacuum_seconds"], 2))
        table.add_row("DELETE / drop", _f(ret["delete_over_drop"], 0, "x"))
    return table


def notebooks_table(nb: dict[str, Any]) -> Table:
    table = Table(title=f"Reports and ops functions on {nb.get('task_rows', 0):,} task rows ({nb.get('date', '')})")
    table.add_column("what")
    table.add_column("seconds", justify="right")
    table.add_column("each round", justify="right")
    table.add_column("of which notebook", justify="right")
    table.add_column("rows returned", justify="right")
    table.add_column("peak kernel RSS MB", justify="right")
    table.add_column("ok")
    for item in nb.get("items", []):
        each = " / ".join(f"{t:.2f}" for t in item.get("seconds_each") or [])
        table.add_row(item["name"], _f(item.get("seconds"), 2), each, _f(item.get("notebook_seconds"), 2),
                      _f(item.get("rows")), _f(item.get("peak_rss_mb"), 0), "" if item.get("ok", True) else "FAILED")
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
    keys = ("composer_runs_per_s", "procrastinate_jobs_per_s", "ratio_vs_procrastinate",
            "ratio_vs_procrastinate_drain", "cpu_ratio_vs_procrastinate", "pgbench_tps", "heartbeat_hot_ratio",
            "claim_to_complete_p50_ms", "claim_to_complete_p99_ms", "server_version", "date")
    console.print({k: summary.get(k) for k in keys})


def write(summary: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
