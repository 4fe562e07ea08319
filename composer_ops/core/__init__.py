"""The pure core of composer_ops: definitions, references, retry, run IDs, state machine.

Nothing here touches a database or reads a clock; the shell passes the database's
``now`` into every decision. See :func:`composer_ops.core.machine.decide`.

Each name is imported from the module that defines it (``core.model`` for states,
events and actions, ``core.machine``, ``core.spec``, ``core.expressions``,
``core.retry``, ``core.runids``); the package re-exports nothing.
"""
