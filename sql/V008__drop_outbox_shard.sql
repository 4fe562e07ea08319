-- V008: task_outbox loses its shard column.
--
-- Nothing ever read it: the claim takes the oldest available rows of its queues
-- whatever their shard, so the column only cost two bytes and a hash per dispatch.
-- Dispatch on a distributed (Citus) deployment is made safe by its own migration,
-- not by a shard number chosen by the client.
--
-- The engine no longer names the column when it inserts (its DEFAULT fills it until
-- it is gone), whereas an engine that still names it fails once it is dropped: so
-- deploy the code first, then migrate. Dropping a column only changes the catalog (no table rewrite), but it
-- takes task_outbox's ACCESS EXCLUSIVE lock: lock_timeout makes a migration that
-- would queue behind a long transaction (and hold every claim behind itself) fail
-- fast instead, to be run again.
SET LOCAL lock_timeout = '10s';
ALTER TABLE task_outbox DROP COLUMN IF EXISTS shard;
