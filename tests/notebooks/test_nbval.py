"""The notebooks under nbval against the seeded database, connected as the
read-only role, and proof that the harness fails when a query is wrong."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import psycopg
import pytest

from composer_ops import reports
from composer_ops.testing import fixtures
from composer_ops.testing.checks import write_expecting
from tests.notebooks.harness import (
    NOTEBOOKS,
    as_role,
    code_cell_index,
    code_cells,
    failed_items,
    inject_after_parameters,
    passed_count,
    run_nbval_parallel,
    seed_committed,
)

ALL = sorted(NOTEBOOKS.glob("*.ipynb"))

# Each nested nbval run is bounded by its own 240 s (and 120 s a cell); the test's
# timeout leaves room for both groups on a loaded machine.
pytestmark = pytest.mark.timeout(600)


def test_the_five_notebooks_are_stored_without_outputs_and_one_parameters_cell() -> None:
    assert [p.stem for p in ALL] == ["active_tasks", "lease_expiries", "partition_sizes", "retention_dry_run",
                                     "run_investigation"]
    for path in ALL:
        nb = json.loads(path.read_text(encoding="utf-8"))
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, path.name
        assert "database_url = None" in "".join(tagged[0]["source"]), path.name
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, path.name
        assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_nbval_runs_every_notebook_green_as_the_reader_role(db_url: str, tmp_path: Path) -> None:
    info = seed_committed(db_url)
    expect = tmp_path / "expected.json"
    expect.write_text(json.dumps(fixtures.expected_figures(info)), encoding="utf-8")
    env = {"COMPOSER_DATABASE_URL": as_role(db_url), "COMPOSER_OPS_EXPECT": str(expect)}
    results = run_nbval_parallel([ALL[0::2], ALL[1::2]], env)
    output = "\n".join(r.stdout + r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 0], output[-4000:]
    # Every code cell of every notebook ran as a test: a harness that collects
    # nothing (exit 5) or skips cells cannot pass.
    assert sum(passed_count(r.stdout) for r in results) == sum(code_cells(p) for p in ALL), output[-2000:]


def test_nbval_checks_run_investigation_on_the_map_and_sub_workflow_runs(db_url: str, tmp_path: Path) -> None:
    """run_investigation with ``run_id`` set as papermill would set it, on the seed's MAP
    run (items by state, the slowest item), the parent and the child of its SUB_WORKFLOW
    node (linked both ways), and the MAP run whose counters disagree with its items
    (flagged, rendered): each checked through its key figures."""
    info = seed_committed(db_url)
    books = []
    for label, figures in fixtures.investigation_figures(info).items():
        copy = tmp_path / f"run_investigation_{label}.ipynb"
        path = inject_after_parameters(NOTEBOOKS / "run_investigation.ipynb", copy, f"run_id = {info.runs[label]!r}\n")
        books.append(write_expecting(path, path, figures))
    results = run_nbval_parallel([books[0::2], books[1::2]], {"COMPOSER_DATABASE_URL": as_role(db_url)},
                                 rootdir=tmp_path)
    output = "\n".join(r.stdout + r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 0], output[-4000:]
    assert sum(passed_count(r.stdout) for r in results) == sum(code_cells(p) for p in books), output[-2000:]


# Two deliberate bugs in the definition check, each caught only by the seed's exact figures:
# the run whose version is missing read as a task for an unknown node, and the total counted
# wrong.
ODD_BREAKS = {
    "kind": "import composer_ops.repo.analytics as _a\n"
            "_a.DEFINITION_MISMATCHES_SQL = _a.DEFINITION_MISMATCHES_SQL.replace("
            "'CASE WHEN d.id IS NOT NULL THEN t.node_id END', 't.node_id')\n",
    "count": "import composer_ops.repo.analytics as _a\n"
             "_a.DEFINITION_MISMATCHES_SQL = _a.DEFINITION_MISMATCHES_SQL.replace("
             "'count(*) OVER () AS total', 'count(*) AS total')\n",
}


def test_active_tasks_flags_exactly_the_active_work_its_definition_does_not_explain(
        db_url: str, tmp_path: Path) -> None:
    """The seed plus :func:`fixtures.odd_definitions`: active_tasks renders, as the reader
    role, and flags L6's and L7's extract_a and the run L8, with their count; a copy whose
    query misreads the run or miscounts fails its key figures."""
    info = seed_committed(db_url)
    with psycopg.connect(db_url) as conn:
        fixtures.odd_definitions(conn, info)
    figures = fixtures.odd_definitions_figures(info)
    good = write_expecting(NOTEBOOKS / "active_tasks.ipynb", tmp_path / "active_tasks_odd.ipynb", figures)
    broken = [write_expecting(path, path, figures) for path in (
        inject_after_parameters(NOTEBOOKS / "active_tasks.ipynb", tmp_path / f"broken_{kind}.ipynb", code)
        for kind, code in ODD_BREAKS.items())]
    results = run_nbval_parallel([[good], broken], {"COMPOSER_DATABASE_URL": as_role(db_url)}, rootdir=tmp_path)
    output = "\n".join(r.stdout + r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 1], output[-4000:]
    assert passed_count(results[0].stdout) == code_cells(good), output[-2000:]
    failures = {f.rsplit("/", 1)[-1] for f in failed_items(results[1].stdout)}
    assert failures == {f"{p.name}::Cell {code_cell_index(p, 'show_key_figures(')}" for p in broken}, output[-4000:]
    assert "Cell outputs differ" in results[1].stdout and "caused an exception" not in results[1].stdout


# Two deliberate bugs: one that the notebook's own invariants catch (WAITING tasks
# vanish from the group counts but not from the histogram), one that only the
# seed's exact figures catch (the busiest runs listed least-busy first).
BREAKS = {
    "invariant": ("active_tasks", "import composer_ops.repo.analytics as _a\n"
                  "_a.ACTIVE_BY_GROUP_SQL = _a.ACTIVE_BY_GROUP_SQL.replace(\"'WAITING')\", \"'WAIT')\")\n"),
    "figures": ("active_tasks", "import composer_ops.repo.analytics as _a\n"
                "_a.TOP_RUNS_SQL = _a.TOP_RUNS_SQL.replace('count(*) DESC', 'count(*) ASC')"
                ".replace('a.active_tasks DESC', 'a.active_tasks ASC')\n"),
}


def test_the_harness_fails_when_a_query_is_broken(db_url: str, tmp_path: Path) -> None:
    info = seed_committed(db_url)
    expected = fixtures.expected_figures(info)
    broken = [inject_after_parameters(NOTEBOOKS / f"{nb}.ipynb", tmp_path / f"broken_{kind}.ipynb", code)
              for kind, (nb, code) in BREAKS.items()]
    for path, (nb, _code) in zip(broken, BREAKS.values(), strict=True):
        write_expecting(path, path, expected[nb])
    results = run_nbval_parallel([[p] for p in broken], {"COMPOSER_DATABASE_URL": db_url}, rootdir=tmp_path)
    output = "\n".join(r.stdout + r.stderr for r in results)
    assert [r.returncode for r in results] == [1, 1], output[-4000:]
    failures = {f.rsplit("/", 1)[-1] for f in failed_items(output)}
    key_cells = {p.name: code_cell_index(p, "show_key_figures(") for p in broken}
    # Neither break stops its notebook; each fails the checked key-figures cell: the invariant
    # break through the failed self-check it lists, the subtle one through a wrong figure.
    assert failures == {f"{name}::Cell {cell}" for name, cell in key_cells.items()}, output[-4000:]
    # The invariant break, rendered as a report: the report still succeeds and says which
    # self-check failed, with the figures that broke it.
    books = tmp_path / "books"
    books.mkdir()
    shutil.copy(broken[0], books / "active_tasks.ipynb")
    (result,) = reports.run_reports(["active_tasks"], {}, tmp_path / "out", database_url=db_url, progress=False,
                                    directory=books)
    assert result.ok and result.html is not None, result.error
    page = result.html.read_text(encoding="utf-8")
    assert "self-checks FAILED" in page and "the age histogram counts every active task" in page
    assert re.search(r"histogram 17, groups 12", page), "the failing figure is shown"
    # Each notebook failed on a wrong figure, not on an exception in a cell.
    for r in results:
        assert "Cell outputs differ" in r.stdout and "caused an exception" not in r.stdout, r.stdout[-4000:]
