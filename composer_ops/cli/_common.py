"""CLI plumbing: how a command is registered, the options several commands share
(each defined here once, with its name, help, type and check), options that fall back
to COMPOSER_* variables, JSON arguments, one-line errors and exit codes (0 ok,
1 operation failed, 2 bad input)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any, Literal

from composer_ops.db.connect import ENV_LOCK_WAIT
from composer_ops.errors import Invalid

if TYPE_CHECKING:
    from composer_ops.engine import Engine

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit code 2."""

    def error(self, message: str) -> Any:
        # argparse quotes the user's text back: one line whatever it holds, and nothing a
        # terminal acts on (the rule of everything the CLI prints, shown).
        flat = shown(" ".join(message.splitlines()))
        where = "" if self.prog == "composer-ops" else f"{self.prog}: "
        self.exit(EXIT_BAD_INPUT, f"composer-ops: error: {where}{flat}\n")


@dataclass(frozen=True)
class Accepts:
    """The values a number option accepts, and how its error says so."""

    test: Callable[[Any], bool]
    text: str

    def check(self, flag: str, value: Any) -> None:
        if value is not None and not self.test(value):
            raise Invalid(f"{flag} must be {self.text}, got {value}")


def number_text(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def above(low: float) -> Accepts:
    return Accepts(lambda v: v > low, f"more than {number_text(low)}")


def at_least(low: float) -> Accepts:
    return Accepts(lambda v: v >= low, f"{number_text(low)} or more")


def between(low: float, high: float) -> Accepts:
    return Accepts(lambda v: low <= v <= high, f"between {number_text(low)} and {number_text(high)}")


def above_up_to(low: float, high: float) -> Accepts:
    return Accepts(lambda v: low < v <= high, f"more than {number_text(low)} and at most {number_text(high)}")


#: A share of something: 0 up to, not including, 1.
FRACTION = Accepts(lambda v: 0 <= v < 1, "a fraction in [0, 1)")
#: A lock wait (--lock-wait, COMPOSER_LOCK_WAIT): the rule Engine.connect and the ops'
#: connections (composer_ops.ops._common.read_lock_wait_s) apply too.
LOCK_WAIT = Accepts(lambda v: math.isfinite(v) and v > 0, "a finite number of seconds above 0")


def env_option(parser: argparse._ActionsContainer, *flags: str, env: str, help: str,
               accepts: Accepts | None = None, **kw: Any) -> None:
    """An option whose default comes from environment variable ``env`` (shown in --help).
    With ``accepts``, :func:`check_options` refuses a value outside it (one line, exit 2)."""
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
    choices = kw.get("choices")
    if accepts is None and choices is not None and env in os.environ:
        # argparse checks the choices of a value typed, not of a default: the variable's
        # value is checked when the command runs (check_options), as a typed one would be.
        listed = tuple(choices)
        accepts = Accepts(lambda v: v in listed, f"one of {', '.join(map(str, listed))} (from {env})")
    action = parser.add_argument(*flags, default=default, help=help + shown, **kw)
    if accepts is not None:
        checks = parser.get_default("option_checks") or ()
        parser.set_defaults(option_checks=(*checks, (action.dest, flags[0], accepts)))


def check_options(args: argparse.Namespace) -> None:
    """Refuse (:class:`Invalid`) the first option value outside what its ``accepts`` says,
    or a database URL libpq cannot parse, before the command does anything."""
    for dest, flag, accepts in getattr(args, "option_checks", None) or ():
        accepts.check(flag, getattr(args, dest))
    url = getattr(args, "database_url", None)
    if url:    # bad input (exit 2), not a server that is down (exit 1)
        from composer_ops.db.connect import check_url

        check_url(url, "--database-url (or COMPOSER_DATABASE_URL)")


Database = Literal["reads", "writes"]


def add_command(sub: argparse._SubParsersAction, name: str,  # type: ignore[type-arg]
                func: Callable[[argparse.Namespace], int], *, help: str, database: Database | None = "writes",
                **kw: Any) -> argparse.ArgumentParser:
    """Subcommand ``name`` running ``func(args)``. With ``database``, its first option is
    ``--database-url``: a command that ``"reads"`` only uses a running server and never
    starts the embedded one (:func:`database_url`, :func:`open_engine`); some of them
    change data too (``partitions drop``, ``detach``, ``restore``), on a server that runs."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, **kw)
    if database is not None:
        add_database_option(parser, reads_only=database == "reads")
    parser.set_defaults(func=func, reads_only=database == "reads")
    return parser


def add_database_option(parser: argparse.ArgumentParser, *, reads_only: bool = False) -> None:
    """``--database-url``. A command that only reads uses a running server and never
    starts the embedded one (``composer_ops.db.find_url``)."""
    unset = ("the embedded server under COMPOSER_HOME, which must be running (composer-ops db up)" if reads_only
             else "the embedded server under COMPOSER_HOME, started if it is not running")
    env_option(parser, "--database-url", env="COMPOSER_DATABASE_URL",
               help=f"libpq URL of the database; unset means {unset}")


def database_url(args: argparse.Namespace) -> str | None:
    """The command's database: for a command that only reads, the running server
    :func:`composer_ops.db.find_url` finds (else :class:`Unavailable`); for others the
    --database-url given, if any (the engine starts the embedded server without one)."""
    from composer_ops.db import find_url

    return find_url(args.database_url) if args.reads_only else args.database_url


def add_lock_wait_option(parser: argparse._ActionsContainer) -> None:
    """``--lock-wait``: how long a command acting on runs waits for a run's lock."""
    env_option(parser, "--lock-wait", env=ENV_LOCK_WAIT, type=float, default=30.0, metavar="SECONDS",
               accepts=LOCK_WAIT,
               help="give up (exit 1, naming the session holding it) when a run's lock is not granted "
                    "within this many seconds (default 30)")


def add_read_lock_wait_option(parser: argparse._ActionsContainer) -> None:
    """``--lock-wait`` of ``report`` and ``runbook``: how long a notebook's read waits
    for a lock held elsewhere (:data:`composer_ops.ops._common.READ_LOCK_WAIT_S`)."""
    env_option(parser, "--lock-wait", env=ENV_LOCK_WAIT, type=float, default=30.0, metavar="SECONDS",
               accepts=LOCK_WAIT,
               help="a read that waits longer than this many seconds for a lock held elsewhere (a drop, "
                    "a migration) fails its cell, naming the sessions holding locks (default 30)")


def open_engine(args: argparse.Namespace, *, pool_size: int = 1) -> Engine:
    """The engine of one command, on :func:`database_url`, named after the command;
    with the command's ``--lock-wait``, when it has one."""
    from composer_ops.engine import Engine

    return Engine.connect(database_url(args), pool_size=pool_size, application_name=f"composer-ops {args.command}",
                          lock_wait_s=getattr(args, "lock_wait", None))


def add_json_option(parser: argparse.ArgumentParser, help: str = "print JSON") -> None:
    parser.add_argument("--json", action="store_true", help=help)


def add_yes_option(parser: argparse._ActionsContainer, help: str) -> None:
    """``--yes``: act for real; without it the command says what it would do and changes nothing."""
    parser.add_argument("--yes", action="store_true", help=help)


def json_arg(text: str | None, what: str) -> Any:
    """Parse a JSON command-line argument, naming it and the position of a syntax error."""
    if text is None:
        return None
    from composer_ops.engine.jsonvalues import parse_json_text

    return parse_json_text(text, what)


def json_default(value: Any) -> Any:
    """What the CLI's JSON says for a value JSON has no type for: an instant in ISO 8601
    with the ``T`` and its UTC offset, in UTC (``2025-01-31T12:00:00.123456+00:00``),
    whatever the session's time zone; a date as ``2025-01-31``; anything else as text."""
    if isinstance(value, datetime):
        return (value.astimezone(UTC) if value.utcoffset() is not None else value).isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def json_text(value: Any, **kw: Any) -> str:
    """``value`` as JSON through :func:`json_default`: the one serializer of the CLI's JSON."""
    return json.dumps(value, default=json_default, **kw)


def emit_json(value: Any) -> None:
    sys.stdout.write(json_text(value, indent=2, sort_keys=False) + "\n")


def run_id_type(value: str) -> str:
    """The run a command looks up (argparse ``type``): checked before anything
    connects, and a pasted spelling (any case, braces, ``urn:uuid:``) made canonical.
    Never for naming a new run (``start --run-id`` takes the canonical text only)."""
    from composer_ops.core.runids import validate_run_id

    try:
        return validate_run_id(value, normalise=True)
    except Invalid as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_run_argument(parser: argparse.ArgumentParser, **kw: Any) -> None:
    """The positional RUN of a command that acts on one run (:func:`run_id_type`)."""
    parser.add_argument("run_id", metavar="RUN", type=run_id_type, **kw)


#: Characters a terminal acts on rather than shows (C0 and C1 controls but newline and
#: tab; DEL; bidirectional overrides), which stored text (a handler's error, a worker ID,
#: a queue name written by the engine role) could carry to an operator's terminal:
#: colours, a window title, a hidden hyperlink, text that reads backwards.
_ACTING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def shown(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape."""
    return _ACTING.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", text)


def say(line: str) -> None:
    """One line on stderr, ``composer-ops: `` first, its line breaks made spaces and with
    :func:`shown`'s escapes: stderr is not a :class:`ShownStream` (progress bars draw
    there), and a line that quotes a refusal, a month's reason or an error can carry
    stored text. Flushed: a long-running command's lines (that it serves, that it
    stopped) show at once."""
    sys.stderr.write(f"composer-ops: {shown(' '.join(line.splitlines()))}\n")
    sys.stderr.flush()


class ShownStream:
    """A text stream whose writes go through :func:`shown`: what a command prints of
    stored data reaches a terminal as text (JSON output escapes such characters itself)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return int(self._stream.write(shown(text)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
