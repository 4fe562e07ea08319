"""``composer-ops simulate``: a realistic workload for a Composer database.

``definitions`` (the four workflows and their plans), ``model`` (durations, failures,
outputs), ``handlers`` (the live Worker), ``live`` (traffic through real processes),
``months`` (generated months: past runs written with COPY), ``replay`` and ``past`` (a run in
memory driven through the state machine on a simulated clock) and ``copytext``. The
workflow rules live in :mod:`composer_ops.core` only: the backfill's rows are the state
machine's decisions. Every statement is in :mod:`composer_ops.repo.simulator`.
"""
