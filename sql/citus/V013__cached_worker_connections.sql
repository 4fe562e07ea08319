-- Citus only: every session of this database keeps its connections to the worker nodes.
--
-- A statement over many shards (the coordinator's scans for due timers, expired leases
-- and child rows; the reports) runs on up to citus.max_adaptive_executor_pool_size
-- connections per worker node, and at the end of its transaction Citus closed all but
-- citus.max_cached_conns_per_worker of them (1 by default): every pass of the
-- coordinator opened about six new backends on each worker node and shut them again,
-- 60 % of the pass's CPU (docs/scaling.md, "Where a run's CPU goes"). With the two
-- equal, a session opens its connections once and reuses them. Four per worker node
-- bounds what one session holds there (sessions x 4 x nodes backends at most, within
-- citus.max_shared_pool_size) and still runs a scan on four shards at once per node.
--
-- Set on the database, so it applies to every role's new sessions (sessions already
-- open keep their settings until they reconnect). Needs the database's owner, which
-- is who runs `composer-ops migrate`. An operator can override either per role or on
-- the server (ALTER ROLE ... IN DATABASE ... SET wins over this).
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET citus.max_cached_conns_per_worker = 4', current_database());
    EXECUTE format('ALTER DATABASE %I SET citus.max_adaptive_executor_pool_size = 4', current_database());
END;
$$;
