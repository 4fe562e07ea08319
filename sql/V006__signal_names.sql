-- V006: one name for the signal (docs/architecture.md, "Names"). A WAIT_FOR_SIGNAL node
-- waits for a signal: the task's column says so, and the rows that 0.1.0 wrote with the
-- node type's old spelling take the new one (specs keep accepting WAIT_FOR_EVENT and
-- "event"; core/spec.py stores the new spelling). The table of buffered signals keeps
-- the seed's name, workflow_events.
--
-- RENAME COLUMN on the partitioned table renames it in every partition (and, on Citus,
-- in every shard); it takes ACCESS EXCLUSIVE on task_instances for the catalog change
-- only. The UPDATE rewrites the WAIT_FOR_EVENT rows, a small share of any month.
--
-- Each statement goes through EXECUTE: on Citus, DDL on a distributed table is sent to
-- the shards with the text of the statement it came in, which must then be that one
-- statement, not this whole file (as in V005).
DO $$
BEGIN
    EXECUTE 'ALTER TABLE task_instances RENAME COLUMN event_name TO signal_name';
    EXECUTE 'UPDATE task_instances SET node_type = ''WAIT_FOR_SIGNAL'' WHERE node_type = ''WAIT_FOR_EVENT''';
END;
$$;
