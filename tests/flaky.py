"""The flaky-test finder: run a selection of the suite N times, optionally beside CPU hogs
and in random order, and collect every failure.

    python -m tests.flaky --runs 3 --hogs 2 --leg 18 --leg 15 tests/integration tests/notebooks
    python -m tests.flaky --runs 10 --hogs 2 --random-order        # the test-18 selection
    python -m tests.flaky --runs 2 --workers 0 tests/integration  # one pytest process, no xdist
    python -m tests.flaky --runs 3 --hogs 2 --leg citus          # make test-citus's tests

Arguments it does not know are passed to pytest (the selection, ``-k``, ``-x``); with
none, each leg's selection in ``make test``: for ``18`` and ``15`` everything but
tests/packaging and tests/citus, for ``citus`` tests/citus. Each run of each leg (``18``:
the embedded server; ``15``: ``--pg15-bin``'s binaries; ``citus``: a local Citus cluster
on those binaries, Citus installed first as ``make test-citus`` does) is one ``pytest``
run writing JUnit XML, read back for the failed and errored tests; like ``make test``'s
legs, 18 and 15 run on ``--workers`` pytest-xdist workers (default 2, each with a server
of its own; 0: in one process) and citus in one process. The load averages at the start and the end of
each run are written beside it, since a failure under load is what this hunts.
``--hogs K`` keeps K busy-looping Python processes running beside the runs, so a test
that races a timer against the machine's load fails here rather than on CI; they are
killed however the finder ends. ``--random-order`` shuffles the tests globally with
pytest-random-order, a fresh seed per run (written in the summary, so an order that
failed can be replayed with ``--random-order-seed``).

Every failure (test id, leg, run, seed, the failure's first line) goes to
``<out>/flaky.json`` and ``<out>/flaky.md``; the exit code is 1 if any run failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SELECTION = ["--ignore=tests/packaging", "--ignore=tests/citus", "tests"]
LEGS = ("18", "15", "citus")
#: Each leg's selection when none is given (``make test``'s).
LEG_SELECTION = {"18": DEFAULT_SELECTION, "15": DEFAULT_SELECTION, "citus": ["tests/citus"]}
#: How ``make test``'s 18 and 15 legs spread tests over workers (the Makefile's PYTEST_XDIST).
DIST = ["--dist", "worksteal"]


@dataclass(frozen=True, kw_only=True)
class Failure:
    test: str
    leg: str
    run: int
    kind: str             # "failed" or "error" (setup/teardown), or "pytest" for a run that ended badly
    message: str          # the failure's first line


@dataclass(kw_only=True)
class RunResult:
    leg: str
    run: int
    seed: int | None
    exit_code: int
    seconds: float
    tests: int
    failures: list[Failure] = field(default_factory=list)
    load_start: tuple[float, float, float] = (0.0, 0.0, 0.0)    # os.getloadavg() at the start and the end
    load_end: tuple[float, float, float] = (0.0, 0.0, 0.0)


def nodeid(classname: str, name: str, root: Path = ROOT) -> str:
    """The pytest node id of a JUnit test case: pytest writes ``tests.a.test_b.TestC``
    as the classname; the longest prefix that names a file is the module."""
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        # tests/a/test_b.py is written tests.a.test_b; notebooks/x.ipynb, notebooks.x.ipynb
        for path in ("/".join(parts[:cut]) + ".py", "/".join(parts[:cut - 1]) + "." + parts[cut - 1]):
            if cut > 1 or path.endswith(".py"):
                if (root / path).is_file():
                    return "::".join([path, *parts[cut:], name])
    return "::".join([*parts, name]) if parts else name


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def read_junit(path: Path, leg: str, run: int) -> tuple[int, list[Failure]]:
    """How many test cases the report holds, and the failed or errored ones."""
    tree = ET.parse(path)
    failures: list[Failure] = []
    cases = tree.getroot().iter("testcase")
    count = 0
    for case in cases:
        count += 1
        for kind in ("failure", "error"):
            for bad in case.findall(kind):
                test = nodeid(case.get("classname", ""), case.get("name", ""))
                message = first_line(bad.get("message")) or first_line(bad.text)
                failures.append(Failure(test=test, leg=leg, run=run, kind="failed" if kind == "failure" else "error",
                                        message=message))
    return count, failures


def leg_env(leg: str, pg15_bin: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSER_DATABASE_URL", "COMPOSER_TEST_PGBIN")}
    if leg == "15":
        env["COMPOSER_TEST_PGBIN"] = pg15_bin
    return env


def leg_plan(leg: str, selection: list[str], workers: int) -> tuple[list[str], int]:
    """The selection and xdist workers of one leg: the given selection, else the leg's own;
    the citus leg in one process, as ``make test-citus`` runs it (one cluster)."""
    return selection or LEG_SELECTION[leg], 0 if leg == "citus" else workers


def pytest_command(junit: Path, selection: list[str], *, workers: int, seed: int | None) -> list[str]:
    # The seed is the same in every xdist worker, so each collects the same shuffled order.
    order = ["--random-order-bucket=global", f"--random-order-seed={seed}"] if seed else []
    parallel = ["-n", str(workers), *DIST] if workers else ["-p", "no:xdist"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *parallel, *order,
            *selection]


def run_once(leg: str, run: int, selection: list[str], out: Path, *, pg15_bin: str, seed: int | None,
             workers: int = 2) -> RunResult:
    junit = out / f"run{run:02d}-pg{leg}.xml"
    log = out / f"run{run:02d}-pg{leg}.log"
    cmd = pytest_command(junit, selection, workers=workers, seed=seed)
    load_start = os.getloadavg()
    began = time.monotonic()
    with log.open("w", encoding="utf-8") as sink:
        code = subprocess.call(cmd, cwd=ROOT, env=leg_env(leg, pg15_bin), stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - began
    tests, failures = read_junit(junit, leg, run) if junit.is_file() else (0, [])
    if code != 0 and not failures:
        # A run that failed without a failed test (collection error, crash, an interrupted
        # session) is a failure of its own, with the log's last line.
        lines = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        failures.append(Failure(test="(pytest session)", leg=leg, run=run, kind="pytest",
                                message=f"exit {code}: {lines[-1].strip() if lines else 'no output'}"[:300]))
    return RunResult(leg=leg, run=run, seed=seed, exit_code=code, seconds=seconds, tests=tests, failures=failures,
                     load_start=load_start, load_end=os.getloadavg())


class Hogs:
    """K processes spinning a CPU each, for as long as the context lasts."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hogs:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def markdown(results: list[RunResult], hogs: int, selection: list[str]) -> str:
    legs = sorted({r.leg for r in results}, key=LEGS.index)
    chosen = [f"`{' '.join(selection)}`"] if selection else [f"{leg}: `{' '.join(LEG_SELECTION[leg])}`"
                                                           for leg in legs]
    lines = [f"# Flaky-test finder: {len(results)} pytest runs, {hogs} CPU hogs", "",
             f"Selection: {'; '.join(chosen)}", "",
             "| run | leg | seed | tests | failures | seconds | exit | load 1/5/15 min at start | at end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.run} | {r.leg} | {r.seed or ''} | {r.tests} | {len(r.failures)} | {r.seconds:.0f} | "
                     f"{r.exit_code} | {_load(r.load_start)} | {_load(r.load_end)} |")
    failures = [f for r in results for f in r.failures]
    lines += ["", f"## Failures: {len(failures)}", ""]
    if not failures:
        lines.append("None.")
    for f in failures:
        lines.append(f"- `{f.test}` ({'Citus' if f.leg == 'citus' else 'PostgreSQL ' + f.leg}, run {f.run}, "
                     f"{f.kind}): {f.message}")
    return "\n".join(lines) + "\n"


def _load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.1f}" for x in load)


def write_summary(out: Path, results: list[RunResult], hogs: int, selection: list[str]) -> None:
    legs = sorted({r.leg for r in results}, key=LEGS.index)
    doc = {"hogs": hogs, "selection": selection or {leg: LEG_SELECTION[leg] for leg in legs},
           "runs": [asdict(r) for r in results],
           "failures": [asdict(f) for r in results for f in r.failures]}
    (out / "flaky.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out / "flaky.md").write_text(markdown(results, hogs, selection), encoding="utf-8")


def _positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m tests.flaky", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=_positive, default=3, help="repetitions of each leg (default 3)")
    parser.add_argument("--hogs", type=_positive, default=0, help="CPU-hogging processes beside the runs")
    parser.add_argument("--leg", action="append", choices=LEGS,
                        help="leg: PostgreSQL 18, 15 or a Citus cluster; repeatable (default 18)")
    parser.add_argument("--pg15-bin", default=os.environ.get("PG15_BIN", "/usr/lib/postgresql/15/bin"))
    parser.add_argument("--random-order", action="store_true", help="shuffle the tests, a new seed each run")
    parser.add_argument("--workers", type=_positive, default=2,
                        help="pytest-xdist workers per run, as make test's legs (default 2; 0: one process)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "flaky", help="where the summary goes")
    args, selection = parser.parse_known_args(argv)
    if args.runs == 0:
        parser.error("--runs must be at least 1")
    return args, selection


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)     # unwinds through Hogs.__exit__, so no hog outlives the finder


def main(argv: list[str] | None = None) -> int:
    args, selection = parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminate)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random()
    results: list[RunResult] = []
    legs = args.leg or ["18"]
    if "citus" in legs:
        subprocess.run([sys.executable, "-m", "composer_ops.testing.citus", "install"], cwd=ROOT, check=True)
    with Hogs(args.hogs):
        for run in range(1, args.runs + 1):
            for leg in legs:
                seed = rng.randrange(1, 2**31) if args.random_order else None
                chosen, workers = leg_plan(leg, selection, args.workers)
                result = run_once(leg, run, chosen, out, pg15_bin=args.pg15_bin, seed=seed, workers=workers)
                results.append(result)
                write_summary(out, results, args.hogs, selection)
                print(f"run {run} leg {leg}: {result.tests} tests, {len(result.failures)} failures, "
                      f"{result.seconds:.0f} s, load {_load(result.load_start)} -> {_load(result.load_end)}"
                      + (f", seed {seed}" if seed else ""), flush=True)
                for f in result.failures:
                    print(f"  {f.kind} {f.test}: {f.message}", flush=True)
    failures = sum(len(r.failures) for r in results)
    print(f"{failures} failures in {len(results)} runs; summary in {out / 'flaky.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
