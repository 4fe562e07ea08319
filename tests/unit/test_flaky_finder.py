"""tests/flaky.py: JUnit test cases back to pytest node ids, and every failure kept."""

from __future__ import annotations

from pathlib import Path

from tests import flaky

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" tests="4">
<testcase classname="tests.unit.test_flaky_finder" name="test_ok" time="0.1"/>
<testcase classname="tests.integration.test_webhooks_hardening" name="test_posts[7]" time="2">
  <failure message="AssertionError: assert ['/held', '/ok'] == ['/held', '/held']&#10;  At index 1 diff">trace</failure>
</testcase>
<testcase classname="tests.unit.test_flaky_finder.TestGroup" name="test_in_class" time="0.1">
  <error message="">ResourceWarning: unclosed file&#10;more</error>
</testcase>
<testcase classname="tests.unit.test_flaky_finder" name="test_skipped" time="0"><skipped message="no"/></testcase>
</testsuite></testsuites>
"""


def test_junit_failures_become_node_ids_with_their_first_line(tmp_path: Path) -> None:
    report = tmp_path / "run.xml"
    report.write_text(JUNIT, encoding="utf-8")
    count, failures = flaky.read_junit(report, "15", 2)
    assert count == 4
    assert [(f.test, f.kind, f.message, f.leg, f.run) for f in failures] == [
        ("tests/integration/test_webhooks_hardening.py::test_posts[7]", "failed",
         "AssertionError: assert ['/held', '/ok'] == ['/held', '/held']", "15", 2),
        ("tests/unit/test_flaky_finder.py::TestGroup::test_in_class", "error", "ResourceWarning: unclosed file",
         "15", 2),
    ]


def test_classnames_of_notebooks_and_of_no_file() -> None:
    assert flaky.nodeid("notebooks.active_tasks.ipynb", "Cell 3") == "notebooks/active_tasks.ipynb::Cell 3"
    assert flaky.nodeid("no.such.module", "test_x") == "no::such::module::test_x"
    assert flaky.nodeid("", "test_x") == "test_x"


def test_without_a_selection_each_leg_runs_its_make_test_selection() -> None:
    args, selection = flaky.parse(["--runs", "2", "--hogs", "1"])
    assert (args.runs, args.hogs, args.leg, args.workers, selection) == (2, 1, None, 2, [])
    assert flaky.leg_plan("18", selection, 2) == (flaky.DEFAULT_SELECTION, 2)
    assert flaky.leg_plan("15", selection, 2) == (flaky.DEFAULT_SELECTION, 2)
    # Citus: make test-citus's tests, in one process (one cluster), whatever --workers says.
    assert flaky.leg_plan("citus", selection, 2) == (["tests/citus"], 0)
    args, selection = flaky.parse(["--leg", "15", "--leg", "citus", "-k", "webhook", "tests/integration"])
    assert (args.leg, selection) == (["15", "citus"], ["-k", "webhook", "tests/integration"])
    assert flaky.leg_plan("citus", selection, 2) == (["-k", "webhook", "tests/integration"], 0)


def test_the_summary_names_each_legs_selection_and_a_citus_failure() -> None:
    failure = flaky.Failure(test="tests/citus/test_a.py::t", leg="citus", run=1, kind="failed", message="boom")
    runs = [flaky.RunResult(leg="18", run=1, seed=None, exit_code=0, seconds=9.0, tests=5),
            flaky.RunResult(leg="citus", run=1, seed=None, exit_code=1, seconds=9.0, tests=5, failures=[failure])]
    text = flaky.markdown(runs, 0, [])
    assert "Selection: 18: `--ignore=tests/packaging --ignore=tests/citus tests`; citus: `tests/citus`" in text
    assert "- `tests/citus/test_a.py::t` (Citus, run 1, failed): boom" in text


def test_the_summary_lists_every_failure() -> None:
    failure = flaky.Failure(test="tests/a.py::t", leg="18", run=3, kind="failed", message="boom")
    runs = [flaky.RunResult(leg="18", run=3, seed=7, exit_code=1, seconds=12.0, tests=5, failures=[failure],
                            load_start=(2.0, 1.5, 1.25), load_end=(9.0, 4.0, 2.0))]
    text = flaky.markdown(runs, 2, ["tests/a.py"])
    assert "| 3 | 18 | 7 | 5 | 1 | 12 | 1 | 2.0 / 1.5 / 1.2 | 9.0 / 4.0 / 2.0 |" in text
    assert "- `tests/a.py::t` (PostgreSQL 18, run 3, failed): boom" in text


def test_runs_go_to_xdist_workers_as_the_legs_do_with_the_seed_in_each(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    cmd = flaky.pytest_command(junit, ["tests/unit"], workers=2, seed=11)
    assert cmd[cmd.index("-n"):] == ["-n", "2", *flaky.DIST, "--random-order-bucket=global",
                                     "--random-order-seed=11", "tests/unit"]
    cmd = flaky.pytest_command(junit, ["tests/unit"], workers=0, seed=None)
    assert "-n" not in cmd and cmd[-3:] == ["-p", "no:xdist", "tests/unit"]
