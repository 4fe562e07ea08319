"""``make bench``: every measurement of SPEC section 10, side by side, in one run.

Order matters on a shared machine: for each worker count W the Composer and
Procrastinate measurements are interleaved (C drain, P drain, P sustained,
C sustained), so slow drift of the machine's load hits both sides alike, and every
ratio compares figures taken minutes apart at most.

    python -m bench.run                    # default size (about 7 minutes on 2 cores)
    python -m bench.run --quick            # a smoke test of every part (about 1-2 minutes)
    python -m bench.run --skip retention,hot --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import hot, pgbench, retention, scenario
from bench.report import render, write
from bench.scenario import System
from bench.workload import COMPOSER, make_template
from composer_ops.testing import servers

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("pgbench", "throughput", "procrastinate", "fan", "latency", "hot", "retention", "notebooks")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4", help="worker process counts (default 1,2,4)")
    p.add_argument("--runs", type=int, default=1500, help="runs (jobs) per drain measurement")
    p.add_argument("--duration", type=float, default=6.0, help="seconds measured per sustained workload")
    p.add_argument("--repeat", type=int, default=4,
                   help="rounds of the W=1 comparison; medians are reported (default 4: each side goes first twice)")
    p.add_argument("--max-backlog", type=int, default=50, help="unfinished runs the sustained producer allows")
    p.add_argument("--pace", type=float, default=100.0, help="runs/s of the paced latency measurement")
    p.add_argument("--hot-runs", type=int, default=600, help="runs per HOT phase")
    p.add_argument("--retention-rows", type=int, default=1_000_000, help="task rows per month for retention")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that every part works")
    p.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.runs, args.duration, args.hot_runs, args.retention_rows = "1", 300, 3.0, 100, 50_000
        args.repeat = 1
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) to skip: {', '.join(sorted(unknown))}")
    return args


def _round_steps(args: argparse.Namespace, server: servers.Server, template: str, peer: Any,
                 peer_template: str | None, w: int, r: int) -> list[tuple[str, Any]]:
    """One round for W workers: Composer and Procrastinate alternate, and the order
    flips every round (C P P C, then P C C P), so drift in the machine's load hits
    both sides alike. The fan-out workload runs in the first round only."""
    c_drain = ("composer drain", lambda: scenario.drain(COMPOSER, server, template, workers=w, items=args.runs))
    c_sus = ("composer sustained", lambda: scenario.sustained(
        COMPOSER, server, template, workers=w, duration=args.duration, max_backlog=args.max_backlog))
    steps: list[tuple[str, Any]]
    if peer:
        assert peer_template is not None, "main() makes the peer's template whenever there is a peer"
        p_drain = ("procrastinate drain", lambda: scenario.drain(peer.PROCRASTINATE, server, peer_template,
                                                                 workers=w, items=args.runs))
        p_sus = ("procrastinate sustained", lambda: scenario.sustained(
            peer.PROCRASTINATE, server, peer_template, workers=w, duration=args.duration,
            max_backlog=args.max_backlog))
        steps = [c_drain, p_drain, p_sus, c_sus] if r % 2 == 0 else [p_drain, c_drain, c_sus, p_sus]
    else:
        steps = [c_drain, c_sus]
    if r == 0 and "fan" not in args.skip:
        steps.append(("composer fan-out sustained", lambda: scenario.sustained(
            COMPOSER, server, template, workers=w, duration=args.duration, workflow="fan",
            max_backlog=args.max_backlog)))
    return steps


def _procrastinate() -> Any:
    try:
        from bench import peer_procrastinate
    except ImportError:
        return None
    try:
        peer_procrastinate.version()
        import procrastinate  # noqa: F401
    except Exception:
        return None
    return peer_procrastinate


def _log(message: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    server = servers.session().primary
    _log(f"PostgreSQL {server.version} ({'embedded' if server.embedded else server.admin_url.split('@')[-1]})")
    results: dict[str, Any] = {"throughput": [], "latency": []}
    template = make_template(server, "bench_tpl")
    peer = None if "procrastinate" in args.skip else _procrastinate()
    if peer is None and "procrastinate" not in args.skip:
        _log("procrastinate is not installed (make bench installs it): the peer is skipped")
    peer_template = peer.make_template(server, "bench_tpl_peer") if peer else None
    load_before = os.getloadavg()

    if "pgbench" not in args.skip:
        _log("pgbench -N (the ceiling)")
        results["pgbench"] = pgbench.measure(server)

    if "throughput" not in args.skip:
        for w in (int(x) for x in args.workers.split(",")):
            rounds = args.repeat if w == 1 else 1
            for r in range(rounds):
                steps = _round_steps(args, server, template, peer, peer_template, w, r)
                for name, step in steps:
                    _log(f"{name}, W={w}" + (f", round {r + 1}/{rounds}" if rounds > 1 else ""))
                    result = step()
                    result["round"] = r
                    results["throughput"].append(result)

    if "latency" not in args.skip:
        systems: list[tuple[System, str]] = [(COMPOSER, template)]
        if peer:
            assert peer_template is not None, "made above whenever there is a peer"
            systems.append((peer.PROCRASTINATE, peer_template))
        for system, tpl in systems:
            _log(f"{system.name} paced at {args.pace:.0f}/s, W=1")
            results["latency"].append(scenario.sustained(system, server, tpl, workers=1, duration=args.duration,
                                                         pace=args.pace))

    if "hot" not in args.skip:
        _log("HOT updates and index writes, V004 vs latest")
        results["hot"] = hot.measure(server, runs=args.hot_runs, tasks=args.hot_runs)

    if "retention" not in args.skip:
        _log(f"retention: drop vs DELETE of {args.retention_rows:,} task rows")
        results["retention"] = retention.measure(server, template, rows=args.retention_rows)

    if "notebooks" not in args.skip:
        # Building 10 million task rows takes longer than this whole run: `python -m
        # bench.notebooks` does it separately; its last result is reported here.
        nb_file = RESULTS / "notebooks-latest.json"
        if nb_file.exists():
            results["notebooks"] = json.loads(nb_file.read_text())
        else:
            _log("no bench/results/notebooks-latest.json: run `python -m bench.notebooks` for the 10M-row figures")

    summary = summarize(results, server, peer, args, began, load_before)
    write(summary, args.out)
    render(summary)
    _log(f"done in {summary['elapsed_s']:.0f}s; wrote {args.out}")
    return 0


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def aggregate(throughput: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, mode, W): median rates over the rounds, and the median
    of the per-round Composer / Procrastinate ratios (each round's pair ran back to back)."""
    keys = sorted({(r["workflow"], r["mode"], r["workers"]) for r in throughput},
                  key=lambda k: (k[0] != "one", k[1], k[2]))
    rows = []
    for workflow, mode, workers in keys:
        same = [r for r in throughput if (r["workflow"], r["mode"], r["workers"]) == (workflow, mode, workers)]
        row: dict[str, Any] = {"workflow": workflow, "mode": mode, "workers": workers}
        for system in ("composer", "procrastinate"):
            mine = [r for r in same if r["system"] == system]
            row[system] = None if not mine else {
                "rounds": len(mine),
                "runs_per_s": _median([r["runs_per_s"] for r in mine]),
                "transitions_per_s": _median([r["transitions_per_s"] for r in mine]),
                "runs_per_s_all": [r["runs_per_s"] for r in mine],
                "server_cpu_ms_per_run": _median([r["cpu"]["server_ms_per_item"] for r in mine
                                                  if r["cpu"]["server_ms_per_item"] is not None]),
                "process_cpu_ms_per_run": _median([r["cpu"]["processes_ms_per_item"] for r in mine]),
            }
        ratios = []
        for rnd in sorted({r.get("round", 0) for r in same}):
            c = [r for r in same if r["system"] == "composer" and r.get("round", 0) == rnd]
            p = [r for r in same if r["system"] == "procrastinate" and r.get("round", 0) == rnd]
            if c and p and p[0]["runs_per_s"]:
                ratios.append(c[0]["runs_per_s"] / p[0]["runs_per_s"])
        row["ratios"] = ratios
        row["ratio"] = _median(ratios)
        rows.append(row)
    return rows


def _cpu_ratio(row: dict[str, Any]) -> float | None:
    """Procrastinate's CPU per job over Composer's per run (server + processes): above
    1 means Composer needs less CPU for the same work. Much less sensitive than the
    rates to what else runs on the machine."""
    c, p = row.get("composer"), row.get("procrastinate")
    if not c or not p or c["server_cpu_ms_per_run"] is None or p["server_cpu_ms_per_run"] is None:
        return None
    mine = c["server_cpu_ms_per_run"] + c["process_cpu_ms_per_run"]
    theirs = p["server_cpu_ms_per_run"] + p["process_cpu_ms_per_run"]
    return theirs / mine if mine else None


def summarize(results: dict[str, Any], server: servers.Server, peer: Any, args: argparse.Namespace,
              began: float, load_before: tuple[float, float, float]) -> dict[str, Any]:
    rows = aggregate(results["throughput"])
    results["throughput_summary"] = rows

    def row(mode: str, workers: int = 1, workflow: str = "one") -> dict[str, Any]:
        for r in rows:
            if (r["mode"], r["workers"], r["workflow"]) == (mode, workers, workflow):
                return r
        return {}

    def paced(system: str) -> dict[str, Any] | None:
        return next((r for r in results["latency"] if r["system"] == system), None)

    c_lat, p_lat = paced("composer"), paced("procrastinate")
    workers = sorted({r["workers"] for r in rows})
    tps = (results.get("pgbench") or {}).get("tps_by_clients") or {}
    hot_res = results.get("hot") or {}
    sus = row("sustained")
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "server_version": server.version,
        "server": {"embedded": server.embedded, "settings": server.settings()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "procrastinate_version": peer.version() if peer else None,
        "command": "python -m bench.run " + " ".join(sys.argv[1:]),
        "elapsed_s": time.monotonic() - began,
        "composer_runs_per_s": (sus.get("composer") or {}).get("runs_per_s"),
        "procrastinate_jobs_per_s": (sus.get("procrastinate") or {}).get("runs_per_s"),
        "ratio_vs_procrastinate": sus.get("ratio"),
        "ratio_vs_procrastinate_rounds": sus.get("ratios"),
        "ratio_vs_procrastinate_drain": row("drain").get("ratio"),
        "cpu_ratio_vs_procrastinate": _cpu_ratio(sus),
        "cpu_ratio_vs_procrastinate_drain": _cpu_ratio(row("drain")),
        "ratios_by_workers": {str(w): {"sustained": row("sustained", w).get("ratio"),
                                       "drain": row("drain", w).get("ratio")} for w in workers},
        "composer_runs_per_s_by_workers": {str(w): (row("sustained", w).get("composer") or {}).get("runs_per_s")
                                           for w in workers},
        "composer_fan_out_transitions_per_s": {
            str(w): (row("sustained", w, "fan").get("composer") or {}).get("transitions_per_s") for w in workers},
        "pgbench_tps": max(tps.values()) if tps else None,
        "pgbench_tps_by_clients": tps,
        "heartbeat_hot_ratio": hot_res.get("heartbeat_hot_ratio"),
        "heartbeat_hot_ratio_before": hot_res.get("heartbeat_hot_ratio_before"),
        "claim_to_complete_p50_ms": c_lat and c_lat["units"]["claim_to_complete_p50_ms"],
        "claim_to_complete_p99_ms": c_lat and c_lat["units"]["claim_to_complete_p99_ms"],
        "start_to_claim_p50_ms": c_lat and c_lat["units"]["start_to_claim_p50_ms"],
        "start_to_claim_p99_ms": c_lat and c_lat["units"]["start_to_claim_p99_ms"],
        "procrastinate_claim_to_complete_p50_ms": p_lat and p_lat["units"]["claim_to_complete_p50_ms"],
        "procrastinate_claim_to_complete_p99_ms": p_lat and p_lat["units"]["claim_to_complete_p99_ms"],
        "latency_pace_per_s": args.pace,
        "retention_delete_over_drop": (results.get("retention") or {}).get("delete_over_drop"),
        **notebook_keys(results.get("notebooks") or {}),
        "results": results,
    }


def notebook_keys(nb: dict[str, Any]) -> dict[str, Any]:
    """The headline keys of a bench.notebooks result (this tree's reports, not ``--before``'s)."""
    reports = {i["name"].removeprefix("report "): i["seconds"] for i in nb.get("items", [])
               if i["name"].startswith("report ") and not i["name"].endswith("(before)")}
    return {"notebooks_task_rows": nb.get("task_rows"),
            "notebooks_slowest_report_s": max(reports.values(), default=None),
            "notebooks_partition_sizes_report_s": reports.get("partition_sizes")}


if __name__ == "__main__":
    raise SystemExit(main())
