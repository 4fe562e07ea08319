"""What ``composer_ops`` exports: the types the documented API returns or raises, and a
run ID a client can mint, importable from the top level (not from internal modules)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import composer_ops
from composer_ops.core.runids import validate_run_id


def test_every_public_name_is_importable_from_the_top_level() -> None:
    for name in composer_ops.__all__:
        assert getattr(composer_ops, name) is not None, name


def test_the_documented_types_are_the_ones_the_engine_uses() -> None:
    from composer_ops import LockTimeout, Outcome, PermissionDenied, RunView, ShutdownTimeout, Transient
    from composer_ops.engine.shell import Outcome as ShellOutcome
    from composer_ops.errors import ComposerError
    from composer_ops.repo.rows import RunView as RowsRunView

    assert Outcome is ShellOutcome and RunView is RowsRunView
    assert issubclass(LockTimeout, Transient)
    assert issubclass(PermissionDenied, ComposerError) and issubclass(ShutdownTimeout, ComposerError)


def test_a_minted_run_id_is_one_a_start_accepts() -> None:
    run_id = composer_ops.new_run_id()
    assert validate_run_id(run_id, datetime.now(UTC)) == run_id
    assert composer_ops.new_run_id() != run_id


def test_the_errors_import_without_loading_the_engine() -> None:
    code = ("import sys, composer_ops; from composer_ops import PermissionDenied, LockTimeout, ShutdownTimeout; "
            "print('composer_ops.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
