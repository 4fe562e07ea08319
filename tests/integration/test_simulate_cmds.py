"""``composer-ops simulate`` as ``make demo`` runs it, at CI size: history plus live
traffic through real coordinator and worker processes, then the promised mix in the
data; a second run adds nothing to history; bad options are one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops.cli import build_parser, main
from composer_ops.repo import simulator
from composer_ops.simulate.live import LiveOptions, plan_live, simulation_fleet
from composer_ops.simulate.model import Behaviour
from composer_ops.simulate.months import generated_months, month_sizes
from composer_ops.testing.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]
SEED = 5
RUNS = 60
LIVE = ["--runs", str(RUNS), "--duration-s", "14", "--workers", "2", "--concurrency", "6",
        "--kill-workers", "3", "--cancel-rate", "0.1"]
MODEL = ["--transient-rate", "0.06", "--permanent-rate", "0.03"]
HISTORY = ["--history-months", "2", "--runs-per-month", "150", "--stuck-months", "1"]


def _simulate(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COMPOSER_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "composer_ops", "simulate", "--database-url", db_url,
                           "--seed", str(SEED), "--time-scale", "0.5", "--no-progress", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _rows(conn: psycopg.Connection[Any], query: str, *params: Any) -> list[tuple[Any, ...]]:
    return conn.execute(query, params).fetchall()


KILLED = "a SIGKILLed worker's task retried after its lease lapsed"


def _holds_a_task(db_url: str, owner: str) -> bool:
    with psycopg.connect(db_url) as conn:
        return bool(_rows(conn, "SELECT 1 FROM task_instances WHERE state = 'RUNNING' AND lease_owner = %s", owner))


def _missing(db_url: str, live: list[str]) -> list[str]:
    """What the promised mix of the live runs still lacks."""
    with psycopg.connect(db_url) as conn:
        statuses = dict(_rows(conn, "SELECT status, count(*) FROM workflow_runs WHERE id = ANY(%s) GROUP BY 1",
                              live))
        types = {r[0] for r in _rows(conn, "SELECT DISTINCT node_type FROM task_instances WHERE run_id = ANY(%s)",
                                     live)}
        retried, failed, lapsed = _rows(conn, """
            SELECT count(*) FILTER (WHERE attempt > 0), count(*) FILTER (WHERE state = 'FAILED'),
                   count(*) FILTER (WHERE last_error->>'error' LIKE 'lease of sim-w%%:%% expired at %%')
              FROM task_instances WHERE run_id = ANY(%s)""", live)[0]
        buffered, consumed = _rows(conn, "SELECT count(*), count(consumed_at) FROM workflow_events "
                                         "WHERE run_id = ANY(%s)", live)[0]
    wanted = {
        "5 succeeded runs": statuses.get("SUCCEEDED", 0) >= 5,
        "a failed run": statuses.get("FAILED", 0) >= 1,
        "a cancelled run": statuses.get("CANCELLED", 0) >= 1,
        "every node type": types == {"TASK", "SWITCH", "WAIT", "WAIT_FOR_SIGNAL"},
        "a retried task": retried >= 1,
        "a failed task": failed >= 1,
        KILLED: lapsed >= 1,
        "a buffered signal consumed": buffered >= 1 and consumed >= 1,
    }
    return [what for what, ok in wanted.items() if not ok]


@pytest.mark.slow
@pytest.mark.timeout(1200)          # two simulate processes of up to 300 s each, and the finish
def test_simulate_at_ci_size_leaves_the_promised_mix(db_url: str, tmp_path: Path) -> None:
    # The plan is a pure function of the seed: it has early signals and cancellations to send.
    plan = plan_live(LiveOptions(seed=SEED, runs=RUNS, duration_s=14, cancel_rate=0.1,
                                 behaviour=Behaviour(time_scale=0.5)))
    assert sum(s.timing == "early" for p in plan for s in p.signals) >= 2
    assert sum(p.cancel is not None for p in plan) >= 3

    done = _simulate(db_url, *HISTORY, *LIVE, *MODEL)
    print(done.stdout)                  # the summary, shown by pytest when an assertion fails
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Live traffic" in done.stdout and "task rows/s" in done.stdout
    assert "not started" not in done.stdout             # every planned start was made, however late

    with psycopg.connect(db_url) as conn:
        month = _rows(conn, "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMM')")[0][0]
        live = [r[0] for r in _rows(conn, f"SELECT id FROM workflow_runs_p{month}")]
        assert len(live) == RUNS
        # History: two months, the most recent keeps an active run for retention to respect.
        per_status = simulator.runs_per_month(conn)
        months = [(m, sum(n for mm, _, n in per_status if mm == m),
                   sum(n for mm, st, n in per_status if mm == m and st == "RUNNING"))
                  for m in sorted({m for m, _, _ in per_status})]
        db_now = _rows(conn, "SELECT now()")[0][0]
        expected = month_sizes(generated_months(db_now, 2), 150, 0.08)
        assert {m: n for m, n, _ in months if m != month} == expected
        assert months[1][2] >= 1 and months[0][2] == 0

    # How much of the mix 14 s of live traffic reaches depends on the machine's load (13 of
    # 60 runs finished on two busy cores, none on two cores shared by a dozen processes):
    # the mix is the point, not the throughput. What is still missing when the simulation
    # stops, a worker and a coordinator of the same behaviour finish, within a generous
    # deadline; they stop as soon as the mix is there, so runs are still left active.
    # A loaded machine may run no task within the 14 s, so that no worker the simulation
    # killed held one: then the finish kills its own worker once it holds a task.
    if _missing(db_url, live):
        behaviour = Behaviour(time_scale=0.5, transient_rate=0.06, permanent_rate=0.03)
        with simulation_fleet(db_url, behaviour, logdir=tmp_path / "finish") as fleet:
            fleet.coordinator()
            worker = fleet.worker(concurrency=6)
            if KILLED in _missing(db_url, live):
                wait_for(lambda: _holds_a_task(db_url, f"sim-worker:{worker.pid}"), timeout=400, interval=0.2,
                         what="the finishing worker to hold a task")
                fleet.kill(worker, replace=True)
            wait_for(lambda: not _missing(db_url, live), timeout=400, interval=1.0,
                     what="the live runs to show the mix")
    assert _missing(db_url, live) == []
    with psycopg.connect(db_url) as conn:
        statuses = dict(_rows(conn, "SELECT status, count(*) FROM workflow_runs WHERE id = ANY(%s) GROUP BY 1",
                              live))
        assert statuses.get("RUNNING", 0) >= 1                      # some runs are left active
        versions = _rows(conn, "SELECT id, max(version) FROM workflow_definitions GROUP BY 1")
        before = _rows(conn, "SELECT count(*) FROM task_instances")[0][0]

    again = _simulate(db_url, *HISTORY, "--no-live")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already backfilled") == 2 and "(unchanged)" in again.stdout
    with psycopg.connect(db_url) as conn:
        assert _rows(conn, "SELECT count(*) FROM task_instances")[0][0] == before
        assert _rows(conn, "SELECT id, max(version) FROM workflow_definitions GROUP BY 1") == versions


@pytest.mark.parametrize(("args", "message"), [
    (["--runs", "-1"], "--runs must be between 0 and 1000000, got -1"),
    (["--transient-rate", "1.5"], "--transient-rate must be a fraction in [0, 1), got 1.5"),
    (["--workers", "0"], "--workers must be between 1 and 32, got 0"),
    (["--no-live"], "nothing to simulate"),
    (["--history-months", "500"], "--history-months must be between 0 and 120, got 500"),
    (["--time-scale", "0"], "--time-scale must be between 0.01 and 100, got 0.0"),
])
def test_bad_options_are_one_line_and_exit_2(args: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--database-url", "postgresql://nobody@/nowhere", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_environment_values_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COMPOSER_SIM_RUNS", "many")
    with pytest.raises(SystemExit) as exc:
        build_parser()
    assert exc.value.code == 2 and "COMPOSER_SIM_RUNS='many'" in capsys.readouterr().err
    monkeypatch.delenv("COMPOSER_SIM_RUNS")
    monkeypatch.setenv("COMPOSER_SIM_LIVE", "maybe")
    with pytest.raises(SystemExit) as exc:
        build_parser()
    assert exc.value.code == 2 and "COMPOSER_SIM_LIVE='maybe' is not a boolean" in capsys.readouterr().err


def test_every_option_names_its_environment_variable() -> None:
    parser = build_parser()
    simulate = next(a for a in parser._subparsers._group_actions[0].choices.items()  # type: ignore[union-attr]
                    if a[0] == "simulate")[1]
    flags = [a for a in simulate._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 18
    for action in flags:
        assert "[env: COMPOSER_" in (action.help or ""), action.option_strings
