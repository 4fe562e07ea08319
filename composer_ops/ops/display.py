"""What the notebooks show besides charts: tables, units, anomalies, self-checks, key figures.

Tables are interactive offline HTML (itables, DataTables embedded once by :func:`setup`)
with units chosen by column name (``*bytes``, ``*_s``, ``*_at``, ``*run_id*``) and
sorting on the underlying numbers. Every notebook ends with a ``key-figures`` cell
(:func:`show_key_figures`, canonical JSON), left out of the HTML report and compared by
the notebook harness with what the seeded test database must produce
(:mod:`composer_ops.testing.checks`).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import polars as pl

from composer_ops.db.loaders import is_infinite
from composer_ops.lazyimport import held_back, skip_itables_samples

if TYPE_CHECKING:
    from composer_ops.ops._common import ReadFrom

#: The tag of the cell that prints the key figures.
KEY_FIGURES_TAG = "key-figures"
#: Rows shown per page before a table pages (and offers its search box).
PAGE = 15
REPORT_COMMAND = "composer-ops report run_investigation -p run_id "

_STYLE = """<style>
.composer-id{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.92em;user-select:all;
  white-space:nowrap;background:#f3f4f6;padding:0 3px;border-radius:3px}
.composer-copy{border:1px solid #cbd5e1;background:#fff;border-radius:3px;font-size:0.78em;margin-left:4px;
  padding:0 4px;cursor:pointer;color:#334155}
.composer-none{color:#64748b;font-style:italic}
.composer-ok{color:#166534;background:#dcfce7;border-left:4px solid #16a34a;padding:6px 10px;margin:6px 0}
.composer-alert{color:#7f1d1d;background:#fee2e2;border-left:4px solid #dc2626;padding:6px 10px;margin:6px 0}
.composer-warn{color:#713f12;background:#fef9c3;border-left:4px solid #ca8a04;padding:6px 10px;margin:6px 0}
.composer-text{white-space:pre-wrap;word-break:break-word;max-width:60em}
table.dataTable td, table.dataTable th{text-align:left !important}
table.dataTable td.composer-num{text-align:right !important}
</style>"""

_COPY_JS = ("navigator.clipboard&&navigator.clipboard.writeText(this.dataset.cmd).catch(function(){});"
            "return false;")


# -- units -------------------------------------------------------------------------

def iec_bytes(n: float | None) -> str:
    """``73.1 MiB``: bytes in IEC units (powers of 1024), one decimal above bytes."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} B" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def duration(seconds: float | None) -> str:
    """``2 d 4 h``, ``3 h 12 min``, ``12 min 5 s``, ``4.2 s``, ``850 ms``: the two
    largest units; negative durations get a minus sign."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return ""
    sign = "-" if seconds < 0 else ""
    s = abs(float(seconds))
    if math.isinf(s):       # odd data: a time at 'infinity' (ops.anomalies flags it)
        return f"{sign}infinite"
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 60:
        return f"{sign}{s:.1f} s" if s < 10 else f"{sign}{s:.0f} s"
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    rest = int(round(s))
    for i, (name, size) in enumerate(units):
        if rest >= size:
            text = f"{rest // size} {name}"
            if i + 1 < len(units):
                next_name, next_size = units[i + 1]
                extra = (rest % size) // next_size
                if extra:
                    text += f" {extra} {next_name}"
            return sign + text
    raise AssertionError("unreachable")


def utc_text(value: datetime | None, *, seconds: bool = True) -> str:
    """``2025-03-16 12:00:35`` (UTC, whatever the zone of ``value``); ``infinity`` and
    ``-infinity`` for what was read from those (odd data, flagged where it matters)."""
    if value is None:
        return ""
    if is_infinite(value):
        return "infinity" if value.year == datetime.max.year else "-infinity"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def count(n: int | None) -> str:
    """``1,234,567``: a plain count, never ``1.2M``."""
    return "" if n is None else f"{int(n):,}"


# -- run IDs -----------------------------------------------------------------------

def run_id_html(run_id: str | None) -> str:
    """A run ID shown in full, selected whole with one click, with a button that
    copies the command opening it in the run investigation report."""
    if not run_id:
        return ""
    rid = html.escape(run_id)
    cmd = html.escape(REPORT_COMMAND + run_id)
    return (f'<code class="composer-id" title="{cmd}">{rid}</code>'
            f'<button class="composer-copy" title="copy: {cmd}" data-cmd="{cmd}" onclick="{_COPY_JS}">'
            "copy command</button>")


# -- tables ------------------------------------------------------------------------

def _is_run_id(name: str) -> bool:
    return "run_id" in name


def _kind(name: str, dtype: pl.DataType) -> str:
    if _is_run_id(name):
        return "run_id"
    if name.endswith("bytes"):
        return "bytes"
    if name.endswith("_s") and dtype.is_numeric():
        return "seconds"
    if isinstance(dtype, pl.Datetime):
        return "instant"
    if isinstance(dtype, pl.Boolean):
        return "bool"
    if isinstance(dtype, pl.List):
        return "list"
    if dtype.is_integer():
        return "int"
    if dtype.is_float():
        return "float"
    return "text"


def _header(name: str, kind: str) -> str:
    if kind == "seconds":
        return name[:-2]
    if kind == "instant":
        return f"{name} (UTC)"
    return name


def _cell(kind: str, value: Any) -> str:
    if value is None:
        return ""
    if kind == "run_id":
        return run_id_html(str(value))
    if kind == "bytes":
        return iec_bytes(value)
    if kind == "seconds":
        return duration(value)
    if kind == "instant":
        return utc_text(value)
    if kind == "bool":
        return "yes" if value else "<b>no</b>"
    if kind == "list":
        items = list(value)
        if items and all(isinstance(v, str) and len(v) == 36 and v.count("-") == 4 for v in items):
            return "<br>".join(run_id_html(v) for v in items)
        return html.escape(", ".join(str(v) for v in items))
    if kind == "int":
        return count(value)
    if kind == "float":
        return f"{value:,.2f}"
    return f'<span class="composer-text">{html.escape(str(value))}</span>'


def plain(name: str, value: Any) -> str:
    """``value`` of column ``name`` as plain text (for chart tooltips): the same units as the tables."""
    if value is None:
        return ""
    if name.endswith("bytes"):
        return iec_bytes(value)
    if name.endswith("_s") and isinstance(value, int | float):
        return duration(value)
    if isinstance(value, datetime):
        return utc_text(value) + " UTC"
    if isinstance(value, int):
        return count(value)
    return str(value)


def _sort_key(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "instant":
        return value.timestamp()
    return float(value)


_NUMERIC = {"bytes", "seconds", "instant", "int", "float"}


@dataclass(frozen=True)
class HtmlTable:
    """An HTML table for notebooks (``_repr_html_``) and for tests (``.html``, ``.rows``)."""

    html: str
    rows: int

    def _repr_html_(self) -> str:
        return self.html


def table(df: pl.DataFrame, columns: Sequence[str] | None = None, *, empty: str = "none",
          labels: Mapping[str, str] | None = None) -> HtmlTable:
    """``df`` (or its ``columns``) as an interactive HTML table; ``empty`` when it has no rows."""
    data = df.select(columns) if columns is not None else df
    if data.height == 0:
        return HtmlTable(html=f'<p class="composer-none">{html.escape(empty)}</p>', rows=0)
    skip_itables_samples()
    from itables.javascript import to_html_datatable

    kinds = {name: _kind(name, dtype) for name, dtype in data.schema.items()}
    shown: dict[str, list[str]] = {}
    keys: dict[str, list[Any]] = {}
    for name in data.columns:
        kind = kinds[name]
        values = data[name].to_list()
        header = (labels or {}).get(name) or _header(name, kind)
        shown[header] = [_cell(kind, v) for v in values]
        if kind in _NUMERIC:
            keys[f"{header} "] = [_sort_key(kind, v) for v in values]
    visible = list(shown)
    frame = pl.DataFrame({**shown, **keys}, schema={**{h: pl.String for h in shown},
                                                    **{k: pl.Float64 for k in keys}})
    defs: list[dict[str, Any]] = []
    for i, header in enumerate(visible):
        if f"{header} " in keys:
            key_index = len(visible) + list(keys).index(f"{header} ")
            defs.append({"targets": [i], "orderData": [key_index], "className": "composer-num"})
    if keys:
        defs.append({"targets": list(range(len(visible), len(visible) + len(keys))), "visible": False,
                     "searchable": False})
    long = data.height > PAGE
    options: dict[str, Any] = {
        "allow_html": True, "connected": False, "classes": "display compact cell-border",
        "columnDefs": defs, "order": [], "paging": long, "pageLength": PAGE,
        "lengthMenu": [PAGE, 50, 200, 1000], "scrollX": True,
        "autoWidth": False, "showIndex": False, "show_dtypes": False, "display_logo_when_loading": False,
    }
    if not long:
        options["layout"] = {"topStart": None, "topEnd": None, "bottomStart": None, "bottomEnd": None}
    page = to_html_datatable(frame, **options)
    return HtmlTable(html=page, rows=data.height)


def setup() -> None:
    """Load DataTables (embedded, offline) and the report's styles into the notebook."""
    skip_itables_samples()
    from IPython.display import HTML, display
    from itables.javascript import init_notebook_mode

    with held_back("pandas"):     # imported only to reset pandas' HTML output (lazyimport.held_back)
        init_notebook_mode(all_interactive=False, connected=False)
    display(HTML(_STYLE))  # type: ignore[no-untyped-call]
    _one_line_errors()


def _one_line_errors() -> None:
    """In an IPython kernel, show a :class:`~composer_ops.errors.ComposerError` (bad
    input, no database, a run that does not exist) as the CLI does: one line, its
    class and message, without a traceback. The cell still fails, so papermill and
    ``composer-ops report`` still see the error."""
    from IPython import get_ipython

    from composer_ops.errors import ComposerError

    shell = get_ipython()
    if shell is None:
        return

    def one_line(self: Any, etype: type[BaseException], value: BaseException, tb: Any,
                 tb_offset: int | None = None) -> list[str]:
        lines = [f"{etype.__name__}: {value}"]
        self._showtraceback(etype, value, lines)
        return lines

    shell.set_custom_exc((ComposerError,), one_line)


# -- notices -----------------------------------------------------------------------

def notice(text_html: str, *, level: str = "ok") -> HtmlTable:
    """A coloured one-paragraph notice: ``ok`` (green), ``warn`` (yellow), ``alert`` (red)."""
    if level not in {"ok", "warn", "alert"}:
        raise ValueError(f"unknown notice level {level!r}")
    return HtmlTable(html=f'<div class="composer-{level}">{text_html}</div>', rows=0)


#: Replay lag above which a report read from a standby is flagged (yellow): the
#: coordinator's sweeper runs every 0.5 s, so an older picture already shows leases it
#: has handled as expired.
STANDBY_LAG_WARN_S = 5.0


def read_from_notice(source: ReadFrom) -> HtmlTable | None:
    """The header line of a report read from a hot standby (``ops.read_from``): its
    replay lag and the commit time of the last replayed transaction, which is the
    instant the figures describe. None on a primary."""
    if not source.standby:
        return None
    lag = source.replay_lag_s
    last = source.last_replay_at
    when = f"{last:%Y-%m-%d %H:%M:%S} UTC" if last is not None else "none yet"
    receiver = source.wal_receiver or "not running"
    text = (f"<b>Read from a hot standby: replay lag {duration(lag) if lag is not None else 'unknown'}</b> "
            f"(last replayed transaction committed {when}; WAL receiver {html.escape(receiver)}). The figures "
            "are as of the last replayed transaction: a lease the primary's sweeper already handled can still "
            "look expired, and a run started since is not here yet.")
    late = lag is None or lag > STANDBY_LAG_WARN_S or receiver not in ("streaming", "running")
    return notice(text, level="warn" if late else "ok")


def show_read_from(source: ReadFrom) -> None:
    """Show :func:`read_from_notice` when the report reads a hot standby."""
    found = read_from_notice(source)
    if found is not None:
        show(found)


@dataclass(frozen=True, kw_only=True)
class Anomaly:
    """Odd data a report found and shows instead of failing on it."""

    kind: str
    subject: str
    detail: str
    action: str


def anomalies_frame(items: Iterable[Anomaly]) -> pl.DataFrame:
    return pl.DataFrame([(a.kind, a.subject, a.detail, a.action) for a in items], orient="row",
                        schema={"anomaly": pl.String, "where": pl.String, "detail": pl.String, "what to do": pl.String})


def show(*items: Any) -> None:
    """Display each item (tables, notices, figures) in order."""
    from IPython.display import display

    for item in items:
        display(item)  # type: ignore[no-untyped-call]


def show_anomalies(items: Sequence[Anomaly]) -> None:
    """Nothing odd: a green line. Otherwise a red notice and the table of anomalies."""
    if not items:
        show(notice("No anomalies: no odd rows were found in what this report read."))
        return
    kinds = sorted({a.kind for a in items})
    show(notice(f"<b>{len(items)} anomal{'y' if len(items) == 1 else 'ies'}</b> in the data this report read: "
                   + html.escape(", ".join(kinds)) + ". Each is listed with what to do about it.",
                   level="alert"),
         table(anomalies_frame(items)))


def anomaly_figures(items: Sequence[Anomaly]) -> list[str]:
    """The anomalies as sorted ``kind: where`` lines (a key figure)."""
    return sorted(f"{a.kind}: {a.subject}" for a in items)


# -- self-checks -------------------------------------------------------------------

@dataclass
class SelfChecks:
    """Invariants a report verifies on what it computed. A failed one is shown with
    the figure that broke it (it means a bug or a corrupted catalog, not odd data);
    it does not stop the report."""

    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool | Callable[[], bool], figure: Any = "") -> bool:
        try:
            passed = bool(ok() if callable(ok) else ok)
            detail = "" if passed else (figure() if callable(figure) else str(figure))
        except Exception as exc:  # a check that cannot even be evaluated has failed
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        self.results.append((name, passed, str(detail)))
        return passed

    @property
    def failed(self) -> list[str]:
        return [name for name, ok, _ in self.results if not ok]

    def show(self) -> HtmlTable:
        bad = [(n, d) for n, ok, d in self.results if not ok]
        if not bad:
            return notice(f"All {len(self.results)} self-checks passed.")
        rows = "".join(f"<li><b>{html.escape(n)}</b>: {html.escape(d)}</li>" for n, d in bad)
        return notice(f"<b>{len(bad)} of {len(self.results)} self-checks FAILED</b> (a bug or a corrupted "
                      f"catalog, not odd data: report it with this page):<ul>{rows}</ul>", level="alert")


# -- key figures -------------------------------------------------------------------

def figures_text(figures: Mapping[str, Any]) -> str:
    """``figures`` as canonical JSON: sorted keys, one item per line, tuples as lists,
    so two equal sets of figures always print the same text."""
    return json.dumps(json.loads(json.dumps(figures, default=str)), indent=1, sort_keys=True)


def show_key_figures(figures: Mapping[str, Any]) -> None:
    """Print the notebook's key figures (see the module docstring)."""
    print(figures_text(figures))
