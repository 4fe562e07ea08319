"""`composer-ops report`: papermill execution, self-contained HTML, the index, exit
codes, and the kernel being this interpreter whatever kernelspecs exist elsewhere."""

from __future__ import annotations

import json
import re
import socket
import sys
from html import escape
from pathlib import Path

import nbformat
import pytest
from traitlets import default

from composer_ops import reports
from composer_ops.cli import main
from composer_ops.ops.display import figures_text
from composer_ops.testing import fixtures
from tests.notebooks.harness import seed_committed

NOWHERE = "postgresql://nobody@/nowhere?host=/nonexistent"
NAMES = ["active_tasks", "lease_expiries", "partition_sizes", "retention_dry_run", "run_investigation"]


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
        assert "plotly.js v" not in executed_text and len(executed_text) < 1_000_000, name
        figures = [o for c in nbformat.reads(executed_text, as_version=4).cells if c.cell_type == "code"  # type: ignore[no-untyped-call]
                   for o in c.outputs if reports.PLOTLY_MIME in o.get("data", {})]
        assert figures and html.count('class="plotly-graph-div"') == len(figures), name
        assert not re.search(r"<script[^>]*\ssrc=\"https?://", html), f"{name}: depends on the network"
        assert "ops.snapshot(" not in html and "import polars" not in html, f"{name}: code cells are shown"
        assert db_url not in html and db_url not in page.with_suffix(".ipynb").read_text(encoding="utf-8")
        summary = json.loads(page.with_suffix(".json").read_text(encoding="utf-8"))
        assert summary["ok"] is True
        executed = nbformat.read(str(page.with_suffix(".ipynb")), as_version=4)  # type: ignore[no-untyped-call]
        assert not executed.metadata.papermill.exception
        assert all(c.outputs is not None for c in executed.cells if c.cell_type == "code")
        # The figures the report computed are the seed's (as the retention cut-off asked for).
        (key,) = [c for c in executed.cells if "key-figures" in c.metadata.get("tags", [])]
        assert key.outputs[0]["text"] == figures_text(expected[name]) + "\n", name
        # ... and that cell is left out of the page.
        assert escape(figures_text(expected[name]).splitlines()[1]) not in html, name
    # The plan the retention report shows is the one -p cutoff asked for.
    plan_page = next((out / "retention_dry_run").glob("*.html")).read_text(encoding="utf-8")
    assert "2025-05-01 00:00:00 UTC" in plan_page
    assert f"index: {out / 'index.html'}" in printed.out


def test_a_bad_parameter_fails_the_report_naming_the_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The database is unreachable: the run ID must be refused before any query.
    out = tmp_path / "reports"
    code = main(["report", "run_investigation", "-p", "run_id", "not-a-uuid", "--database-url", NOWHERE,
                 "--out", str(out), "--progress", "0"])
    err = capsys.readouterr().err
    assert code == 1
    line = next(ln for ln in err.splitlines() if ln.startswith("composer-ops: report run_investigation failed"))
    assert re.search(r"failed at cell \d+ \(In \[\d+\]\) `chosen = ops.validate_run_id\(run_id\)", line), line
    assert "Invalid: run_id 'not-a-uuid' is not a UUID" in line and "Unavailable" not in err
    page = next((out / "run_investigation").glob("*.html"))
    assert "not a UUID" in page.read_text(encoding="utf-8")
    assert "FAILED" in (out / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(("argv", "message"), [
    (["report", "no_such_report"], "unknown report 'no_such_report'"),
    (["report", "--all", "-p", "no_such_key", "1"], "-p no_such_key: no selected report declares it"),
    (["report", "active_tasks", "-p", "top_n", "many"], "-p top_n: 'many' is not an integer"),
    (["report", "partition_sizes", "-p", "exact_rows", "maybe"], "is not a boolean"),
    (["report", "active_tasks", "--all"], "not both"),
    (["report"], "give a report name or --all"),
    (["report", "active_tasks", "-p", "top_n"], "expected 2 arguments"),
    (["report", "active_tasks", "--jobs", "0"], "must be at least 1"),
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
    # "Kernel died before replying to kernel_info". The race is forced here: every port
    # jupyter_client hands out is one this test holds. The tcp case shows the forcing
    # works (and so that this test can fail); report kernels use Unix sockets instead.
    from jupyter_client.connect import LocalPortCache

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    monkeypatch.setattr(LocalPortCache, "find_available_port", lambda self, ip: taken)
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
