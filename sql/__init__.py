"""The schema migrations (V<NNN>__<name>.sql), applied in order by ``composer-ops migrate``.

The package ships this directory as ``composer_ops.migrations`` and finds the files
through ``importlib.resources``.
"""
