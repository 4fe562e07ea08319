"""Directories the commands write to, checked before anything is written or run."""

from __future__ import annotations

import tempfile
from pathlib import Path

from composer_ops.errors import Invalid

__all__ = ["check_directory"]


def check_directory(directory: Path, what: str) -> None:
    """``directory`` can be created and written (a file is created in it and removed),
    else :class:`Invalid`: one line naming ``what`` and the path, with the system's
    reason (no temporary file's name)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise Invalid(f"{what} {directory}: cannot write there ({exc.strerror or exc})") from None
