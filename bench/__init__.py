"""The benchmark behind ``make bench``.

Everything here measures side by side in one run on one server: Composer through its
real worker and coordinator processes, Procrastinate (the peer) on the same server,
pgbench as the ceiling, HOT updates and index writes on ``task_instances``, and
retention by partition drop versus DELETE, the claim's cost against the months
retained, on PostgreSQL 18 and 15. ``python -m bench.run --help`` lists the knobs;
results land in ``bench/results/<date>-<commit>.json`` (``latest.json`` is a copy of
the newest).
"""
