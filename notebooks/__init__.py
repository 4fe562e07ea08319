"""The report notebooks, executed by ``composer-ops report``.

The package ships this directory (its notebooks only) as ``composer_ops.notebooks`` and
finds them through ``importlib.resources``.
"""
