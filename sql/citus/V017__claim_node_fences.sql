-- Citus only: the claim fences of each worker node (docs/scaling.md, "Dispatch on Citus").
--
-- A claim is one delegated call per node (sql/citus/R__claim_node.sql), under an advisory
-- lock of that node; the coordinator's claim_fences (sql/V007) is not where that call
-- runs. A claim retried after a lost acknowledgement fences its ID on every node first
-- (a row here, under the node's lock, keyed by the stream key the engine calls the node
-- with, so the row is on that node's own shard); a first attempt whose call reaches the
-- node afterwards claims nothing there. Co-located with the runs: the call delegated by
-- the key reads and writes its fence locally. A retry deletes its key's rows older than
-- a day.
CREATE TABLE IF NOT EXISTS claim_node_fences(
    key TEXT COLLATE "C" NOT NULL,
    claim TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (key, claim)
);
SELECT create_distributed_table('claim_node_fences', 'key', colocate_with => 'workflow_runs');

GRANT SELECT, INSERT, DELETE ON claim_node_fences TO composer_ops_engine;
GRANT SELECT ON claim_node_fences TO composer_ops_reader;
