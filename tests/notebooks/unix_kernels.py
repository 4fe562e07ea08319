"""A pytest plugin for the nested nbval runs of tests/notebooks/harness.py: their kernels
listen on Unix sockets (:mod:`composer_ops.kernels`) wherever the notebooks are.
``notebooks/conftest.py`` does the same for the notebooks under ``notebooks/``, but a run
over copies in a temporary directory never loads it."""

from __future__ import annotations

import pytest

from composer_ops.kernels import use_in_nbval


def pytest_configure(config: pytest.Config) -> None:
    use_in_nbval()
