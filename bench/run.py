"""``make bench``: every measurement of the benchmark, side by side, in one run.

Order matters on a shared machine: for each worker count W the Composer and
Procrastinate measurements are interleaved (C drain, P drain, P sustained,
C sustained), so slow drift of the machine's load hits both sides alike, and every
ratio compares figures taken minutes apart at most.

It runs once per server ("leg"): the embedded PostgreSQL 18, then a throwaway
cluster of Debian's PostgreSQL 15 binaries (``--pg15-bin``). Each leg compares
Composer with Procrastinate at W=1 (drain and sustained, ``--repeat`` rounds) and
measures pgbench and the paced latency; the parts that do not depend on the version
run on one leg each, to keep ``make bench`` within 15 minutes: ``--skip-pg18`` (by
default the months-retained case and the Citus case) and ``--skip-pg15`` (by default
the HOT and retention measurements, the fan-out workload, the MAP sizes and flow
control's cost in the claim, :mod:`bench.flowcost`). The W>1 rounds ("contention") run
on both legs: issue 25's goals at four workers are for both servers.
The Citus case (:mod:`bench.citus`) runs the W=1 workload on a local Citus cluster of
the 15 leg's binaries and on that leg's server, alternately.
With ``COMPOSER_DATABASE_URL`` set there is one leg, on that server, with every part.

Results: ``bench/results/<date>-<commit>.json`` (UTC date, the checkout's short commit,
``-dirty`` when tracked files outside bench/results differ from it), and
``bench/results/latest.json``, a copy of the newest.

    python -m bench.run                    # both legs (about 12 minutes on 2 quiet cores)
    python -m bench.run --quick            # a smoke test of every part (a few minutes)
    python -m bench.run --servers 18 --skip retention,hot --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import citus, flowcost, hot, mapitems, months, pgbench, retention, scenario
from bench.measure import median
from bench.report import dated_path, render, render_headline, write
from bench.scenario import System
from bench.workload import COMPOSER, make_template
from composer_ops.testing import servers
from composer_ops.testing.citus import ensure_installed

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("pgbench", "throughput", "contention", "procrastinate", "fan", "latency", "months", "hot", "retention",
         "notebooks", "citus", "map", "flow")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="18,15",
                   help="legs: 18 = the embedded server, 15 = a cluster of --pg15-bin (default 18,15)")
    p.add_argument("--pg15-bin", type=Path, default=scenario.DEBIAN_PG15_BIN, help="PostgreSQL 15 server binaries")
    p.add_argument("--skip-pg18", default="months,citus", help="parts the PostgreSQL 18 leg leaves out")
    p.add_argument("--skip-pg15", default="hot,retention,fan,map,flow",
                   help="parts the PostgreSQL 15 leg leaves out")
    p.add_argument("--workers", default="1,4", help="worker process counts (default 1,4)")
    p.add_argument("--runs", type=int, default=1000, help="runs (jobs) per drain measurement")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per sustained workload")
    p.add_argument("--repeat", type=int, default=4,
                   help="rounds of the W=1 comparison; medians are reported (default 4: each side goes first twice)")
    p.add_argument("--max-backlog", type=int, default=50, help="unfinished runs the sustained producer allows")
    p.add_argument("--pace", type=float, default=100.0, help="runs/s of the paced latency measurement")
    p.add_argument("--hot-runs", type=int, default=200, help="runs per HOT phase")
    p.add_argument("--months", default="1,6,24", help="months of history retained, compared")
    p.add_argument("--months-runs", type=int, default=1000, help="runs per backfilled month")
    p.add_argument("--months-claims", type=int, default=500, help="claims timed per database and round")
    p.add_argument("--retention-rows", type=int, default=250_000, help="task rows per month for retention")
    p.add_argument("--citus-runs", type=int, default=400,
                   help="runs per drain in the Citus case (default 400: at its rate a drain of --runs took 40 s)")
    p.add_argument("--citus-shards", type=int, default=32,
                   help="shards per distributed table in the Citus case (Citus's default, 32)")
    p.add_argument("--citus-worker-nodes", default="2",
                   help="worker-node counts of the Citus case, each a cluster of its own measured side by side "
                        "(default 2; 2,4 compares two and four)")
    p.add_argument("--flow-runs", type=int, default=80,
                   help="claims per configuration, mode and round of flow control's cost (bench.flowcost)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that every part works")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (default bench/results/<date>-<commit>.json; latest.json is a copy)")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.runs, args.duration, args.hot_runs, args.retention_rows = "1,4", 300, 3.0, 100, 50_000
        args.repeat, args.months, args.months_runs, args.months_claims = 1, "1,3", 200, 50
        args.citus_runs, args.flow_runs = 100, 20
    try:
        args.citus_worker_nodes = tuple(dict.fromkeys(int(x) for x in args.citus_worker_nodes.split(",") if x.strip()))
    except ValueError:
        p.error(f"--citus-worker-nodes takes counts like 2,4, got {args.citus_worker_nodes}")
    if not args.citus_worker_nodes or min(args.citus_worker_nodes) < 1:
        p.error("--citus-worker-nodes needs at least one count, each at least 1")
    args.skip = _parts(p, args.skip)
    args.skip_pg15 = _parts(p, args.skip_pg15)
    args.skip_pg18 = _parts(p, args.skip_pg18)
    args.servers = [x.strip() for x in args.servers.split(",") if x.strip()]
    if not args.servers or set(args.servers) - {"15", "18"}:
        p.error(f"--servers takes 18 and/or 15, got {','.join(args.servers) or 'nothing'}")
    if ("15" in args.servers and not os.environ.get("COMPOSER_DATABASE_URL")
            and not (args.pg15_bin / "initdb").exists()):
        p.error(f"no PostgreSQL 15 server binaries in {args.pg15_bin} "
                "(apt-get install postgresql-15, give --pg15-bin DIR, or --servers 18)")
    try:
        args.months = tuple(sorted({int(x) for x in args.months.split(",")}))
    except ValueError:
        p.error(f"--months takes month counts like 1,6,24, got {args.months}")
    if len(args.months) < 2 or args.months[0] < 1:
        p.error("--months needs at least two counts, each at least 1")
    return args


def _parts(p: argparse.ArgumentParser, text: str) -> set[str]:
    parts = {s.strip() for s in text.split(",") if s.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) to skip: {', '.join(sorted(unknown))}")
    return parts


def _round_steps(args: argparse.Namespace, server: servers.Server, template: str, peer: Any,
                 peer_template: str | None, w: int, r: int, skip: set[str]) -> list[tuple[str, Any]]:
    """One round for W workers: Composer and Procrastinate alternate, and the order
    flips every round (C P P C, then P C C P), so drift in the machine's load hits
    both sides alike. Drains are compared at W=1 only; above it the sustained
    workload shows the ratio under contention and the empty claims. The fan-out
    workload runs in every other round of W=1 (its figure is the median of those)."""
    c_drain = ("composer drain", lambda: scenario.drain(COMPOSER, server, template, workers=w, items=args.runs))
    c_sus = ("composer sustained", lambda: scenario.sustained(
        COMPOSER, server, template, workers=w, duration=args.duration, max_backlog=args.max_backlog))
    pair: list[tuple[str, Any]] = [c_drain, c_sus] if w == 1 else [c_sus]
    if peer:
        assert peer_template is not None, "run_leg() makes the peer's template whenever there is a peer"
        p_drain = ("procrastinate drain", lambda: scenario.drain(peer.PROCRASTINATE, server, peer_template,
                                                                 workers=w, items=args.runs))
        p_sus = ("procrastinate sustained", lambda: scenario.sustained(
            peer.PROCRASTINATE, server, peer_template, workers=w, duration=args.duration,
            max_backlog=args.max_backlog))
        if w == 1:
            pair = [c_drain, p_drain, p_sus, c_sus] if r % 2 == 0 else [p_drain, c_drain, c_sus, p_sus]
        else:
            pair = [c_sus, p_sus] if r % 2 == 0 else [p_sus, c_sus]
    steps = list(pair)
    if w == 1 and r % 2 == 0 and "fan" not in skip:
        steps.append(("composer fan-out sustained", lambda: scenario.sustained(
            COMPOSER, server, template, workers=w, duration=args.duration, workflow="fan",
            max_backlog=args.max_backlog)))
    return steps


def _procrastinate() -> Any:
    try:
        from bench import peer_procrastinate
    except ImportError:
        return None
    return peer_procrastinate if peer_procrastinate.installed() else None


def _log(message: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    peer = None if "procrastinate" in args.skip else _procrastinate()
    if peer is None and "procrastinate" not in args.skip:
        _log("procrastinate is not installed (make bench installs it): the peer is skipped")
    legs: list[dict[str, Any]] = []
    external = bool(os.environ.get("COMPOSER_DATABASE_URL"))
    if "15" in args.servers and not external and "citus" not in args.skip | args.skip_pg15:
        # Installing Citus installs its build packages, which can upgrade Debian's
        # PostgreSQL 15 to the newest minor release: a postmaster already running would
        # then load that release's libraries (plpgsql.so: "undefined symbol"). So it is
        # installed, when missing, before any server of this run starts.
        _log("the Citus case: Citus installed into the PostgreSQL 15 tree first, if missing")
        ensure_installed(args.pg15_bin)
    for leg in (["external"] if external else args.servers):
        server = scenario.start_server(args.pg15_bin if leg == "15" else None)
        skip = args.skip | {"15": args.skip_pg15, "18": args.skip_pg18}.get(leg, set())
        legs.append(run_leg(args, server, peer, skip))
        if not external:
            server.stop()
    summary = combine(legs, args, began)
    out = args.out or dated_path(RESULTS)
    write(summary, out)
    if args.out is None:
        shutil.copyfile(out, RESULTS / "latest.json")
    for leg_summary in legs:
        render(leg_summary)
    render_headline(summary)
    _log(f"done in {summary['elapsed_s']:.0f}s; wrote {out}" + ("" if args.out else " and latest.json"))
    return 0


def run_leg(args: argparse.Namespace, server: servers.Server, peer: Any, skip: set[str]) -> dict[str, Any]:
    """Every part not in ``skip`` on one server; returns that leg's summary."""
    began = time.monotonic()
    _log(f"PostgreSQL {server.version} ({'embedded' if server.embedded else server.admin_url.split('@')[-1]})")
    results: dict[str, Any] = {"throughput": [], "latency": []}
    template = make_template(server, "bench_tpl")
    leg_peer = None if "procrastinate" in skip else peer
    peer_template = leg_peer.make_template(server, "bench_tpl_peer") if leg_peer else None
    load_before = os.getloadavg()

    if "pgbench" not in skip:
        _log("pgbench -N (the ceiling)")
        results["pgbench"] = pgbench.measure(server)

    if "throughput" not in skip:
        for w in (int(x) for x in args.workers.split(",")):
            if w > 1 and "contention" in skip:
                continue
            rounds = args.repeat if w == 1 else 1
            for r in range(rounds):
                steps = _round_steps(args, server, template, leg_peer, peer_template, w, r, skip)
                for name, step in steps:
                    _log(f"{name}, W={w}" + (f", round {r + 1}/{rounds}" if rounds > 1 else ""))
                    result = step()
                    result["round"] = r
                    results["throughput"].append(result)

    if "latency" not in skip:
        systems: list[tuple[System, str]] = [(COMPOSER, template)]
        if leg_peer:
            assert peer_template is not None, "made above whenever there is a peer"
            systems.append((leg_peer.PROCRASTINATE, peer_template))
        for system, tpl in systems:
            _log(f"{system.name} paced at {args.pace:.0f}/s, W=1")
            results["latency"].append(scenario.sustained(system, server, tpl, workers=1, duration=args.duration,
                                                         pace=args.pace))

    if "months" not in skip:
        _log(f"months retained {', '.join(map(str, args.months))}: backfill, then claim cost and throughput")
        results["months"] = months.measure(server, months=args.months, runs_per_month=args.months_runs,
                                           claims=args.months_claims, rounds=2, duration=min(args.duration, 4.0),
                                           max_backlog=args.max_backlog, log=_log)

    if "hot" not in skip:
        _log("HOT updates and index writes, V004 vs latest")
        results["hot"] = hot.measure(server, runs=args.hot_runs, tasks=args.hot_runs)

    if "retention" not in skip:
        _log(f"retention: drop vs DELETE of {args.retention_rows:,} task rows")
        results["retention"] = retention.measure(server, template, rows=args.retention_rows)

    if "map" not in skip:
        _log("MAP nodes: an item's event at 10, 1,000 and 10,000 items (10,000 in the first round only)")
        results["map"] = mapitems.measure(server, rounds=1 if args.quick else 2, largest_rounds=1, log=_log)

    if "flow" not in skip:
        _log("flow control's cost in the claim: five configurations side by side")
        results["flow"] = flowcost.measure(server, runs=args.flow_runs, rounds=2 if args.quick else 4, log=_log)

    if "citus" not in skip and server.kind == "cluster":
        nodes = " and ".join(str(n) for n in args.citus_worker_nodes)
        _log(f"the Citus case: the same workload on a coordinator and {nodes} worker nodes of this server's binaries")
        results["citus"] = citus.measure(server, template, runs=args.citus_runs, duration=args.duration,
                                         max_backlog=args.max_backlog, rounds=max(2, args.repeat // 2),
                                         shard_count=args.citus_shards, log=_log,
                                         worker_nodes=args.citus_worker_nodes)

    if "notebooks" not in skip:
        # Building 10 million task rows takes longer than this whole run: `python -m
        # bench.notebooks` does it separately; its last result is reported here.
        nb_file = RESULTS / "notebooks-latest.json"
        if nb_file.exists():
            results["notebooks"] = json.loads(nb_file.read_text())
        else:
            _log("no bench/results/notebooks-latest.json: run `python -m bench.notebooks` for the 10M-row figures")

    return summarize(results, server, leg_peer, args, began, load_before)


def _median_by_key(dicts: list[dict[str, float]]) -> dict[str, float | None]:
    """Per key, the median of the values the dicts have for it."""
    keys = sorted({k for d in dicts for k in d})
    return {k: median([d[k] for d in dicts if k in d]) for k in keys}


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
                "runs_per_s": median([r["runs_per_s"] for r in mine]),
                "transitions_per_s": median([r["transitions_per_s"] for r in mine]),
                "runs_per_s_all": [r["runs_per_s"] for r in mine],
                "server_cpu_ms_per_run": median([r["cpu"]["server_ms_per_item"] for r in mine
                                                  if r["cpu"]["server_ms_per_item"] is not None]),
                "process_cpu_ms_per_run": median([r["cpu"]["processes_ms_per_item"] for r in mine]),
                "empty_claim_share": median([r["claims"]["empty_share"] for r in mine
                                              if (r.get("claims") or {}).get("empty_share") is not None]),
                "empty_claim_share_by_reason": _median_by_key(
                    [(r.get("claims") or {}).get("empty_share_by_reason") or {} for r in mine]),
            }
        ratios = []
        for rnd in sorted({r.get("round", 0) for r in same}):
            c = [r for r in same if r["system"] == "composer" and r.get("round", 0) == rnd]
            p = [r for r in same if r["system"] == "procrastinate" and r.get("round", 0) == rnd]
            if c and p and p[0]["runs_per_s"]:
                ratios.append(c[0]["runs_per_s"] / p[0]["runs_per_s"])
        row["ratios"] = ratios
        row["ratio"] = median(ratios)
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


def _cpu_total(row: dict[str, Any], system: str) -> float | None:
    """Server + processes CPU ms per run (job), medians over the rounds."""
    side = row.get(system)
    if not side or side["server_cpu_ms_per_run"] is None or side["process_cpu_ms_per_run"] is None:
        return None
    total: float = side["server_cpu_ms_per_run"] + side["process_cpu_ms_per_run"]
    return total


#: The keys ``by_server`` repeats for every leg (and the headline prints).
HEADLINE = ("server_version", "composer_runs_per_s", "procrastinate_jobs_per_s", "ratio_vs_procrastinate",
            "ratio_vs_procrastinate_rounds", "ratio_vs_procrastinate_drain", "cpu_ms_per_run",
            "procrastinate_cpu_ms_per_job", "cpu_ms_per_run_drain", "procrastinate_cpu_ms_per_job_drain",
            "cpu_ratio_vs_procrastinate", "claim_locks_by_months", "empty_claim_share_w1", "empty_claim_share_w4",
            "empty_claim_share_w4_by_reason", "ratios_by_workers", "composer_runs_per_s_by_workers",
            "fan_out_transitions_per_s", "claim_to_complete_p50_ms", "claim_to_complete_p99_ms",
            "start_to_claim_p50_ms", "start_to_claim_p99_ms", "pgbench_tps", "heartbeat_hot_ratio",
            "retention_delete_over_drop", "flow_claim_cpu_ratios", "citus_ratio_sustained", "citus_ratio_drain",
            "citus_runs_per_s", "citus_cpu_ms_per_run")


def combine(legs: list[dict[str, Any]], args: argparse.Namespace, began: float) -> dict[str, Any]:
    """One results document: the first leg's keys at the top (the embedded server's
    when it ran), a key that leg did not measure taken from the leg that did (named in
    ``keys_from``), every leg's headline keys under ``by_server`` (by major version),
    and every leg in full under ``legs``."""
    top = {k: v for k, v in legs[0].items() if k != "results"}
    keys_from: dict[str, str] = {}
    for leg in legs[1:]:
        for key, value in leg.items():
            if key != "results" and top.get(key) is None and value is not None:
                top[key] = value
                keys_from[key] = leg["server_version"]
    months_keys = [k for k in top if k.endswith("_months")]
    by_server = {leg["server_version"].split(".")[0]: {k: leg.get(k) for k in (*HEADLINE, *months_keys)}
                 for leg in legs}
    return {**top, "keys_from": keys_from, "elapsed_s": time.monotonic() - began,
            "command": "python -m bench.run " + " ".join(sys.argv[1:]), "by_server": by_server, "legs": legs}


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
    mon = results.get("months") or {}
    lo, hi = (min(args.months), max(args.months))
    empty = {str(w): (row("sustained", w).get("composer") or {}).get("empty_claim_share") for w in workers}
    empty_by_reason = {str(w): (row("sustained", w).get("composer") or {}).get("empty_claim_share_by_reason")
                       for w in workers}
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
        "cpu_ms_per_run": _cpu_total(sus, "composer"),
        "procrastinate_cpu_ms_per_job": _cpu_total(sus, "procrastinate"),
        "cpu_ms_per_run_drain": _cpu_total(row("drain"), "composer"),
        "procrastinate_cpu_ms_per_job_drain": _cpu_total(row("drain"), "procrastinate"),
        f"claim_p50_ratio_{hi}_vs_{lo}_months": mon.get(f"claim_p50_ratio_{hi}_vs_{lo}_months"),
        f"claim_p99_ratio_{hi}_vs_{lo}_months": mon.get(f"claim_p99_ratio_{hi}_vs_{lo}_months"),
        f"runs_per_s_ratio_{hi}_vs_{lo}_months": mon.get(f"runs_per_s_ratio_{hi}_vs_{lo}_months"),
        f"claim_server_cpu_ratio_{hi}_vs_{lo}_months": mon.get(f"claim_server_cpu_ratio_{hi}_vs_{lo}_months"),
        "claim_locks_by_months": mon.get("claim_locks_by_months"),
        "empty_claim_share_w1": empty.get("1"),
        "empty_claim_share_w4": empty.get("4"),
        "empty_claim_share_by_workers": empty,
        # what started the empty claims (Worker.claim_counts): own channel, shared channel, room
        "empty_claim_share_w4_by_reason": empty_by_reason.get("4"),
        "fan_out_transitions_per_s": (row("sustained", 1, "fan").get("composer") or {}).get("transitions_per_s"),
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
        "map_event_ratio_by_items": (results.get("map") or {}).get("event_ratio_by_size"),
        # server CPU per claim of each flow configuration over none's (bench.flowcost)
        "flow_claim_cpu_ratios": flowcost.headline(results["flow"]) if results.get("flow") else None,
        **citus_keys(results.get("citus") or {}),
        **notebook_keys(results.get("notebooks") or {}),
        "results": results,
    }


def citus_keys(case: dict[str, Any]) -> dict[str, Any]:
    """The Citus case's headline: Citus over the single server (sustained and drain),
    Citus's sustained runs/s and its CPU per run (every node, and the processes)."""
    summary = case.get("summary") or {}
    sus, drain = summary.get("sustained") or {}, summary.get("drain") or {}
    return {"citus_ratio_sustained": sus.get("ratio"), "citus_ratio_drain": drain.get("ratio"),
            "citus_runs_per_s": sus.get("citus_runs_per_s"), "citus_cpu_ms_per_run": sus.get("citus_cpu_ms_per_run")}


def notebook_keys(nb: dict[str, Any]) -> dict[str, Any]:
    """The headline keys of a bench.notebooks result (this tree's reports, not ``--before``'s)."""
    reports = {i["name"].removeprefix("report "): i["seconds"] for i in nb.get("items", [])
               if i["name"].startswith("report ") and not i["name"].endswith("(before)")}
    return {"notebooks_task_rows": nb.get("task_rows"),
            "notebooks_slowest_report_s": max(reports.values(), default=None),
            "notebooks_partition_sizes_report_s": reports.get("partition_sizes")}


if __name__ == "__main__":
    raise SystemExit(main())
