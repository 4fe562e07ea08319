"""The deferred ``rfc3987_syntax`` import: reports stop paying for its grammars, and
nothing that checks an ``iri`` format notices (each case in a fresh interpreter, since
the point is what gets imported)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None,
                                reason="rfc3987_syntax is not installed (it comes with JupyterLab, the lab extra)")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


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


def test_nothing_to_do_once_jsonschema_is_imported() -> None:
    assert _run("""
        import jsonschema
        from composer_ops.lazyimport import defer_rfc3987_syntax
        print(defer_rfc3987_syntax())
    """) == "False"


def test_the_report_kernel_imports_neither_the_grammars_nor_the_engine_nor_pandas() -> None:
    printed = _run("""
        import sys
        import polars as pl
        from composer_ops import ops
        from composer_ops.ops import charts
        charts.setup()
        fig = charts.partition_sizes(pl.DataFrame({"month": ["202601"], "total_bytes": [1], "table": ["t"],
            "partition": ["t_p202601"], "rows": [1], "heap_bytes": [1], "index_bytes": [0], "toast_bytes": [0]}))
        import plotly.io as pio
        pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())   # what fig.show() does in a kernel
        print(sorted(m for m in ("lark", "pandas", "composer_ops.engine", "plotly.express") if m in sys.modules))
    """)
    assert printed == "[]"
