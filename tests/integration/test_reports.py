"""`composer-ops report`: papermill execution, self-contained HTML, the index, exit
codes, and the kernel being this interpreter whatever kernelspecs exist elsewhere."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from html import escape
from pathlib import Path

import nbformat
import psycopg
import pytest
from traitlets import default

from composer_ops import reports
from composer_ops.cli import main
from composer_ops.ops.display import figures_text
from composer_ops.testing import fixtures
from tests.notebooks.harness import ROOT, as_role, hold_first_kernel_port, seed_committed

NOWHERE = "postgresql://nobody@/nowhere?host=/nonexistent"
NAMES = ["active_tasks", "lease_expiries", "partition_sizes", "retention_dry_run", "run_investigation"]

# Reports run notebooks in kernels and subprocesses, each bounded by its own timeout (up to
# 300 s); the test's timeout is above them, so on a loaded machine they, not it, decide.
pytestmark = pytest.mark.timeout(600)


def test_report_all_writes_html_beside_the_executed_notebook_and_an_index(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    expected = fixtures.expected_figures(info)
    out = tmp_path / "reports"
    code = main(["report", "--all", "--out", str(out), "--database-url", db_url, "--progress", "0", "--jobs", "2",
                 "-p", "cutoff", "2025-05-01"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    index = (out / "index.html").read_text(encoding="utf-8")
    for name in NAMES:
        pages = sorted((out / name).glob("*.html"))
        assert len(pages) == 1, name
        page = pages[0]
        assert re.fullmatch(r"\d{8}T\d{6}Z\.html", page.name)
        assert page.with_suffix(".ipynb").exists() and page.with_suffix(".json").exists()
        assert f'href="{name}/{page.name}"' in index
        html = page.read_text(encoding="utf-8")
        # plotly.js is embedded once in the page, not in the notebook; one newPlot per figure shown.
        assert html.count("* plotly.js v") == 1, name
        executed_text = page.with_suffix(".ipynb").read_text(encoding="utf-8")
        # plotly.js is not in the notebook; DataTables is (about 1 MB, embedded once so the executed
        # notebook's tables work offline in JupyterLab too).
        assert "plotly.js v" not in executed_text and len(executed_text) < 2_000_000, name
        assert html.count("ITables v") >= 1 and html.count('id="itables_') >= 2, name
        figures = [o for c in nbformat.reads(executed_text, as_version=4).cells if c.cell_type == "code"  # type: ignore[no-untyped-call]
                   for o in c.outputs if reports.PLOTLY_MIME in o.get("data", {})]
        assert figures and html.count('class="plotly-graph-div"') == len(figures), name
        assert not re.search(r"<script[^>]*\ssrc=\"https?://", html), f"{name}: depends on the network"
        assert "ops.snapshot(" not in html and "import polars" not in html, f"{name}: code cells are shown"
        assert db_url not in html and db_url not in page.with_suffix(".ipynb").read_text(encoding="utf-8")
        summary = json.loads(page.with_suffix(".json").read_text(encoding="utf-8"))
        assert summary["ok"] is True and summary["key_figures"] == json.loads(figures_text(expected[name]))
        executed = nbformat.read(str(page.with_suffix(".ipynb")), as_version=4)  # type: ignore[no-untyped-call]
        assert not executed.metadata.papermill.exception
        assert all(c.outputs is not None for c in executed.cells if c.cell_type == "code")
        # The figures the report computed are the seed's (as the retention cut-off asked for).
        (key,) = [c for c in executed.cells if "key-figures" in c.metadata.get("tags", [])]
        assert key.outputs[0]["text"] == figures_text(expected[name]) + "\n", name
        # ... and that cell is left out of the page.
        assert escape(figures_text(expected[name]).splitlines()[1]) not in html, name
    # Each report shows the seed's odd data as anomalies, in its HTML.
    text = {name: next((out / name).glob("*.html")).read_text(encoding="utf-8") for name in NAMES}
    for name in ("active_tasks", "lease_expiries"):
        assert "1 anomaly</b>" in text[name] and "RUNNING without a lease" in text[name], name
        assert info.runs["L9"] in text[name]
    for name in ("partition_sizes", "retention_dry_run"):
        assert "3 anomalies</b>" in text[name] and "workflow_runs_p202412" in text[name], name
    assert "task for a node not in its definition" in text["run_investigation"]
    assert "legacy_audit" in text["run_investigation"]
    for name in NAMES:
        assert "self-checks passed" in text[name] and "self-checks FAILED" not in text[name], name
    # A long wait without a timeout is flagged; no active work lacks its definition (fixtures.odd_definitions).
    assert "1 WAIT_FOR_SIGNAL node(s) without a timeout</b>" in text["active_tasks"]
    assert "and every run with an active task has its definition version and its run row." in text["active_tasks"]
    # IEC units and humanised durations, never SI or raw seconds; full run IDs with their command.
    assert re.search(r"\d\.\d KiB", text["partition_sizes"]) and not re.search(r"\d\.\d [kMG]B\b",
                                                                             text["partition_sizes"])
    assert f"composer-ops report run_investigation -p run_id {info.runs['H6']}" in text["active_tasks"]
    # The index flags every report whose data held anomalies (each of the seed's does).
    assert index.count('<tr class="flagged">') == 5 and "3 anomalies" in index and "1 anomaly" in index
    # The plan the retention report shows is the one -p cutoff asked for.
    plan_page = next((out / "retention_dry_run").glob("*.html")).read_text(encoding="utf-8")
    assert "2025-05-01 00:00:00 UTC" in plan_page
    assert f"index: {out / 'index.html'}" in printed.out


def test_a_failing_cell_fails_the_report_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The parameters are fine, the database cannot be read: the one way a report fails.
    out = tmp_path / "reports"
    code = main(["report", "active_tasks", "--database-url", NOWHERE, "--out", str(out), "--progress", "0"])
    err = capsys.readouterr().err
    assert code == 1
    line = next(ln for ln in err.splitlines() if ln.startswith("composer-ops: report active_tasks failed"))
    assert re.search(r"failed at cell \d+ \(In \[\d+\]\) `", line) and ": cannot connect to the database" in line, line
    page = next((out / "active_tasks").glob("*.html"))
    assert "cannot connect to the database" in page.read_text(encoding="utf-8")
    # In the notebook, as on the CLI, the error is one line: its class and message, no traceback.
    executed = nbformat.read(str(page.with_suffix(".ipynb")), as_version=4)  # type: ignore[no-untyped-call]
    (error,) = [o for c in executed.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert len(error.traceback) == 1 and error.traceback[0].startswith(f"{error.ename}: cannot connect"), error
    assert "FAILED" in (out / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(("param", "message"), [
    (["-p", "run_id", "x"], "-p run_id: run_id 'x' is not a UUID: expected 32 hex digits"),
    (["-p", "run_id", "0190b6c8-5a3e-4d2c-9f1e-3b4a5c6d7e8f"], "is a version 4 UUID"),
    (["-p", "top_n", "0"], "-p top_n: must be an integer from 1 to 1000, got 0 (report active_tasks)"),
    (["-p", "cutoff", "yesterday"], "-p cutoff: cut-off 'yesterday' is not an ISO date"),
    (["-p", "requeue_window_s", "-5"], "-p requeue_window_s: must be a number > 0"),
    (["-p", "long_wait_h", "inf"], "-p long_wait_h: must be a finite number of at most 876600 (100 years in hours)"),
    (["-p", "long_wait_h", "1e12"], "-p long_wait_h: must be a finite number"),
    (["-p", "requeue_window_s", "inf"], "-p requeue_window_s: must be a finite number"),
])
def test_a_bad_parameter_value_exits_2_before_any_kernel(param: list[str], message: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    started: list[str] = []
    monkeypatch.setattr(reports, "_run_one", lambda name, *a, **k: started.append(name))
    out = tmp_path / "reports"
    code = main(["report", "--all", *param, "--database-url", NOWHERE, "--out", str(out), "--progress", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "nothing was run" in err, err
    assert started == [] and not out.exists()   # no kernel, no FAILED report, no index


@pytest.mark.parametrize(("argv", "message"), [
    (["report", "no_such_report"], "unknown report 'no_such_report'"),
    (["report", "--all", "-p", "no_such_key", "1"], "-p no_such_key: no selected report declares it"),
    (["report", "active_tasks", "-p", "top_n", "many"], "-p top_n: 'many' is not an integer"),
    (["report", "partition_sizes", "-p", "exact_rows", "maybe"], "is not a boolean"),
    (["report", "active_tasks", "--all"], "not both"),
    (["report"], "give a report name or --all"),
    (["report", "active_tasks", "-p", "top_n"], "expected 2 arguments"),
    (["report", "active_tasks", "--jobs", "0"], "must be at least 1"),
    (["report", "active_tasks", "--lock-wait", "0"], "--lock-wait must be a finite number of seconds above 0"),
    (["report", "active_tasks", "--lock-wait", "inf"], "--lock-wait must be a finite number of seconds above 0"),
])
def test_bad_report_arguments_exit_2_with_one_line(argv: list[str], message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([*argv, "--out", str(tmp_path)])
    except SystemExit as exc:   # argparse's own errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "index.html").exists()


def test_a_run_whose_definition_version_is_missing_renders_flagged(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    code = main(["report", "run_investigation", "-p", "run_id", info.runs["H12"], "--out", str(out),
                 "--database-url", as_role(db_url), "--progress", "0"])
    assert code == 0, capsys.readouterr().err
    page = next((out / "run_investigation").glob("*.html")).read_text(encoding="utf-8")
    assert "definition version missing" in page and "order-fulfilment v3" in page
    assert "none: the definition has no nodes" in page or "the definition has no nodes" in page


def test_keep_prunes_old_reports_of_the_notebooks_run(db_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    seed_committed(db_url)
    out = tmp_path / "reports"
    (out / "lease_expiries").mkdir(parents=True)
    for stamp in ("20250101T000000Z", "20250102T000000Z", "20250103T000000Z"):
        for suffix in (".html", ".ipynb", ".json"):
            (out / "lease_expiries" / f"{stamp}{suffix}").write_text("{}")
    other = out / "active_tasks" / "20250101T000000Z.html"
    other.parent.mkdir()
    other.write_text("old")
    code = main(["report", "lease_expiries", "--keep", "2", "--out", str(out), "--database-url", db_url,
                 "--progress", "0"])
    assert code == 0, capsys.readouterr().err
    left = sorted(p.name for p in (out / "lease_expiries").iterdir())
    assert len(left) == 6 and left[:3] == ["20250103T000000Z.html", "20250103T000000Z.ipynb",
                                           "20250103T000000Z.json"]
    assert other.exists()   # only the notebooks run are pruned
    assert main(["report", "lease_expiries", "--keep", "-1"]) == 2


def test_report_works_for_an_account_whose_home_cannot_be_written(db_url: str, tmp_path: Path) -> None:
    seed_committed(db_url)
    env = {**os.environ, "HOME": "/proc/composer-no-home", "COMPOSER_DATABASE_URL": as_role(db_url)}
    env.pop("JUPYTER_RUNTIME_DIR", None)
    env.pop("IPYTHONDIR", None)
    done = subprocess.run([sys.executable, "-m", "composer_ops", "report", "partition_sizes", "--progress", "0",
                           "--out", str(tmp_path / "r")], env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert next((tmp_path / "r" / "partition_sizes").glob("*.html")).stat().st_size > 0


def test_piping_into_head_ends_quietly(tmp_path: Path) -> None:
    # The reader of stdout is gone before the command prints: a broken pipe is not an error.
    with subprocess.Popen([sys.executable, "-m", "composer_ops", "report", "--list"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0 and err == "", err


def test_the_documented_cron_line_works_as_written_on_a_fresh_machine(db_url: str, tmp_path: Path) -> None:
    # The crontab line of docs/operations.md, run by sh with only the paths and URL swapped:
    # /srv/composer is a fresh directory with a .venv and nothing else.
    seed_committed(db_url)
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    cron = next(ln for ln in doc.splitlines() if ln.startswith("0 6 * * 1 "))
    command = cron.split(None, 5)[5]
    srv = tmp_path / "srv" / "composer"
    srv.mkdir(parents=True)
    (srv / ".venv").symlink_to(Path(sys.prefix))
    command = command.replace("/srv/composer", str(srv)).replace(
        "postgresql://ops_reports@db/composer", as_role(db_url))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "SHELL": "/bin/sh"}
    done = subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    logs = list(srv.rglob("*.log"))
    assert len(logs) == 1 and "retention_dry_run:" in logs[0].read_text(encoding="utf-8")
    assert list(srv.rglob("retention_dry_run/*.html"))


def test_the_documented_systemd_service_runs_as_written(db_url: str, tmp_path: Path) -> None:
    # systemd itself cannot run here: the unit's ExecStart runs with its Environment=, its
    # WorkingDirectory and a User= whose home does not exist (HOME unwritable), paths
    # swapped for a fresh /srv/composer, the EnvironmentFile's URL given directly.
    seed_committed(db_url)
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    unit = doc[doc.index("[Service]"):].split("```", 1)[0]
    keys = dict(ln.split("=", 1) for ln in unit.splitlines() if "=" in ln and not ln.startswith("#"))
    srv = tmp_path / "srv" / "composer"
    srv.mkdir(parents=True)
    (srv / ".venv").symlink_to(Path(sys.prefix))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/proc/composer-home", "COMPOSER_DATABASE_URL": as_role(db_url)}
    for pair in shlex.split(keys["Environment"].replace("/srv/composer", str(srv))):
        name, value = pair.split("=", 1)
        env[name] = value
    argv = shlex.split(keys["ExecStart"].replace("/srv/composer", str(srv)))
    cwd = keys["WorkingDirectory"].replace("/srv/composer", str(srv))
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.stdout + done.stderr)[-3000:]
    assert len(list((srv / "reports" / "retention_dry_run").glob("*.html"))) == 1
    assert env["COMPOSER_REPORT_KEEP"] == "12"


def test_report_list_shows_notebooks_and_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--list"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert f"\n{name}\n" in f"\n{out}"
    assert "-p cutoff (default \"6 months\")" in out and "-p run_id (default None)" in out


def test_the_kernel_is_this_interpreter_whatever_kernelspecs_say(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A user-level "python3" kernelspec pointing at a broken interpreter comes first on the path.
    bogus = tmp_path / "jupyter" / "kernels" / "python3"
    bogus.mkdir(parents=True)
    (bogus / "kernel.json").write_text(json.dumps({"argv": ["/bin/false", "{connection_file}"],
                                                   "display_name": "broken", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    from jupyter_client.kernelspec import KernelSpecManager

    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == "/bin/false"
    books = _write_whoami(tmp_path / "books")
    monkeypatch.setenv(reports.ENV_NOTEBOOKS, str(books))
    params_for = reports.resolve_parameters(["whoami"], [("answer", "42")])
    (result,) = reports.run_reports(["whoami"], params_for, tmp_path / "out", database_url=NOWHERE, progress=False)
    assert result.ok, result.error
    executed = nbformat.read(str(result.ipynb), as_version=4)  # type: ignore[no-untyped-call]
    assert executed.cells[-1].outputs[0]["text"].strip() == f"{sys.executable} 42"
    assert reports.python_kernel_argv()[0] == sys.executable


def _write_whoami(books: Path) -> Path:
    """A one-notebook directory: ``whoami`` prints the kernel's interpreter, its
    ``answer`` parameter and the transport its channels use."""
    books.mkdir()
    nb = nbformat.v4.new_notebook()  # type: ignore[no-untyped-call]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("database_url = None\nanswer = 1")  # type: ignore[no-untyped-call]
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(  # type: ignore[no-untyped-call]
        "from ipykernel.connect import get_connection_info\n"
        "print(get_connection_info(unpack=True)['transport'])"),
        nbformat.v4.new_code_cell("import sys\nprint(sys.executable, answer)")]  # type: ignore[no-untyped-call]
    nbformat.write(nb, str(books / "whoami.ipynb"))  # type: ignore[no-untyped-call]
    return books


class _TcpKernelManager(reports.ThisPythonKernelManager):
    """The report kernel manager as it was: TCP ports chosen by jupyter_client."""

    @default("transport")
    def _tcp(self) -> str:
        return "tcp"


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_port_taken_before_the_kernel_binds_it_cannot_kill_a_report(transport: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # jupyter_client's TCP transport picks free ports, closes them, and the kernel binds
    # them a second later. Another process taking one in between (CI saw it with
    # `report --all --jobs 2`) killed the kernel: "Address already in use", then
    # "Kernel died before replying to kernel_info". The race is forced here: the first
    # port jupyter_client hands out is one this test holds. The tcp case shows the forcing
    # works (and so that this test can fail); report kernels use Unix sockets instead.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    hold_first_kernel_port(monkeypatch, taken)
    if transport == "tcp":
        monkeypatch.setattr(reports, "ThisPythonKernelManager", _TcpKernelManager)
    monkeypatch.setenv(reports.ENV_NOTEBOOKS, str(_write_whoami(tmp_path / "books")))
    try:
        (result,) = reports.run_reports(["whoami"], {}, tmp_path / "out", database_url=NOWHERE, progress=False)
    finally:
        held.close()
    if transport == "tcp":
        assert not result.ok and result.error and "Kernel died" in result.error, result.error
        return
    assert result.ok, result.error
    executed = nbformat.read(str(result.ipynb), as_version=4)  # type: ignore[no-untyped-call]
    assert executed.cells[1].outputs[0]["text"].strip() == "ipc"
    assert reports.ThisPythonKernelManager().transport == "ipc"


def test_one_node_shows_its_table_under_where_the_data_is_and_no_blocked_month_says_none_once(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "reports"
    assert main(["report", "partition_sizes", "retention_dry_run", "--out", str(out), "--database-url", db_url,
                 "--progress", "0"]) == 0, capsys.readouterr().err
    sizes = next((out / "partition_sizes").glob("*.html")).read_text(encoding="utf-8")
    where = sizes[sizes.index("Where the data is"):]
    where = where[:where.index("<h2")] if "<h2" in where else where
    assert 'id="itables_' in where and "local" in where          # the one node's table, under its heading
    plan = next((out / "retention_dry_run").glob("*.html")).read_text(encoding="utf-8")
    assert plan.count("none: no month past the cut-off is kept for active runs") == 1


def test_a_lease_at_infinity_renders_flagged_in_every_report_that_reads_leases(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A lease expiry set to 'infinity' by hand (odd data): each report that reads it renders
    and lists it as an anomaly."""
    info = seed_committed(db_url)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = 'infinity' WHERE run_id = %s", (info.runs["L1"],))
    out = tmp_path / "reports"
    code = main(["report", "active_tasks", "lease_expiries", "run_investigation", "-p", "run_id", info.runs["L1"],
                 "--out", str(out), "--database-url", as_role(db_url), "--progress", "0", "--jobs", "2"])
    assert code == 0, capsys.readouterr().err
    for name in ("active_tasks", "lease_expiries", "run_investigation"):
        page = next((out / name).glob("*.html")).read_text(encoding="utf-8")
        assert "RUNNING with an infinite lease" in page and info.runs["L1"] in page, name
        assert "self-checks passed" in page, name
    # The headline counts L1's infinite lease apart from L9's missing one (its buckets say 1 and 1).
    page = next((out / "lease_expiries").glob("*.html")).read_text(encoding="utf-8")
    assert "1 without a lease, 1 with an infinite lease," in page and "2 without a lease" not in page


def test_a_cell_waiting_on_a_lock_past_the_timeout_fails_in_one_line_naming_it(
        db_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The report's query waits for a lock another session holds on a month: at --timeout the
    kernel is interrupted, and the report fails like any other, one line naming the cell (no
    papermill log, no kernel traceback on stderr), with failed_cell in its summary."""
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    with psycopg.connect(db_url) as holder:
        holder.execute(f"LOCK TABLE workflow_runs_p{info.current_month} IN ACCESS EXCLUSIVE MODE".encode())
        code = main(["report", "retention_dry_run", "-p", "cutoff", "1mo", "--timeout", "3", "--out", str(out),
                     "--database-url", db_url, "--progress", "0"])
        holder.rollback()
    err = capfd.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert re.search(r"failed at cell \d+ \(In \[\d+\]\) `.+`: CellTimeoutError: the cell ran longer than 3 s "
                     r"\(--timeout\) and was interrupted; see ", err), err
    summary = json.loads(next((out / "retention_dry_run").glob("*.json")).read_text(encoding="utf-8"))
    assert summary["ok"] is False and isinstance(summary["failed_cell"], int) and summary["execution_count"]
    assert "CellTimeoutError" in next((out / "retention_dry_run").glob("*.html")).read_text(encoding="utf-8")


def test_a_read_behind_a_lock_gives_up_after_lock_wait_naming_the_holder(
        db_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Within its cell timeout, a read waits --lock-wait for a lock held elsewhere, then the
    report fails in one line naming the session holding it, rather than wait out the cell."""
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    with psycopg.connect(db_url, application_name="dba-repack") as holder:
        holder.execute(f"LOCK TABLE task_instances_p{info.current_month} IN ACCESS EXCLUSIVE MODE".encode())
        code = main(["report", "active_tasks", "--lock-wait", "1", "--timeout", "300", "--out", str(out),
                     "--database-url", db_url, "--progress", "0"])
        pid = holder.info.backend_pid
        holder.rollback()
    err = capfd.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert re.search(r"failed at cell \d+ \(In \[\d+\]\) `.+`: LockTimeout: a read waited 1s for a lock held "
                     rf"elsewhere and gave up \(locks held by pid {pid} \(\w+, dba-repack, idle in transaction, ",
                     err), err


def test_a_cell_deaf_to_the_interrupt_still_fails_naming_it(db_url: str, tmp_path: Path,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    """A cell that ignores the interrupt at its timeout leaves no error output of its own:
    the report fails all the same, naming it, and the page says why."""
    books = tmp_path / "books"
    books.mkdir()
    nb = nbformat.v4.new_notebook()  # type: ignore[no-untyped-call]
    nb.cells = [nbformat.v4.new_code_cell("x = 1"),  # type: ignore[no-untyped-call]
                nbformat.v4.new_code_cell("import signal, time\n"  # type: ignore[no-untyped-call]
                                          "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(books / "deaf.ipynb"))  # type: ignore[no-untyped-call]
    (result,) = reports.run_reports(["deaf"], {}, tmp_path / "out", database_url=db_url, progress=False,
                                    cell_timeout_s=2, directory=books)
    assert not result.ok and result.failed_cell == 1, result
    assert result.cell_source == "signal.signal(signal.SIGINT, signal.SIG_IGN)"
    assert result.error == "CellTimeoutError: the cell ran longer than 2 s (--timeout) and was interrupted"
    assert result.html is not None and "CellTimeoutError" in result.html.read_text(encoding="utf-8")
    assert "Traceback" not in capfd.readouterr().err


def test_a_deleted_run_is_investigated_as_deleted_not_as_live(db_url: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """After `runs delete`, run_investigation says prominently that the run was deleted, when
    and by what (its history row), and does not show its old status as the run's."""
    info = seed_committed(db_url)
    run = info.runs["H4"]         # SUCCEEDED
    assert main(["runs", "delete", run, "--yes", "--database-url", db_url]) == 0
    assert main(["runs", "show", run, "--database-url", db_url]) == 2
    capsys.readouterr()
    out = tmp_path / "reports"
    assert main(["report", "run_investigation", "-p", "run_id", run, "--out", str(out),
                 "--database-url", as_role(db_url), "--progress", "0"]) == 0, capsys.readouterr().err
    page = next((out / "run_investigation").glob("*.html")).read_text(encoding="utf-8")
    assert "This run was deleted</b>, deleted at " in page and "composer-ops runs delete" in page
    assert re.search(r"\(history row \d+; it was SUCCEEDED\)", page)
    assert "<b>DELETED (it was SUCCEEDED)</b>" in page and "<b>SUCCEEDED</b>" not in page
