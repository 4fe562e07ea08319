"""``composer-ops report`` refuses an --out it cannot write (one line, exit 2) before a
kernel starts or the database is asked anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_ops.cli import main


@pytest.mark.parametrize("where", ["file", "proc"])
def test_report_out_that_cannot_be_written_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    plain = tmp_path / "a-file"
    plain.write_text("x")
    out = plain / "reports" if where == "file" else Path("/proc/no-such-dir/reports")
    assert main(["report", "partition_sizes", "--out", str(out), "--progress", "0",
                 "--database-url", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"composer-ops: invalid: --out {out}: cannot write there (")
    assert "write-test" not in err and "Errno" not in err
