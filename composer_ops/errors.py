"""The one exception tree raised to callers of composer_ops.

``ComposerError`` is the root; ``NotFound``, ``Conflict`` and ``Invalid`` mirror the
seed's ``ErrNotFound``, ``ErrConflict`` and ``ErrInvalid``. ``NonRetryableError`` is
raised by worker handlers to skip the remaining attempts of a task. Driver errors
are translated in one place, :func:`composer_ops.db.errors.translate`.
"""

from __future__ import annotations


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
    """The database cannot be reached or the embedded server cannot start.

    Retryable: a caller may try the same request again later.
    """

    exit_code = 1


class NonRetryableError(Exception):
    """Raised by a task handler: fail the task now, skipping remaining attempts."""
