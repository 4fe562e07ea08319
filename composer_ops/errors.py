"""The one exception tree raised to callers of composer_ops.

``ComposerError`` is the root; ``NotFound``, ``Conflict``, ``Invalid`` and
``PermissionDenied`` say what kind of refusal it is, and each carries the CLI's exit
code. ``Unavailable`` (and its ``Transient`` subset, of which ``LockTimeout`` is one)
means the database could not serve the request now; ``NotDelegated``, that a call Citus
was to run on one worker node ran elsewhere.
``NonRetryableError`` is raised by worker handlers to skip the remaining attempts of
a task. Driver errors become these at one boundary, the connection class of
:mod:`composer_ops.db.errors`, with the driver's error kept as ``__cause__``.
"""

from __future__ import annotations

from datetime import datetime


class ComposerError(Exception):
    """Base class of every error composer_ops raises on purpose."""

    #: CLI exit code for this kind of error (1: operation failed, 2: bad input).
    exit_code = 1


class NotFound(ComposerError):
    """A run, definition, task or partition that does not exist."""

    exit_code = 2


class Conflict(ComposerError):
    """The request contradicts the current state (duplicate run ID, finished run)."""

    exit_code = 1


class Invalid(ComposerError):
    """Bad input: a malformed spec, run ID, JSON document or argument."""

    exit_code = 2


class Unavailable(ComposerError):
    """The database cannot serve the request now: it cannot be reached, refuses the
    connection, is out of connections or shutting down, or the embedded server cannot
    start. A caller may try the same request again later.
    """

    exit_code = 1


class Transient(Unavailable):
    """A database error that re-running the whole transaction can cure: serialization
    failure, deadlock, lock timeout, a lost connection, a server restarting, no pooled
    connection free in time. ``db_retry`` retries exactly these; ``__cause__`` is the
    driver's error.
    """


class LockTimeout(Transient):
    """A lock was not granted within the session's ``lock_timeout``: its holder (a long
    reader, another drop) may let go, so the whole transaction can be re-run.
    ``run_id``: the run whose event waited, when the wait was in one."""

    run_id: str | None = None


class PermissionDenied(ComposerError):
    """The database role lacks a privilege the request needs: someone must grant it,
    no retry helps."""

    exit_code = 1


class BrokenRun(ComposerError):
    """A run whose rows no event can be decided on: odd data, such as a definition
    version that does not exist or a task in a state the engine does not know. Nothing
    is changed; the rows must be repaired, or the run deleted (``runs delete``)."""

    exit_code = 1


class NotDelegated(ComposerError):
    """On Citus, a call meant to run on one worker node (a node's claim, scan or webhook
    prune, sql/citus/R__node_local.sql) ran on a node that does not hold its key's shard:
    Citus did not delegate it (a transaction block, the node's metadata not synced).
    What the call reads is not that node's: no result is better than an empty one."""

    exit_code = 1


class StartRefused(ComposerError):
    """A run's start the database refused, writing nothing (the start's one statement,
    composer_ops/repo/writes.py): ``why`` is 'run_id' (outside the run ID's recency
    window by the database clock, or not a UUIDv7), 'partition' (no partition of its
    month), 'definition' (the version is missing, deleted, disabled or no longer the
    deployed one asked for) or 'conflict' (the run ID is taken); ``now`` is the database
    clock. The engine's start says what was wrong (composer_ops/engine/starts.py)."""

    exit_code = 1

    def __init__(self, why: str, now: datetime) -> None:
        super().__init__(f"start refused: {why}")
        self.why, self.now = why, now


class NonRetryableError(Exception):
    """Raised by a task handler: fail the task now, skipping remaining attempts."""


class ShutdownTimeout(ComposerError):
    """A worker stopped with handlers still running after its shutdown deadline; the
    message names the abandoned attempts (their leases lapse and the tasks are retried)."""

    exit_code = 1
