"""Scheduled reports: execute the notebooks headlessly with papermill and file each
as a self-contained HTML page.

``reports/<notebook>/<UTC timestamp>.html`` (code hidden, plotly.js embedded once) lands
beside the executed ``.ipynb`` and a small ``.json`` summary; ``reports/index.html``
links every report found under the output directory, newest first.

The kernel is always this interpreter (``sys.executable`` with ipykernel), whatever
kernelspecs the user has installed elsewhere, so a fresh venv works. The database
URL reaches the kernel through ``COMPOSER_DATABASE_URL`` in its environment, never
as an injected parameter, so no credentials are written into a report.
"""

from __future__ import annotations

import ast
import contextlib
import html
import importlib.resources
import json
import logging
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from composer_ops.lazyimport import defer_rfc3987_syntax

defer_rfc3987_syntax()  # before papermill/nbformat import jsonschema: -1 s per report command

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from traitlets import default  # noqa: E402

from composer_ops.db import ENV_LOCK_WAIT, ENV_URL, find_url  # noqa: E402
from composer_ops.errors import ComposerError, Invalid, NotFound  # noqa: E402
from composer_ops.kernels import UnixSocketKernelManager  # noqa: E402

#: The package the notebooks ship in (built from notebooks/); COMPOSER_NOTEBOOKS_DIR overrides it.
NOTEBOOKS_PACKAGE = "composer_ops.notebooks"
ENV_NOTEBOOKS = "COMPOSER_NOTEBOOKS_DIR"
KERNEL_NAME = "python3"
log = logging.getLogger(__name__)
_EXTERNAL_SCRIPT = re.compile(r"<script[^>]*\ssrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.IGNORECASE)


class _ThisPythonKernelSpecManager(KernelSpecManager):
    """Resolves ``python3`` to ipykernel running on this very interpreter."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        if kernel_name in {KERNEL_NAME, "python"}:
            from ipykernel.kernelspec import RESOURCES, get_kernel_dict

            spec_dict = get_kernel_dict()
            # Only errors on the kernel's stderr: its start-up warnings are noise in a cron mail.
            spec_dict["argv"] = [*spec_dict["argv"], "--IPKernelApp.log_level=ERROR"]
            spec: KernelSpec = self.kernel_spec_class(resource_dir=RESOURCES, **spec_dict)
            return spec
        return super().get_kernel_spec(kernel_name)


#: The file a report's kernel writes its stderr to (set by :func:`_run_one`): a kernel
#: interrupted at a cell timeout, or stopped while a cell still runs, prints tracebacks of
#: its own sockets there, which are not the report's news (``--debug`` logs them).
ENV_KERNEL_STDERR = "COMPOSER_REPORT_KERNEL_STDERR"


class ThisPythonKernelManager(UnixSocketKernelManager, AsyncKernelManager):
    """Kernel manager papermill uses: the kernel is ``sys.executable -m ipykernel_launcher``,
    on Unix sockets (:mod:`composer_ops.kernels`), its stderr in the file
    ``COMPOSER_REPORT_KERNEL_STDERR`` names when it is set."""

    @default("kernel_spec_manager")
    def _this_python_spec_manager(self) -> KernelSpecManager:
        return _ThisPythonKernelSpecManager(data_dir=self.data_dir)

    async def start_kernel(self, **kw: Any) -> None:  # type: ignore[override]
        path = os.environ.get(ENV_KERNEL_STDERR)
        if not path or "stderr" in kw:
            await super().start_kernel(**kw)
            return
        with open(path, "ab") as sink:      # the kernel gets its own descriptor of it
            await super().start_kernel(**kw, stderr=sink)


@dataclass(frozen=True, kw_only=True)
class Parameter:
    name: str
    default: str
    help: str


@dataclass(frozen=True, kw_only=True)
class ReportResult:
    notebook: str
    ok: bool
    html: Path | None
    ipynb: Path
    seconds: float
    parameters: dict[str, Any] = field(default_factory=dict)
    failed_cell: int | None = None
    execution_count: int | None = None
    cell_source: str | None = None
    error: str | None = None

    def describe_failure(self) -> str:
        """One line naming the failing cell (index in the executed notebook, its In [n]
        and first line of code), for the CLI."""
        if self.failed_cell is None:
            where = "execution"
        else:
            where = f"cell {self.failed_cell}"
            if self.execution_count:
                where += f" (In [{self.execution_count}])"
            if self.cell_source:
                where += f" `{self.cell_source}`"
        return f"report {self.notebook} failed at {where}: {self.error}; see {self.html or self.ipynb}"


def notebooks_dir() -> Path:
    override = os.environ.get(ENV_NOTEBOOKS)
    if override:
        return Path(override).expanduser().resolve()
    shipped = importlib.resources.files(NOTEBOOKS_PACKAGE)
    if not isinstance(shipped, Path):      # papermill reads notebooks from files
        raise ComposerError(f"the shipped notebooks are not files on disk ({shipped}); set {ENV_NOTEBOOKS}")
    return shipped


def available(directory: Path | None = None) -> list[str]:
    """The report names: every notebook in the notebooks directory."""
    base = directory or notebooks_dir()
    if not base.is_dir():
        raise ComposerError(f"notebooks directory {base} does not exist (set {ENV_NOTEBOOKS})")
    return sorted(p.stem for p in base.glob("*.ipynb") if not p.name.startswith("."))


def notebook_path(name: str, directory: Path | None = None) -> Path:
    names = available(directory)
    if name not in names:
        raise NotFound(f"unknown report {name!r}; available: {', '.join(names) or '(none)'}")
    return (directory or notebooks_dir()) / f"{name}.ipynb"


def declared_parameters(name: str, directory: Path | None = None) -> dict[str, Parameter]:
    """The parameters the notebook's ``parameters`` cell declares, with their defaults."""
    import papermill

    found = papermill.inspect_notebook(str(notebook_path(name, directory)))
    return {k: Parameter(name=k, default=str(v.get("default", "None")), help=str(v.get("help", "")))
            for k, v in found.items()}


def convert_value(param: Parameter, text: str, notebook: str, kind: str = "report") -> Any:
    """Turn ``-p KEY VALUE`` text into the type of the parameter's default value (a
    number where the notebook's check takes any number, whatever its default's type)."""
    from composer_ops.ops.params import takes_number

    try:
        default_value = ast.literal_eval(param.default)
    except (ValueError, SyntaxError):
        default_value = None
    if isinstance(default_value, int) and not isinstance(default_value, bool) and takes_number(notebook, param.name):
        default_value = float(default_value)
    if isinstance(default_value, bool):
        lowered = text.strip().lower()
        if lowered in {"true", "1", "yes", "on"}:
            return True
        if lowered in {"false", "0", "no", "off"}:
            return False
        raise Invalid(f"-p {param.name}: {text!r} is not a boolean (true/false) for {kind} {notebook}")
    if isinstance(default_value, int):
        try:
            return int(text)
        except ValueError:
            raise Invalid(f"-p {param.name}: {text!r} is not an integer for {kind} {notebook}") from None
    if isinstance(default_value, float):
        try:
            return float(text)
        except ValueError:
            raise Invalid(f"-p {param.name}: {text!r} is not a number for {kind} {notebook}") from None
    if isinstance(default_value, str):
        return text
    if text in {"None", "null"}:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:
        raise Invalid(f"-p {param.name}: the value nests too deeply for {kind} {notebook}") from None


def resolve_parameters(names: Sequence[str], pairs: Sequence[tuple[str, str]],
                       directory: Path | None = None, kind: str = "report") -> dict[str, dict[str, Any]]:
    """Per notebook, the parameters to inject. A key no selected notebook declares,
    or a value of the wrong type, is :class:`Invalid` (nothing runs)."""
    declared = {n: declared_parameters(n, directory) for n in names}
    out: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, text in pairs:
        targets = [n for n in names if key in declared[n]]
        if not targets:
            known = sorted({k for d in declared.values() for k in d})
            shown = key if key.isidentifier() else json.dumps(key)   # odd keys escaped onto one line
            raise Invalid(f"-p {shown}: no selected {kind} declares it; parameters: {', '.join(known)}")
        for n in targets:
            out[n][key] = convert_value(declared[n][key], text, n, kind)
    return out


def check_parameters(parameters: Mapping[str, Mapping[str, Any]], kind: str = "report"
                     ) -> dict[str, dict[str, Any]]:
    """Check the values given for each notebook (:class:`Invalid` names the first bad
    one as ``-p KEY``): the same checks the notebooks run, before any kernel starts.
    Returns the parameters to inject: as given, but a directory made absolute (the
    kernel runs in the notebooks' folder, not the caller's)."""
    from composer_ops.ops.params import absolute_paths
    from composer_ops.ops.params import check_parameters as check

    for name, values in parameters.items():
        try:
            check(name, **values)
        except Invalid as exc:
            raise Invalid(f"-p {exc} ({kind} {name}); nothing was run") from None
    return {name: absolute_paths(name, values) for name, values in parameters.items()}


def timestamp(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def _free_stem(folder: Path, stamp: str) -> str:
    stem, n = stamp, 1
    while (folder / f"{stem}.ipynb").exists() or (folder / f"{stem}.html").exists():
        n += 1
        stem = f"{stamp}-{n}"
    return stem


@contextlib.contextmanager
def _kernel_env(database_url: str | None, more: Mapping[str, str] | None = None) -> Iterator[None]:
    """Set COMPOSER_DATABASE_URL (and ``more``) for the kernels started inside the block, then restore them."""
    values = {**({ENV_URL: database_url} if database_url else {}), **(more or {})}
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_reports(names: Sequence[str], parameters: Mapping[str, Mapping[str, Any]], out_dir: Path, *,
                database_url: str | None = None, progress: bool = True, cell_timeout_s: int = 600,
                jobs: int = 1, now: datetime | None = None, directory: Path | None = None,
                keep: int = 0, kernel_env: Mapping[str, str] | None = None, record_env: str | None = None,
                index_dir: Path | None = None, lock_wait_s: float | None = None) -> list[ReportResult]:
    """Execute each notebook (``jobs`` at a time, each in its own kernel), render its
    HTML, prune each notebook's reports to the newest ``keep`` (0: keep all), then
    rewrite the index. A failing notebook does not stop the others; see each
    result's ``ok``. With ``jobs`` > 1 the notebooks run in worker processes, without
    progress bars. ``kernel_env`` is added to the kernels' environment, and the
    variable ``record_env`` names the executed notebook's path there (a runbook's
    audit rows name it); the index is written in ``index_dir`` (default ``out_dir``).
    Kernels get a private runtime directory (connection files and sockets) and, when
    the home directory is not writable (a system account), a private IPython
    directory, both removed at the end. ``lock_wait_s``: how long the notebooks' reads
    wait for a lock held elsewhere (``COMPOSER_LOCK_WAIT`` in their environment;
    :func:`composer_ops.ops._common.read_lock_wait_s`)."""
    if jobs < 1:
        raise Invalid(f"jobs must be 1 or more, got {jobs}")
    if keep < 0:
        raise Invalid(f"keep must be 0 (keep all) or more, got {keep}")
    # Find the database once, here (a running one: reports only read): a kernel would
    # resolve a relative COMPOSER_HOME against its own working directory.
    url = find_url(database_url)
    stamp = timestamp(now)

    def one(name: str) -> ReportResult:
        return _run_one(name, dict(parameters.get(name, {})), out_dir, stamp, progress=progress,
                        cell_timeout_s=cell_timeout_s, directory=directory, record_env=record_env)

    if lock_wait_s is not None:
        kernel_env = {**(kernel_env or {}), ENV_LOCK_WAIT: repr(float(lock_wait_s))}
    with _kernel_env(url, kernel_env), _private_jupyter_dirs():
        if jobs == 1 or len(names) == 1:
            results = [one(name) for name in names]
        else:
            # Worker processes, not threads: papermill's event loops and CPython 3.11's
            # parser are not safe to share between threads.
            args = [(n, dict(parameters.get(n, {})), out_dir, stamp, cell_timeout_s, directory, record_env)
                    for n in names]
            try:
                with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                    results = list(pool.map(_run_quietly, args))
            except BrokenProcessPool as exc:
                raise ComposerError(f"a report worker process died ({exc}); run again with --jobs 1") from exc
    if keep:
        for name in names:
            prune(out_dir / name, keep)
    write_index(index_dir or out_dir)
    return results


def prune(folder: Path, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` reports (``.html``, ``.ipynb``, ``.json`` of
    one stem) in a notebook's report folder; returns the stems removed. Stems are UTC
    timestamps, so their order is their age."""
    if keep < 1:
        raise Invalid(f"keep must be 1 or more, got {keep}")
    stems = sorted({p.stem for p in folder.glob("*") if p.suffix in {".html", ".ipynb", ".json"}}, reverse=True)
    removed = stems[keep:]
    for stem in removed:
        for suffix in (".html", ".ipynb", ".json"):
            (folder / f"{stem}{suffix}").unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def _private_jupyter_dirs() -> Iterator[None]:
    """``JUPYTER_RUNTIME_DIR`` (kernel connection files, sockets) in a fresh private
    temporary directory, and ``IPYTHONDIR`` too when the home directory cannot be
    written: a report run by a system account (systemd ``User=``) or with a read-only
    home then works instead of failing in Jupyter's start-up. Variables the caller
    set are kept."""
    saved = {k: os.environ.get(k) for k in ("JUPYTER_RUNTIME_DIR", "IPYTHONDIR")}
    with tempfile.TemporaryDirectory(prefix="composer-report-") as private:
        os.chmod(private, 0o700)
        if not saved["JUPYTER_RUNTIME_DIR"]:
            os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(private, "runtime")
        if not saved["IPYTHONDIR"] and not _writable_home():
            os.environ["IPYTHONDIR"] = os.path.join(private, "ipython")
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _writable_home() -> bool:
    home = Path(os.path.expanduser("~"))
    probe = home / ".ipython"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        return os.access(probe, os.W_OK)
    except OSError:
        return False


def _run_quietly(args: tuple[str, dict[str, Any], Path, str, int, Path | None, str | None]) -> ReportResult:
    name, params, out_dir, stamp, cell_timeout_s, directory, record_env = args
    return _run_one(name, params, out_dir, stamp, progress=False, cell_timeout_s=cell_timeout_s, directory=directory,
                    record_env=record_env)


def _run_one(name: str, params: dict[str, Any], out_dir: Path, stamp: str, *, progress: bool,
             cell_timeout_s: int, directory: Path | None, record_env: str | None = None) -> ReportResult:
    import papermill
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    source = notebook_path(name, directory)
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    stem = _free_stem(folder, stamp)
    ipynb, page = folder / f"{stem}.ipynb", folder / f"{stem}.html"
    started = time.monotonic()
    failure: dict[str, Any] = {}
    timed_out = f"CellTimeoutError: the cell ran longer than {cell_timeout_s} s (--timeout) and was interrupted"
    with tempfile.NamedTemporaryFile(prefix="composer-kernel-", suffix=".log") as kernel_log:
        more = {ENV_KERNEL_STDERR: kernel_log.name, **({record_env: str(ipynb)} if record_env else {})}
        try:
            with _kernel_env(None, more), _quiet_papermill():
                # At a cell's timeout the kernel is interrupted (a query waiting for a lock is
                # cancelled) and the cell fails, named like any failing cell: not stopped
                # mid-cell, which leaves the failure unplaced and the kernel's sockets noisy.
                papermill.execute_notebook(
                    str(source), str(ipynb), parameters=params, kernel_name=KERNEL_NAME, progress_bar=progress,
                    cwd=str(source.parent), execution_timeout=cell_timeout_s,
                    kernel_manager_class=ThisPythonKernelManager, interrupt_on_timeout=True,
                    error_on_timeout={"ename": "CellTimeoutError", "evalue": timed_out, "traceback": [timed_out]},
                )
            # A kernel that did not answer the interrupt in time leaves the cell failed, without
            # an error output (papermill then raises nothing), or nbclient raises a timeout.
            failure = _timed_out(ipynb, timed_out, known=False)
        except PapermillExecutionError as exc:
            if exc.ename == "KeyboardInterrupt":    # the one a headless report gets is the timeout's
                failure = _timed_out(ipynb, timed_out, known=True)
            else:
                failure = {"failed_cell": exc.cell_index, "execution_count": exc.exec_count,
                           "cell_source": _first_code_line(exc.source),
                           "error": f"{exc.ename}: {_first_line(exc.evalue)}"}
        except CellTimeoutError:
            failure = _timed_out(ipynb, timed_out, known=True)
        except Exception as exc:  # kernel died, could not start: still a failed report
            failure = {"error": f"{type(exc).__name__}: {_first_line(str(exc))}"}
        said = Path(kernel_log.name).read_text(encoding="utf-8", errors="replace").strip()
        if said:
            log.debug("report %s: the kernel's stderr:\n%s", name, said)
    seconds = time.monotonic() - started
    rendered: Path | None = None
    if ipynb.exists():
        render_html(ipynb, page, title=f"{name} {stem}")
        rendered = page
    result = ReportResult(notebook=name, ok=not failure, html=rendered, ipynb=ipynb, seconds=seconds,
                          parameters=params, **failure)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
    summary["created_at"] = stamp
    summary["key_figures"] = key_figures(ipynb) if ipynb.exists() else None
    (folder / f"{stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    return result


@contextlib.contextmanager
def _quiet_papermill() -> Iterator[None]:
    """papermill's own log (each timeout it meets, each kernel interrupt) off for the
    block: the report's one line says what failed. ``--debug`` keeps it."""
    logger = logging.getLogger("papermill")
    before = logger.level
    if not log.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(before)


def _timed_out(ipynb: Path, error: str, *, known: bool) -> dict[str, Any]:
    """The failure of the cell that timed out, with ``error`` as its one error output in
    the executed notebook (in place of the interrupt's KeyboardInterrupt), so the page
    says why. The cell is the one papermill marked failed; when ``known`` (the execution
    raised a timeout), else the last cell it started. Nothing when neither is found and
    not ``known``."""
    import nbformat

    if not ipynb.exists():
        return {"error": error} if known else {}
    nb = nbformat.read(str(ipynb), as_version=4)  # type: ignore[no-untyped-call]
    marks = [cell.get("metadata", {}).get("papermill", {}) for cell in nb.cells]
    failed = [i for i, m in enumerate(marks) if m.get("status") == "failed"]
    started = [i for i, m in enumerate(marks) if m.get("start_time")]
    index = failed[0] if failed else (started[-1] if known and started else None)
    if index is None:
        return {"error": error} if known else {}
    cell = nb.cells[index]
    ename, _, evalue = error.partition(": ")
    cell.outputs = [o for o in cell.get("outputs", []) if not (
        o.get("output_type") == "error" and o.get("ename") in ("KeyboardInterrupt", ename))]
    cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue,  # type: ignore[no-untyped-call]
                                               traceback=[error]))
    nbformat.write(nb, str(ipynb))  # type: ignore[no-untyped-call]
    return {"failed_cell": index, "execution_count": cell.get("execution_count"),
            "cell_source": _first_code_line(cell.get("source", "")), "error": error}


def _first_code_line(source: str) -> str:
    """The first line of a cell that is not blank, a comment or an import (shortened)."""
    lines = [ln.strip() for ln in str(source).splitlines()]
    useful = [ln for ln in lines if ln and not ln.startswith(("#", "import ", "from "))] or [ln for ln in lines if ln]
    text = useful[0] if useful else ""
    return text if len(text) <= 72 else text[:69] + "..."


def _first_line(text: str) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def render_html(ipynb: Path, page: Path, *, title: str) -> Path:
    """A self-contained HTML page of an executed notebook: outputs only, no code;
    plotly figures drawn by plotly.js embedded once in the page."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(ipynb), as_version=4)  # type: ignore[no-untyped-call]
    figures = _plotly_outputs_as_html(nb)
    from composer_ops.ops.display import KEY_FIGURES_TAG

    # The key-figures cell is for the notebook harness (and the .ipynb), not for the reader.
    nb.cells = [c for c in nb.cells if KEY_FIGURES_TAG not in c.get("metadata", {}).get("tags", [])]
    exporter = HTMLExporter(  # type: ignore[no-untyped-call]
        exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    # The CDN scripts nbconvert adds (require.js, MathJax) are not needed and would make
    # the page depend on the network.
    body = _EXTERNAL_SCRIPT.sub("", body)
    if figures:
        body = body.replace("</head>", _plotly_js() + "</head>", 1)
    page.write_text(body, encoding="utf-8")
    return page


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _plotly_outputs_as_html(nb: Any) -> int:
    """Give every plotly JSON output (what ``fig.show()`` emits under
    :func:`composer_ops.ops.charts.setup`) an HTML form nbconvert can place: a div
    and the ``Plotly.newPlot`` call that fills it. Returns how many there were."""
    import plotly.io as pio

    count = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            figure = data.get(PLOTLY_MIME)
            if figure is None or "text/html" in data:
                continue
            figure = dict(figure)
            config = figure.pop("config", None)
            data["text/html"] = pio.to_html(figure, config=config, include_plotlyjs=False, full_html=False,
                                            validate=False)
            count += 1
    return count


def _plotly_js() -> str:
    """plotly.js itself, inline (what plotly's own ``notebook`` renderer embeds)."""
    from plotly.offline import get_plotlyjs

    return ('<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: "local"};</script>\n'
            f'<script type="text/javascript">{get_plotlyjs()}</script>\n')


def key_figures(ipynb: Path) -> dict[str, Any] | None:
    """The key figures an executed notebook printed (its cell tagged ``key-figures``),
    or None when it has none or did not get that far."""
    from composer_ops.ops.display import KEY_FIGURES_TAG

    try:
        nb = json.loads(ipynb.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    for cell in nb.get("cells", []):
        if KEY_FIGURES_TAG in cell.get("metadata", {}).get("tags", []):
            text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("name") == "stdout")
            try:
                figures = json.loads(text)
            except json.JSONDecodeError:
                return None
            return figures if isinstance(figures, dict) else None
    return None


def _flags(summary: Mapping[str, Any]) -> str:
    """What the index says beside a report that ran: its anomalies and failed self-checks."""
    figures = summary.get("key_figures") or {}
    out = []
    if figures.get("anomalies"):
        out.append(f"{len(figures['anomalies'])} anomal{'y' if len(figures['anomalies']) == 1 else 'ies'}")
    if figures.get("self_checks_failed"):
        out.append(f"{len(figures['self_checks_failed'])} self-check(s) FAILED")
    return ", ".join(out)


#: The folder under the reports directory where runbook records are kept (``runbooks/<name>/``).
RUNBOOKS_FOLDER = "runbooks"


def _did(summary: Mapping[str, Any]) -> str:
    """What the index says beside a runbook record: what it did, or why it did not act."""
    figures = summary.get("key_figures") or {}
    act = figures.get("act") or {}
    if act.get("refused"):
        return "not acted: " + str(act["refused"])
    if act.get("did"):
        return "did: " + "; ".join(str(d) for d in act["did"])
    return "diagnosed and planned (confirm=False)" if summary.get("ok") else ""


def write_index(out_dir: Path) -> Path:
    """``index.html`` linking every report under ``out_dir``, newest first per notebook,
    then every runbook record under ``out_dir/runbooks`` with what it did."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    books = out_dir / RUNBOOKS_FOLDER
    folders = [(p, p.name, False) for p in sorted(out_dir.iterdir()) if p.is_dir() and p.name != RUNBOOKS_FOLDER]
    if books.is_dir():
        folders += [(p, f"runbook {p.name}", True) for p in sorted(books.iterdir()) if p.is_dir()]
    for folder, heading, runbook in folders:
        rows = []
        for summary_path in sorted(folder.glob("*.json"), reverse=True):
            try:
                summary = json.loads(summary_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            stem = summary_path.stem
            status = "ok" if summary.get("ok") else "FAILED"
            where = folder.relative_to(out_dir).as_posix()
            link = f"{where}/{stem}.html" if (folder / f"{stem}.html").exists() else f"{where}/{stem}.ipynb"
            flags = (_did(summary) if runbook else _flags(summary)) if summary.get("ok") else ""
            detail = html.escape(flags or str(summary.get("error") or ""))
            if summary.get("ok") and detail and not runbook:
                status = "flagged"
            params = html.escape(json.dumps(summary.get("parameters") or {}))
            rows.append(f'<tr class="{status.lower()}"><td><a href="{html.escape(link)}">{html.escape(stem)}</a></td>'
                        f"<td>{status}</td><td>{float(summary.get('seconds') or 0):.1f} s</td>"
                        f"<td><code>{params}</code></td><td>{detail}</td></tr>")
        if rows:
            what = "what it did, or error" if runbook else "error or flags"
            sections.append(f"<h2>{html.escape(heading)}</h2><table><tr><th>{'record' if runbook else 'report'} "
                            f"(UTC)</th><th>status</th><th>took</th><th>parameters</th><th>{what}</th></tr>"
                            f"{''.join(rows)}</table>")
    page = out_dir / "index.html"
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>composer-ops reports</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:4px 10px;"
        "border-bottom:1px solid #ddd;text-align:left}tr.failed td{color:#b00}tr.flagged td{color:#a16207}"
        "</style></head><body>"
        f"<h1>composer-ops reports</h1><p>Generated {timestamp()} (UTC).</p>"
        + ("".join(sections) or "<p>No reports yet: run <code>composer-ops report --all</code>.</p>")
        + "</body></html>\n", encoding="utf-8")
    return page


def python_kernel_argv() -> list[str]:
    """The command line the report kernel runs (for tests and ``--debug`` output)."""
    spec = _ThisPythonKernelSpecManager().get_kernel_spec(KERNEL_NAME)
    return [sys.executable if a in {"python", "python3"} else a for a in spec.argv]
