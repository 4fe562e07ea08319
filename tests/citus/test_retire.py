"""``partitions drop --archive``, ``partitions restore`` and ``partitions detach`` on
Citus. The first two are the single-server tests, run on a distributed database; detach
is refused there, up front, and changes nothing (composer_ops/engine/retire.py,
CITUS_DETACH_REFUSED says why)."""

from __future__ import annotations

import psycopg
import pytest

from composer_ops.cli import main
from composer_ops.repo import archive
from tests.integration.test_archive import test_archive_drop_restore_gives_back_identical_rows  # noqa: F401
from tests.integration.test_retire import (  # noqa: F401
    DUE,
    _audit,
    _months,
    _seeded,
    test_drop_with_archive_month_by_month,
)


@pytest.mark.parametrize("extra", [[], ["--yes"], ["--yes", "--json"]])
def test_detach_is_refused_before_anything_changes(db_url: str, capsys: pytest.CaptureFixture[str],
                                                   extra: list[str]) -> None:
    _seeded(db_url)
    months, audited = _months(db_url), _audit(db_url)     # the refusal writes no audit row: the same after
    assert set(DUE) <= months
    code = main(["partitions", "detach", "--older-than", "2025-05-01", "--database-url", db_url, *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "not supported on Citus" in err and "partitions drop --archive" in err
    assert _months(db_url) == months and _audit(db_url) == audited
    with psycopg.connect(db_url) as conn:
        assert archive.detached(conn) == []
