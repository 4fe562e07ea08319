"""bench.ab and bench/aba.py compare two source trees whose SQL differs: each side runs on
a template its own tree migrated, and its processes import its own code and sql/.

The 'before' tree is a copy of this one with one more migration (a marker table);
before the fix both sides ran on the schema of the tree the harness started from, so
the copy's migration was never applied anywhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psycopg
import pytest

from bench import ab, aba, sides
from bench.procs import ROOT, ProcessGroup
from bench.workload import WORKFLOWS
from composer_ops.testing.servers import Server

MARKER = "V999__bench_side_marker.sql"


@pytest.fixture(scope="module")
def before_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("before")
    skip = shutil.ignore_patterns("__pycache__", "results", "*.pyc")
    for name in ("composer_ops", "bench", "sql"):
        shutil.copytree(ROOT / name, root / name, ignore=skip)
    (root / "sql" / MARKER).write_text("CREATE TABLE bench_side_marker (tree TEXT);\n")
    return root.resolve()


def _has_marker(url: str) -> bool:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT to_regclass('bench_side_marker') IS NOT NULL").fetchone() == (True,)


def test_each_side_is_migrated_by_its_own_tree_and_imports_its_own_code(server: Server, before_tree: Path) -> None:
    made = {side: sides.make_template(server, root, f"bench_tpl_test_{side}", list(WORKFLOWS.values()))
            for side, root in (("after", ROOT), ("before", before_tree))}
    try:
        assert MARKER in made["before"]["migrations"] and MARKER not in made["after"]["migrations"]
        assert _has_marker(server.url("bench_tpl_test_before"))
        assert not _has_marker(server.url("bench_tpl_test_after"))
        for side, root in (("after", ROOT), ("before", before_tree)):
            assert made[side]["imports"] == {"composer_ops": [str(root / "composer_ops")],
                                             "migrations": [str(root / "sql")]}, side
    finally:
        for side in made:
            server.drop_database(f"bench_tpl_test_{side}")

    # A process a side's group spawns reads that tree's migration files.
    code = ("import json; from composer_ops.db.migrate import discover; "
            "print(json.dumps([m.filename for m in discover()]))")
    with ProcessGroup("probe", before_tree) as group:
        proc = group.spawn(["-c", code], stdout=-1)
        out, _ = proc.communicate(timeout=60)
    assert MARKER in json.loads(out.decode().splitlines()[-1])
    assert group.imports() == {"composer_ops": [str(before_tree / "composer_ops")],
                               "migrations": [str(before_tree / "sql")]}


@pytest.mark.timeout(900)
def test_ab_runs_each_side_on_its_own_schema(server: Server, before_tree: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ab.json"
    assert ab.main(["--before", str(before_tree), "--rounds", "1", "--runs", "10", "--duration", "1",
                    "--roundtrip-runs", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    got = result["sides"]
    assert MARKER in got["before"]["migrations"] and MARKER not in got["after"]["migrations"]
    for side, root in (("after", ROOT), ("before", before_tree)):
        assert got[side]["tree"] == str(root)
        assert got[side]["processes_imported"] == {"composer_ops": [str(root / "composer_ops")],
                                                   "migrations": [str(root / "sql")]}, side
    assert {r["system"] for r in result["raw"]} == {"after", "before"}
    assert all(r["runs"] == 10 for r in result["raw"] if r["mode"] == "drain")
    for mode, summary in result["modes"].items():        # per round, after over before, in both units
        rows = {r["system"]: r for r in result["raw"] if r["mode"] == mode}
        for key, unit in (("transition_ratios", "transitions_per_s"), ("ratios", "runs_per_s")):
            want = [rows["after"][unit] / rows["before"][unit]] if rows["before"][unit] else []
            assert summary[key] == want, (mode, key)
        assert summary["transitions_after_over_before"] == (summary["transition_ratios"] or [None])[0], mode
    with psycopg.connect(server.admin_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database "
                            "WHERE datname ~ '^bench_(tpl_ab_|after_|before_)'").fetchall()
    assert left == []


@pytest.mark.timeout(900)
def test_aba_runs_each_side_on_its_own_schema(before_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "aba.json"
    assert aba.main(["--rounds", "1", "--duration", "1", "--out", str(out),
                     f"before={before_tree}", f"after={ROOT}"]) == 0
    got = json.loads(out.read_text())["sides"]
    assert MARKER in got["before"]["migrations"] and MARKER not in got["after"]["migrations"]
    for side, root in (("after", ROOT), ("before", before_tree)):
        want = {"composer_ops": [str(root / "composer_ops")], "migrations": [str(root / "sql")]}
        assert got[side]["imports"] == want and got[side]["processes_imported"] == want, side


def test_aba_pairs_leave_out_a_round_without_cpu_per_run() -> None:
    """A window in which no run completed has no CPU per run (None): its ratio counts, its
    CPU difference does not."""
    rows = [{"round": 0, "side": "a", "runs_per_s": 10.0, "cpu_ms_per_run": 5.0},
            {"round": 0, "side": "b", "runs_per_s": 5.0, "cpu_ms_per_run": 4.0},
            {"round": 1, "side": "a", "runs_per_s": 0.0, "cpu_ms_per_run": None},
            {"round": 1, "side": "b", "runs_per_s": 5.0, "cpu_ms_per_run": 4.0}]
    assert aba.pairs(rows, ["a", "b"]) == {"a/b": {"median": 1.0, "ratios": [2.0, 0.0],
                                                   "cpu_ms_per_run_diff_median": 1.0}}
