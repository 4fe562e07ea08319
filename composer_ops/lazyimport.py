"""Defer or skip the slow optional imports that every report would otherwise pay for.

``jsonschema`` (imported through ``nbformat``) imports ``rfc3987_syntax`` when it is
installed, which compiles about 40 lark grammars: 1 to 1.5 s in the ``report`` process
and again in each kernel (python-jsonschema/jsonschema#1428).
:func:`defer_rfc3987_syntax` installs a stand-in module that imports the real one on
first use, so ``iri`` formats are still checked, by the same code, if anything checks one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

_NAME = "rfc3987_syntax"


class _Deferred(types.ModuleType):
    """Stand-in for ``rfc3987_syntax`` until something uses it."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(_load_real(), attr)


def _load_real() -> types.ModuleType:
    current = sys.modules.get(_NAME)
    if isinstance(current, _Deferred):
        del sys.modules[_NAME]
    return importlib.import_module(_NAME)


def _is_valid_syntax(*args: Any, **kwargs: Any) -> Any:
    return _load_real().is_valid_syntax(*args, **kwargs)


def defer_rfc3987_syntax() -> bool:
    """Install the stand-in if ``rfc3987_syntax`` is installed and not imported yet
    (and ``jsonschema``, which would have imported it, is not either). Returns whether
    it did. Idempotent."""
    if _NAME in sys.modules or "jsonschema" in sys.modules:
        return False
    if importlib.util.find_spec(_NAME) is None:
        return False
    stub = _Deferred(_NAME, __doc__)
    stub.is_valid_syntax = _is_valid_syntax  # type: ignore[attr-defined]
    sys.modules[_NAME] = stub
    return True


#: itables' sample DataFrames (demo data, never used here); importing them imports pandas.
_ITABLES_SAMPLES = ("itables.sample_dfs", "itables.sample_pandas_dfs", "itables.sample_polars_dfs")


def skip_itables_samples() -> bool:
    """Put empty stand-ins for itables' sample-data modules before itables is imported:
    its ``__init__`` imports them, and they import pandas (about 0.6 s per report
    kernel) only to offer demo tables. Returns whether it did. Idempotent."""
    if "itables" in sys.modules:
        return False
    for name in _ITABLES_SAMPLES:
        sys.modules.setdefault(name, types.ModuleType(name, "not loaded: itables sample data is never used here"))
    return True


@contextlib.contextmanager
def held_back(name: str) -> Iterator[None]:
    """Inside the block, ``import NAME`` raises ImportError, unless NAME is imported
    already; afterwards it imports as usual. For a library that imports an optional
    module, when it can, only to patch it: itables' ``init_notebook_mode`` imports
    pandas to reset its HTML output, which the reports never use (about 80 MB and 0.3 s
    of every report and runbook kernel, measured by bench.notebooks)."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]   # Python's "import of NAME halted"
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]
