"""The CLI's shared option plumbing (composer_ops.cli._common): a range declared with an
option is checked before the command runs, every command is registered with its
function and says whether it only reads, and no database is needed for any of it."""

from __future__ import annotations

import argparse

import pytest

from composer_ops.cli import build_parser, main

NOWHERE = "postgresql:///nodb?host=/nonexistent-composer-test"


@pytest.mark.parametrize(("args", "message"), [
    (["coordinator", "--months-ahead", "-1"], "--months-ahead must be 0 or more, got -1"),
    (["partitions", "ensure", "--months-ahead", "-2"], "--months-ahead must be 0 or more, got -2"),
    (["coordinator", "--webhook-keep-days", "nan"], "--webhook-keep-days must be 0 or more, got nan"),
    (["coordinator", "--event-lock-wait", "0"], "--event-lock-wait must be more than 0, got 0.0"),
    (["cancel", "0190f0c0-0000-7000-8000-000000000000", "--lock-wait", "inf"],
     "--lock-wait must be a finite number of seconds above 0, got inf"),
    (["simulate", "--duration-s", "0"], "--duration-s must be more than 0 and at most 86400, got 0.0"),
    (["simulate", "--growth", "-0.75"], "--growth must be between -0.5 and 1, got -0.75"),
    (["simulate", "--cancel-rate", "1"], "--cancel-rate must be a fraction in [0, 1), got 1.0"),
    (["simulate", "--runs-per-month", "0"], "--runs-per-month must be between 1 and 10000000, got 0"),
    (["partitions", "drop", "--older-than", "90d", "--attempts", "0"], "--attempts must be 1 or more, got 0"),
    (["partitions", "detach", "--older-than", "90d", "--lock-timeout", "nan"],
     "--lock-timeout must be more than 0, got nan"),
    (["partitions", "restore", "202501", "--from", "/tmp", "--lock-timeout", "0"],
     "--lock-timeout must be more than 0, got 0.0"),
])
def test_a_value_out_of_range_is_one_line_and_exit_2_before_connecting(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*args, "--database-url", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert err == f"composer-ops: invalid: {message}\n"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), *, leaves_only: bool = True,
              ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command below ``parser`` by its words (only those without subcommands, or all)."""
    found: list[tuple[tuple[str, ...], argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                below = _commands(sub, (*path, name), leaves_only=leaves_only)
                found += below if below and leaves_only else [((*path, name), sub), *below]
    return found


def test_every_command_runs_a_function_and_says_whether_it_only_reads() -> None:
    commands = _commands(build_parser())
    assert len(commands) >= 25
    parents = {path: parser for path, parser in _commands(build_parser(), leaves_only=False)}
    for path, parser in commands:
        # `db up|url|stop` share one function, set on `db`
        func, reads = (parser.get_default(name) if path[0] != "db" else parents[("db",)].get_default(name)
                       for name in ("func", "reads_only"))
        assert callable(func), path
        assert isinstance(reads, bool), path
        database = next((a for a in parser._actions if "--database-url" in a.option_strings), None)
        if database is not None:
            assert ("must be running" in (database.help or "")) == reads, path


def test_the_environment_default_is_checked_like_the_option(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COMPOSER_SIM_WORKERS", "0")
    assert main(["simulate", "--database-url", NOWHERE]) == 2
    assert capsys.readouterr().err == "composer-ops: invalid: --workers must be between 1 and 32, got 0\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus"], "composer-ops: error: unrecognized arguments: --bogus"),
    ([], "composer-ops: error: the following arguments are required: command"),
    (["--debug", "check", "--nope"], "composer-ops: error: unrecognized arguments: --nope"),
    (["runs", "show"], "composer-ops: error: composer-ops runs show: the following arguments are required: RUN"),
])
def test_the_parsers_errors_name_what_is_wrong_once(args: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err == message + "\n", err


def test_a_bad_argument_is_quoted_back_on_one_line_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse quotes the typed text back; the error line escapes what a terminal would
    act on by the same rule as every line the CLI prints (cli._common.shown), and any line
    break, however spelled, leaves it one line."""
    with pytest.raises(SystemExit) as exited:
        main(["runs", "list", "--database-url", NOWHERE, "\x1b]0;pwned\x07x\u2028y\u202ez"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert not any(c in err for c in "\x1b\x07\u2028\u202e"), err
    assert "\\x1b]0;pwned\\x07x y\\u202ez" in err, err


def test_a_line_on_stderr_quoting_stored_text_escapes_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The refusals, reasons and errors the commands write on stderr themselves (stderr is
    not wrapped: progress bars draw there) go through one helper with the same escapes,
    on one line: stored text cannot add a line that reads as the CLI's own."""
    from composer_ops.cli._common import say

    say("month 202401 not dropped: run \x1b[2J\u202eabc holds it\ncomposer-ops: month 202402 archived")
    assert capsys.readouterr().err == ("composer-ops: month 202401 not dropped: run \\x1b[2J\\u202eabc holds it "
                                       "composer-ops: month 202402 archived\n")
