"""Before/after of a hot-path change, measured side by side on one server.

``python -m bench.ab --before DIR`` runs Composer's 1-task workload (drain and
sustained) from two source trees, this one ("after") and DIR ("before", e.g. a
``git worktree`` of the previous commit), alternating which goes first every round,
and reports medians and the after/before ratios. Each side runs on databases cloned
from a template its own tree migrated (``python -m composer_ops migrate`` of that
tree, with its ``sql/``), both templates on one server; its workers, coordinator
and producer import that side's ``composer_ops`` (:mod:`bench.sides`). The results
name, per side, the migrations its template recorded and the paths its processes
imported. It also runs ``bench.roundtrips`` from both trees, each on its own schema.

Results go to ``bench/results/ab-latest.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import scenario, sides
from bench.procs import ROOT
from bench.workload import COMPOSER, WORKFLOWS
from composer_ops.testing import servers


def _roundtrips(root: Path, runs: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(sides.run(root, "-m", "bench.roundtrips", "--runs", str(runs)))
    return result


def _imported(rows: list[dict[str, Any]], side: str) -> dict[str, list[str]]:
    """Which ``composer_ops`` and ``sql/`` the side's processes imported, over all its measurements."""
    return {key: sorted({p for r in rows if r["system"] == side for p in r["imports"][key]})
            for key in ("composer_ops", "migrations")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the 'before' side")
    parser.add_argument("--after", type=Path, default=ROOT,
                        help="source tree of the 'after' side (default: this one, which runs the harness)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--runs", type=int, default=1500)
    parser.add_argument("--max-backlog", type=int, default=50)
    parser.add_argument("--workflow", default="one", choices=["one", "fan"],
                        help="one: the 1-task workload; fan: the 10-task fan-out/fan-in (sustained only)")
    parser.add_argument("--roundtrip-runs", type=int, default=300, help="runs of bench.roundtrips per tree")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ab-latest.json")
    args = parser.parse_args(argv)
    trees = {"after": args.after.resolve(), "before": args.before.resolve()}
    for root in trees.values():
        if not (root / "composer_ops").is_dir() or not (root / "sql").is_dir():
            parser.error(f"{root} has no composer_ops package or no sql/")
    systems = {side: dataclasses.replace(COMPOSER, root=root, label=side) for side, root in trees.items()}
    server = servers.session().primary
    templates = {side: sides.make_template(server, root, f"bench_tpl_ab_{side}", list(WORKFLOWS.values()))
                 for side, root in trees.items()}
    rows: list[dict[str, Any]] = []
    modes = ("drain", "sustained") if args.workflow == "one" else ("sustained",)
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for mode in modes:
            for side in order:
                sys.stderr.write(f"[ab] round {r + 1}/{args.rounds}: {side} {mode}\n")
                if mode == "drain":
                    res = scenario.drain(systems[side], server, templates[side]["template"], workers=args.workers,
                                         items=args.runs, workflow=args.workflow)
                else:
                    res = scenario.sustained(systems[side], server, templates[side]["template"],
                                             workers=args.workers, duration=args.duration, max_backlog=args.max_backlog,
                                             workflow=args.workflow)
                res["round"] = r
                rows.append(res)
    summary: dict[str, Any] = {"before_tree": str(trees["before"]), "after_tree": str(trees["after"]),
                               "server": server.version,
                               "workers": args.workers, "rounds": args.rounds, "workflow": args.workflow,
                               "sides": {side: {**tpl, "processes_imported": _imported(rows, side)}
                                         for side, tpl in templates.items()},
                               "modes": {}}
    for mode in modes:
        per_side = {side: [x for x in rows if x["system"] == side and x["mode"] == mode] for side in trees}
        # Per round, in runs/s and in transitions/s (tasks claimed and finished: the unit of
        # a many-task workflow's goal, which the runs in flight at a short window's edges
        # do not move as they move runs/s).
        ratios, transition_ratios = ([a[unit] / b[unit] for a, b in zip(per_side["after"], per_side["before"],
                                                                        strict=True) if b[unit]]
                                     for unit in ("runs_per_s", "transitions_per_s"))
        summary["modes"][mode] = {
            side: {"runs_per_s": statistics.median(x["runs_per_s"] for x in xs),
                   "transitions_per_s": statistics.median(x["transitions_per_s"] for x in xs),
                   "runs_per_s_all": [x["runs_per_s"] for x in xs],
                   "server_cpu_ms_per_run": statistics.median(
                       x["cpu"]["server_ms_per_item"] or 0.0 for x in xs),
                   "process_cpu_ms_per_run": statistics.median(x["cpu"]["processes_ms_per_item"] for x in xs),
                   "claim_to_complete_p50_ms": statistics.median(
                       x["units"]["claim_to_complete_p50_ms"] or 0.0 for x in xs)}
            for side, xs in per_side.items()}
        summary["modes"][mode]["after_over_before"] = statistics.median(ratios) if ratios else None
        summary["modes"][mode]["ratios"] = ratios
        summary["modes"][mode]["transitions_after_over_before"] = (statistics.median(transition_ratios)
                                                                   if transition_ratios else None)
        summary["modes"][mode]["transition_ratios"] = transition_ratios
    sys.stderr.write("[ab] round trips per event, both trees\n")
    summary["roundtrips"] = {side: _roundtrips(root, args.roundtrip_runs) for side, root in trees.items()}
    summary["raw"] = rows
    for tpl in templates.values():
        server.drop_database(tpl["template"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "raw"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
