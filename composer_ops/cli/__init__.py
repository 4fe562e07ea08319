"""The ``composer-ops`` command line.

Every setting (the database URL, thresholds, timeouts, limits, directories) can also
be set through the ``COMPOSER_*`` variable its --help shows. Errors are one line on
stderr (a traceback only with --debug); exit codes are 0 ok, 1 operation failed, 2 bad
input, 3 retention blocked (``partitions drop``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import composer_ops.cli.ops_cmds as ops_cmds
import composer_ops.cli.simulate_cmds as simulate_cmds
from composer_ops import __version__
from composer_ops.cli import (
    admin_cmds,
    audit_cmds,
    db_cmds,
    partition_cmds,
    queue_cmds,
    run_cmds,
    runbook_cmds,
    schedule_cmds,
)
from composer_ops.cli._common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    ArgumentParser,
    ShownStream,
    check_options,
    shown,
)
from composer_ops.errors import ComposerError, Unavailable

#: The values --log-level (and COMPOSER_LOG_LEVEL) take, in either case.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="composer-ops", description=(__doc__ or "").replace("``", ""))
    parser.add_argument("--version", action="version", version=f"composer-ops {__version__}")
    parser.add_argument("--debug", action="store_true", default=os.environ.get("COMPOSER_DEBUG") == "1",
                        help="show tracebacks and debug logs [env: COMPOSER_DEBUG=1]")
    parser.add_argument("--log-level", default=os.environ.get("COMPOSER_LOG_LEVEL", "WARNING"), type=str.upper,
                        choices=LOG_LEVELS, metavar="LEVEL",
                        help=f"log level for the composer_ops logger: {', '.join(LOG_LEVELS)} "
                             "[env: COMPOSER_LOG_LEVEL]")
    # Not required here: main() says a command is missing only once no argument is left
    # unrecognized, so `composer-ops --bogus` names --bogus rather than a missing command.
    sub = parser.add_subparsers(dest="command", required=False, parser_class=ArgumentParser)
    db_cmds.register(sub)
    run_cmds.register(sub)
    partition_cmds.register(sub)
    admin_cmds.register(sub)
    queue_cmds.register(sub)
    audit_cmds.register(sub)
    schedule_cmds.register(sub)
    ops_cmds.register(sub)
    runbook_cmds.register(sub)
    simulate_cmds.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error("the following arguments are required: command")
    args.argv = list(sys.argv[1:] if argv is None else argv)    # for the audit rows of operator actions
    if args.log_level not in LOG_LEVELS:        # from COMPOSER_LOG_LEVEL (argparse checks only what is typed)
        parser.error(f"COMPOSER_LOG_LEVEL: {args.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("composer_ops").setLevel(level)
    # What a command prints reaches a terminal as text. Not simulate's tables (its own), nor
    # what a worker's or coordinator's process prints: the application's own handlers and
    # logging write there, colours and all. (stderr is not wrapped: progress bars draw
    # there; the commands' own lines on it go through cli._common.say, which escapes.)
    passes = args.command in ("simulate", "worker", "coordinator")
    plain, sys.stdout = sys.stdout, (sys.stdout if passes else ShownStream(sys.stdout))
    try:
        check_options(args)
        code: int = args.func(args)
        sys.stdout.flush()
        return code
    except ComposerError as exc:
        if args.debug:
            raise
        # A Transient is an Unavailable the engine retried already: people see one kind.
        # A ComposerError of no kind of its own is an error, as any other failure.
        kind = "unavailable" if isinstance(exc, Unavailable) else \
            "error" if type(exc) is ComposerError else type(exc).__name__.lower()
        sys.stderr.write(f"composer-ops: {kind}: {shown(str(exc))}\n")
        return exc.exit_code
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"composer-ops: interrupted{f': {exc}' if str(exc) else ''}\n")
        return EXIT_FAILED
    except BrokenPipeError:
        # Whoever read stdout stopped reading (`composer-ops ... | head`): not a failure
        # of the command. stdout goes to /dev/null so the interpreter's last flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (OSError, ValueError) as exc:
        if args.debug:
            raise
        sys.stderr.write(f"composer-ops: error: {shown(str(exc))}\n")
        return EXIT_BAD_INPUT if isinstance(exc, ValueError) else EXIT_FAILED
    finally:
        sys.stdout = plain


def entry() -> None:
    sys.exit(main())
