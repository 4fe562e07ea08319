-- claim_fences: the claims a retry has fenced off. A claim is one autocommit statement
-- (sql/R__claim.sql); when its client gives up on the connection, the statement may
-- still reach the server after the claim's retry has looked for what it took and
-- committed. The retry writes its claim ID here in its own transaction, under the
-- claim's advisory lock; the claim function takes that lock first and then claims
-- nothing for a fenced ID, so a first attempt that arrives late leases no task its
-- worker never hears of (docs/reliability.md, "Retried writes"). One row per retried
-- claim; a retry deletes rows older than a day, long past any statement held in flight.
-- On Citus it stays a plain table on the coordinator, like the outbox the claim locks.
CREATE TABLE IF NOT EXISTS claim_fences(
    claim TEXT PRIMARY KEY,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);

GRANT SELECT, INSERT, DELETE ON claim_fences TO composer_ops_engine;
GRANT SELECT ON claim_fences TO composer_ops_reader;
