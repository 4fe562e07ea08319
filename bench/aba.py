"""Side by side with a control: is a before/after difference larger than the noise?

``bench.ab`` compares two trees; on this shared 2-core machine its rounds spread by
±20%, so a median 5 to 8% apart says little by itself. Here the same workload runs
from three or more trees in rotation, one of them a second checkout of another's
commit (the control): the ratio between the two identical trees is the noise of this
very run, and a change is within noise when its ratio to *each* copy lies inside it.

Run as a file, so that ``bench`` (the harness: scenarios, server, the measuring
queries) comes from the tree on ``PYTHONPATH``, which may be an older one (use the
oldest when a later tree dropped a column the measuring queries read)::

    PYTHONPATH=OLD python bench/aba.py --rounds 10 old=OLD control=OLD_COPY new=NEW

Each round runs every side once (the order rotates and alternates direction), the
1-task workload at W=1, sustained (``--mode drain`` for the drain); it prints the
median ratio of runs/s and the median difference of CPU per run (server plus
processes) for every pair, and writes them with the raw rounds to ``--out``.

Each side runs on databases cloned from a template migrated by its own tree
(``bench/sides.py``, loaded from beside this file whatever ``PYTHONPATH`` says); the
results name each side's migrations and the paths its processes imported (its
template's migrate and deploy, and with a harness that records them, every
measurement's processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _server() -> Any:
    """The harness's PostgreSQL server: ``bench.server`` in trees older than
    ``composer_ops.testing.servers``, which replaced it."""
    if importlib.util.find_spec("bench.server") is not None:
        return importlib.import_module("bench.server").start()
    return importlib.import_module("composer_ops.testing.servers").session().primary


def _sides_module() -> Any:
    """``bench/sides.py`` beside this file (the harness on PYTHONPATH may predate it)."""
    spec = importlib.util.spec_from_file_location("bench_sides", Path(__file__).with_name("sides.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _side(arg: str) -> tuple[str, Path]:
    name, sep, path = arg.partition("=")
    root = Path(path).resolve()
    if not sep or not name or not (root / "composer_ops").is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR a source tree holding composer_ops/, got {arg!r}")
    return name, root


def pairs(rows: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """For each pair of sides (a before b in ``names``), the per-round ratios of a's
    runs/s to b's, their median, and the median per-round difference of CPU per run."""
    out: dict[str, dict[str, Any]] = {}
    by = {(r["side"], r["round"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = [(by[a, n], by[b, n]) for n in rounds if (a, n) in by and (b, n) in by and by[b, n]["runs_per_s"]]
            ratios = [x["runs_per_s"] / y["runs_per_s"] for x, y in both]
            cpu = [x["cpu_ms_per_run"] - y["cpu_ms_per_run"] for x, y in both
                   if x["cpu_ms_per_run"] is not None and y["cpu_ms_per_run"] is not None]
            out[f"{a}/{b}"] = {"median": statistics.median(ratios) if ratios else None, "ratios": ratios,
                               "cpu_ms_per_run_diff_median": statistics.median(cpu) if cpu else None}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/aba.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sides", nargs="+", type=_side, metavar="NAME=DIR")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mode", choices=["sustained", "drain"], default="sustained")
    parser.add_argument("--duration", type=float, default=6.0, help="sustained window, seconds")
    parser.add_argument("--runs", type=int, default=1500, help="drain: runs started before the workers")
    parser.add_argument("--out", type=Path, default=Path("aba-latest.json"))
    args = parser.parse_args(argv)
    names = [name for name, _ in args.sides]
    if len(set(names)) != len(names) or len(names) < 2:
        parser.error("give at least two sides with distinct names")
    scenario = importlib.import_module("bench.scenario")
    workload = importlib.import_module("bench.workload")
    sides = {name: dataclasses.replace(workload.COMPOSER, root=root, label=name) for name, root in args.sides}
    server = _server()
    workflows = list(getattr(workload, "WORKFLOWS", {"one": workload.ONE_TASK}).values())
    side_tool = _sides_module()
    templates = {name: side_tool.make_template(server, root, f"bench_tpl_aba_{name}", workflows)
                 for name, root in args.sides}
    imports: dict[str, list[dict[str, list[str]]]] = {name: [] for name in names}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order.reverse()
        for side in order:
            if args.mode == "drain":
                res = scenario.drain(sides[side], server, templates[side]["template"], workers=1, items=args.runs)
            else:
                res = scenario.sustained(sides[side], server, templates[side]["template"], workers=1,
                                         duration=args.duration, max_backlog=50)
            if "imports" in res:
                imports[side].append(res["imports"])
            # None when no run completed inside the window (CPU per run is then undefined)
            parts = (res["cpu"]["processes_ms_per_item"], res["cpu"]["server_ms_per_item"])
            cpu = None if None in parts else sum(parts)
            rows.append({"round": r, "side": side, "runs_per_s": res["runs_per_s"], "cpu_ms_per_run": cpu})
            sys.stderr.write(f"[aba] round {r + 1}/{args.rounds} {side}: {res['runs_per_s']:.0f} runs/s, "
                             f"{'-' if cpu is None else f'{cpu:.2f}'} ms CPU per run\n")
    summary = pairs(rows, names)
    for pair, figures in summary.items():
        cpu_diff = figures["cpu_ms_per_run_diff_median"]
        print(f"{pair}: median {figures['median']}, rounds {[round(x, 2) for x in figures['ratios']]}, "
              f"CPU per run {'-' if cpu_diff is None else f'{cpu_diff:+.2f}'} ms")
    for tpl in templates.values():
        server.drop_database(tpl["template"])
    result = {"server": server.version, "mode": args.mode, "rounds": args.rounds,
              "trees": {name: str(root) for name, root in args.sides},
              "sides": {name: {**tpl, "processes_imported": {
                  key: sorted({p for got in imports[name] for p in got[key]}) for key in ("composer_ops", "migrations")}
                  if imports[name] else None} for name, tpl in templates.items()},
              "pairs": summary, "raw": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
