"""``composer-ops simulate``: a realistic workload for a Composer database.

- :mod:`~composer_ops.simulate.definitions`: the four workflows, their inputs, signal
  and cancellation plans;
- :mod:`~composer_ops.simulate.model`: durations, failures and outputs, shared by the
  live workers and the backfill;
- :mod:`~composer_ops.simulate.handlers`: the Worker the live phase runs in real
  processes (``--app composer_ops.simulate.handlers:make_worker``);
- :mod:`~composer_ops.simulate.live`: live traffic through real coordinator and
  worker processes;
- :mod:`~composer_ops.simulate.history`: months of past runs written with COPY;
- :mod:`~composer_ops.simulate.replay`: a run in memory driven through the state
  machine (its rows, the machine's store, the shell's apply step);
- :mod:`~composer_ops.simulate.past`: when things happen to a past run (queueing,
  attempts, dead workers, timers, signals, cancels) on the replay's simulated clock;
- :mod:`~composer_ops.simulate.copytext`: replayed rows as COPY text.

The workflow rules live in :mod:`composer_ops.core` only: the backfill's rows are the
state machine's decisions, applied as the shell applies them. Every statement the
simulator runs is in :mod:`composer_ops.repo.simulator`.
"""
