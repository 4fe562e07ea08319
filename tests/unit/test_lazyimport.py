"""The deferred ``rfc3987_syntax`` import: reports stop paying for its grammars, and
nothing that checks an ``iri`` format notices; a report kernel imports neither them nor
pandas (each case in a fresh interpreter, since the point is what gets imported)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

needs_rfc3987_syntax = pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None,
                                          reason="rfc3987_syntax is not installed (it comes with JupyterLab, "
                                                 "the lab extra)")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@needs_rfc3987_syntax
def test_jsonschema_imports_without_compiling_the_grammars_and_still_checks_iri() -> None:
    printed = _run("""
        import sys
        from composer_ops.lazyimport import _Deferred, defer_rfc3987_syntax
        assert defer_rfc3987_syntax() is True
        assert defer_rfc3987_syntax() is False                      # idempotent
        import jsonschema, nbformat
        assert isinstance(sys.modules["rfc3987_syntax"], _Deferred)  # not loaded by the import
        assert "lark" not in sys.modules
        v = jsonschema.Draft202012Validator({"format": "iri"}, format_checker=jsonschema.FormatChecker())
        print(v.is_valid("http://example.com/a"), v.is_valid("http://a b"))
        assert not isinstance(sys.modules["rfc3987_syntax"], _Deferred)  # the real one, on first use
        print(v.is_valid("not an iri"))
    """)
    assert printed.splitlines() == ["True False", "False"]


@needs_rfc3987_syntax
def test_nothing_to_do_once_jsonschema_is_imported() -> None:
    assert _run("""
        import jsonschema
        from composer_ops.lazyimport import defer_rfc3987_syntax
        print(defer_rfc3987_syntax())
    """) == "False"


#: A stand-in pandas, first on the path, so that the kernel tests mean the same whether
#: or not pandas is installed (it is not a dependency): importing it is what they catch.
STUB_PANDAS = "class DataFrame:\n    def _repr_html_(self):\n        return ''\nSTUB = True\n"


def _with_stub_pandas(tmp_path: Path, code: str) -> str:
    (tmp_path / "pandas").mkdir()
    (tmp_path / "pandas" / "__init__.py").write_text(STUB_PANDAS)
    return f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + textwrap.dedent(code)


def test_the_report_kernel_imports_neither_the_grammars_nor_the_engine_nor_pandas(tmp_path: Path) -> None:
    """What a report's first cells do (the tables' DataTables set up, a table and a chart
    drawn) imports no pandas: itables' set-up imports it, when it can, only to reset
    pandas' HTML output (about 80 MB and 0.3 s of every kernel, measured by
    bench.notebooks at 10 million task rows)."""
    printed = _run(_with_stub_pandas(tmp_path, """
        import sys
        import polars as pl
        from composer_ops import ops
        from composer_ops.ops import charts
        from composer_ops.ops.display import table
        charts.setup()
        ops.display.setup()
        table(pl.DataFrame({"queue": ["default"], "tasks": [3]}))._repr_html_()
        fig = charts.partition_sizes(pl.DataFrame({"month": ["202601"], "total_bytes": [1], "table": ["t"],
            "partition": ["t_p202601"], "rows": [1], "heap_bytes": [1], "index_bytes": [0], "toast_bytes": [0]}))
        import plotly.io as pio
        pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())   # what fig.show() does in a kernel
        print(sorted(m for m in ("lark", "pandas", "composer_ops.engine", "plotly.express") if m in sys.modules))
    """))
    assert printed.splitlines()[-1] == "[]"       # after the set-up's HTML, printed outside a kernel


def test_pandas_stays_importable_after_the_tables_set_up(tmp_path: Path) -> None:
    """The set-up holds pandas back for itables' call only: a notebook that imports
    pandas afterwards gets it."""
    printed = _run(_with_stub_pandas(tmp_path, """
        import sys
        from composer_ops.ops import display
        display.setup()
        assert "pandas" not in sys.modules
        import pandas
        print(pandas.STUB)
    """))
    assert printed.splitlines()[-1] == "True"


def test_held_back_blocks_inside_the_block_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside (nested too) the import fails; after, and after an exception inside, it
    works; a module imported already is not held back."""
    from composer_ops.lazyimport import held_back

    name = "composer_held_back_probe"
    (tmp_path / f"{name}.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        with held_back(name):
            with pytest.raises(ImportError):
                importlib.import_module(name)
            with held_back(name), pytest.raises(ImportError):
                importlib.import_module(name)
            with pytest.raises(ImportError):             # still held after the inner block
                importlib.import_module(name)
        assert name not in sys.modules
        with pytest.raises(RuntimeError), held_back(name):
            raise RuntimeError("inside")
        assert name not in sys.modules
        module = importlib.import_module(name)
        assert module.VALUE == 7
        with held_back(name):
            assert importlib.import_module(name) is module
        assert sys.modules[name] is module
    finally:
        sys.modules.pop(name, None)
