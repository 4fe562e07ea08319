-- SUB_WORKFLOW on Citus: a child's start, its cancel and its finish as rows.
--
-- On Citus a decision that starts, cancels or finishes a child does not write the other
-- run (which may be on another node) but a row here, in its own transaction and on its
-- own run's shard; the engine that committed it, or else the coordinator's "children"
-- loop, applies the row to its target run in a transaction of that run's own and then
-- deletes it (composer_ops/engine/childrows.py). A single server applies the action in
-- the decision's transaction and writes no row.
--
--   run_id         the run whose decision wrote the row (Citus: the distribution column,
--                  co-located with workflow_runs by sql/citus/R__child_deliveries.sql);
--   target_run_id  the run it is applied to: the child of a start or a cancel, the
--                  parent of a finish; one row per (run, target): a cancel written while
--                  the start is pending replaces it and keeps its start payload;
--   request        the request ID the apply records in the target's history (a start's
--                  'started' row, a cancel's 'cancelled', a finish's 'child_finished'),
--                  new at each write (a cancel records it with "/cancel" appended): a
--                  delivery repeated after its apply committed is
--                  recognised there, and the delete matches the version it applied.
--
-- No foreign key to workflow_runs: a row outlives the month of the run that wrote it
-- (retention may drop a finished child's month before its finish reached the parent).
CREATE TABLE IF NOT EXISTS child_deliveries (
    run_id           TEXT COLLATE "C" NOT NULL,
    target_run_id    TEXT COLLATE "C" NOT NULL,
    kind             TEXT NOT NULL CHECK (kind IN ('start', 'cancel', 'finish')),
    node_id          TEXT NOT NULL,
    request          TEXT NOT NULL,
    workflow_id      TEXT,
    workflow_version INT,
    input            JSONB,
    reason           TEXT,
    status           TEXT,
    output           JSONB,
    written_at       TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (run_id, target_run_id)
);
-- A queue: a decision writes a row (a cancel over a pending start updates it), a delivery deletes it.
GRANT SELECT, INSERT, UPDATE, DELETE ON child_deliveries TO composer_ops_engine;
GRANT SELECT ON child_deliveries TO composer_ops_reader;
