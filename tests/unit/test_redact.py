"""Passwords never reach an audit row's command line (composer_ops.cli.admin_cmds.redact)."""

from __future__ import annotations

import pytest

from composer_ops.cli.admin_cmds import redact


@pytest.mark.parametrize(("text", "shown"), [
    ("composer-ops runs cancel --database-url postgresql://ops:s3cret@db:5432/c --yes",
     "composer-ops runs cancel --database-url postgresql://ops:***@db:5432/c --yes"),
    ("composer-ops runs list --database-url 'host=db user=ops password=s3cret dbname=c'",
     "composer-ops runs list --database-url 'host=db user=ops password=*** dbname=c'"),
    ("composer-ops runs list --database-url postgresql://ops@db/c", "composer-ops runs list --database-url "
                                                                   "postgresql://ops@db/c"),
])
def test_passwords_are_replaced(text: str, shown: str) -> None:
    assert redact(text) == shown and ("s3cret" not in redact(text))


@pytest.mark.parametrize("url", ["host=db user=ops password='s3cret words' dbname=c",
                                 "host=db password = 's3cret\\' words' dbname=c",
                                 "postgresql://ops:s3cret@db/c", "postgresql://ops@db/c?password=s3cret&sslmode=require"])
def test_the_audited_command_line_holds_no_password_however_it_is_quoted(url: str) -> None:
    import argparse

    from composer_ops.cli.admin_cmds import actor

    args = argparse.Namespace(argv=["runs", "cancel", "--database-url", url, "--yes"])
    command = actor(args).command
    assert command is not None and "s3cret" not in command and "***" in command, command
