"""The chaos run: many runs of mixed definitions through real worker and coordinator
processes while a driver SIGKILLs them and restarts PostgreSQL, then a full audit.

``python -m tests.chaos.driver --runs 5000`` (``make chaos``) runs it at size;
``tests/chaos/test_chaos.py`` runs 200 in CI.
"""
