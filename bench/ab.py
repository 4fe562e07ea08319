"""Before/after of a hot-path change, measured side by side on one server.

``python -m bench.ab --before DIR`` runs Composer's 1-task workload (drain and
sustained) from two source trees, this one ("after") and DIR ("before", e.g. a
``git worktree`` of the previous commit), alternating which goes first every round,
and reports medians and the after/before ratios. The workers, coordinator and
producer of each side import that side's ``composer_ops``; the schema and the
server are shared. It also runs ``bench.roundtrips`` from both trees.

Results go to ``bench/results/ab-latest.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import scenario
from bench.procs import ROOT
from bench.workload import COMPOSER, make_template
from composer_ops.testing import servers


def _roundtrips(root: Path, runs: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.roundtrips", "--runs", str(runs)], cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                         check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the 'before' side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--runs", type=int, default=1500)
    parser.add_argument("--max-backlog", type=int, default=50)
    parser.add_argument("--workflow", default="one", choices=["one", "fan"],
                        help="one: the 1-task workload; fan: the 10-task fan-out/fan-in (sustained only)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ab-latest.json")
    args = parser.parse_args(argv)
    before_root = args.before.resolve()
    if not (before_root / "composer_ops").is_dir():
        parser.error(f"{before_root} has no composer_ops package")
    sides = {"after": dataclasses.replace(COMPOSER, label="after"),
             "before": dataclasses.replace(COMPOSER, root=before_root, label="before")}
    server = servers.session().primary
    template = make_template(server, "bench_tpl_ab")
    rows: list[dict[str, Any]] = []
    modes = ("drain", "sustained") if args.workflow == "one" else ("sustained",)
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for mode in modes:
            for side in order:
                sys.stderr.write(f"[ab] round {r + 1}/{args.rounds}: {side} {mode}\n")
                if mode == "drain":
                    res = scenario.drain(sides[side], server, template, workers=args.workers, items=args.runs,
                                         workflow=args.workflow)
                else:
                    res = scenario.sustained(sides[side], server, template, workers=args.workers,
                                             duration=args.duration, max_backlog=args.max_backlog,
                                             workflow=args.workflow)
                res["round"] = r
                rows.append(res)
    summary: dict[str, Any] = {"before_tree": str(before_root), "after_tree": str(ROOT), "server": server.version,
                               "workers": args.workers, "rounds": args.rounds, "workflow": args.workflow, "modes": {}}
    for mode in modes:
        per_side = {side: [x for x in rows if x["system"] == side and x["mode"] == mode] for side in sides}
        ratios = [a["runs_per_s"] / b["runs_per_s"]
                  for a, b in zip(per_side["after"], per_side["before"], strict=True) if b["runs_per_s"]]
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
    sys.stderr.write("[ab] round trips per event, both trees\n")
    summary["roundtrips"] = {"before": _roundtrips(before_root, 300), "after": _roundtrips(ROOT, 300)}
    summary["raw"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "raw"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
