"""CLI plumbing: options that fall back to COMPOSER_* variables, JSON arguments,
one-line errors and exit codes (0 ok, 1 operation failed, 2 bad input)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit code 2."""

    def error(self, message: str) -> Any:
        # argparse quotes the user's text back; keep the error on one line whatever it holds.
        flat = " ".join(message.split("\n"))
        flat = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in flat)
        self.exit(EXIT_BAD_INPUT, f"composer-ops: error: {self.prog}: {flat}\n")


def env_option(parser: argparse.ArgumentParser, *flags: str, env: str, help: str, **kw: Any) -> None:
    """An option whose default comes from environment variable ``env`` (shown in --help)."""
    default = os.environ.get(env, kw.pop("default", None))
    conv = kw.get("type")
    if default is not None and conv is not None and isinstance(default, str):
        try:
            default = conv(default)
        except (TypeError, ValueError):
            sys.stderr.write(f"composer-ops: error: {env}={default!r} is not valid for {flags[0]}\n")
            raise SystemExit(EXIT_BAD_INPUT) from None
    shown = f" [env: {env}]" + (f" (default: {kw['metavar_default']})" if "metavar_default" in kw else "")
    kw.pop("metavar_default", None)
    parser.add_argument(*flags, default=default, help=help + shown, **kw)


def add_database_option(parser: argparse.ArgumentParser, *, reads_only: bool = False) -> None:
    """``--database-url``. A command that only reads uses a running server and never
    starts the embedded one (``composer_ops.db.find_url``)."""
    unset = ("the embedded server under COMPOSER_HOME, which must be running (composer-ops db up)" if reads_only
             else "the embedded server under COMPOSER_HOME, started if it is not running")
    env_option(parser, "--database-url", env="COMPOSER_DATABASE_URL",
               help=f"libpq URL of the database; unset means {unset}")


def json_arg(text: str | None, what: str) -> Any:
    """Parse a JSON command-line argument, naming it and the position of a syntax error."""
    if text is None:
        return None
    from composer_ops.engine.jsonvalues import parse_json_text

    return parse_json_text(text, what)


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str, sort_keys=False) + "\n")
