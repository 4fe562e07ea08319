"""Reading code finds a running database and never starts one; the engine keeps its
documented fallback to the embedded server."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from composer_ops import ops
from composer_ops.cli import main
from composer_ops.db import ENV_URL, connect, find_url, resolve_url
from composer_ops.db.migrate import status
from composer_ops.errors import Transient, Unavailable
from composer_ops.testing.servers import Server, with_database

RUN_ID = "0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f"


@pytest.fixture
def nothing_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No URL in the environment, and an empty COMPOSER_HOME: no embedded server runs there."""
    monkeypatch.delenv(ENV_URL, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("COMPOSER_HOME", str(home))
    return home


def _says_how_to_fix_it(exc: BaseException) -> None:
    text = str(exc)
    assert "\n" not in text and ENV_URL in text and "composer-ops db up" in text, text


def test_reading_code_with_no_database_fails_clearly_and_starts_nothing(nothing_configured: Path) -> None:
    for read in (find_url, connect, lambda: ops.active_by_group(None), lambda: status(None)):
        with pytest.raises(Unavailable) as caught:
            read()
        assert not isinstance(caught.value, Transient)
        _says_how_to_fix_it(caught.value)
    assert not nothing_configured.exists()                       # no data directory was made


@pytest.mark.parametrize("argv", [["runs", "show", RUN_ID], ["partitions", "list"], ["migrate", "--status"],
                                  ["partitions", "drop", "--older-than", "90d"]])
def test_read_only_commands_with_no_database_fail_in_one_line(argv: list[str], nothing_configured: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("composer-ops: unavailable: no database to read")
    _says_how_to_fix_it(Exception(err.strip()))
    assert not nothing_configured.exists()


def test_report_and_restore_say_and_do_the_same_with_no_database(nothing_configured: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Their help says the embedded server must be running, as for every command that only
    finds a running one; a report with none fails in one line and starts nothing."""
    for argv in (["report", "--help"], ["partitions", "restore", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "which must be running (composer-ops db up)" in text and "started if it is not" not in text, argv
    code = main(["report", "active_tasks", "--out", str(tmp_path / "reports"), "--progress", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("composer-ops: unavailable: no database to read")
    assert not nothing_configured.exists()


def test_an_explicit_url_or_the_variable_wins(nothing_configured: Path, db_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_url(db_url) == db_url == resolve_url(db_url)
    monkeypatch.setenv(ENV_URL, db_url)
    assert find_url() == db_url == resolve_url()
    with connect() as conn:
        name = conn.execute("SELECT current_database()").fetchone()
    assert name == (psycopg.conninfo.conninfo_to_dict(db_url)["dbname"],)
    assert not nothing_configured.exists()


def test_a_running_embedded_server_is_found_without_starting_another(server: Server,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if server.kind != "embedded" or server.data_dir is None:
        pytest.skip(f"the suite's server is {server.kind}, not the embedded one")
    data = server.data_dir
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.setenv("COMPOSER_HOME", str(data.parent))
    url = find_url()
    with psycopg.connect(with_database(url, "postgres")) as conn:
        row = conn.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'").fetchone()
    assert row is not None and Path(row[0]).resolve() == data.resolve()
