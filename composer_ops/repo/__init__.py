"""The repository: the SQL statements of composer_ops, one module per aggregate
(definitions, runs, tasks, signals, outbox, webhooks, partitions).

Functions take the connection to run on and never commit or log; driver errors reach
their callers as ComposerErrors (see :mod:`composer_ops.repo._base`).

Outside this package SQL runs only in :mod:`composer_ops.db` (connections, migrations)
and in :mod:`composer_ops.testing` (throwaway servers' CREATE/DROP DATABASE, fixtures
that seed a database directly), which the product never imports.
"""
