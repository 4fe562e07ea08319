"""The schema migrations, applied by ``composer-ops migrate``: ``V<NNN>__<name>.sql`` in
order (each once), then the repeatable ``R__<name>.sql`` (the current body of every SQL
function); ``citus/`` holds the Citus series' own files (composer_ops/db/migrate.py).

The package ships this directory as ``composer_ops.migrations`` and finds the files
through ``importlib.resources``.
"""
