-- Each outbox row a dispatch hands to a registered worker records that worker
-- (task_waiters.worker; sql/R__dispatch.sql): the claims a worker makes because it was
-- woken (on its own channel or the shared one, or with a report) leave rows handed to
-- another registered worker to that worker's claim, so a claim never takes the row
-- another worker was woken for and leaves that worker's wake-up empty. A worker's poll
-- takes any row, and a row handed to a worker no longer registered (stopped, or
-- forgotten as dead) is any woken claim's (sql/R__claim.sql, composer_pick). NULL: handed
-- to nobody (told on the shared channel, or no worker registered; always on Citus, where
-- no claim registers). Written with the row, never updated; not indexed.
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS handed_to TEXT;
