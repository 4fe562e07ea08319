-- Citus only: every session of this database uses one connection per worker node, kept.
--
-- A statement over many shards (the coordinator's scans for due timers, expired leases
-- and child rows; the reports) runs on up to citus.max_adaptive_executor_pool_size
-- connections per worker node (16 by default), and at the end of its transaction Citus
-- closes all but citus.max_cached_conns_per_worker of them (1 by default): every pass
-- of the coordinator opened about six new backends on each worker node and shut them
-- again, most of the pass's CPU (docs/scaling.md, "Where a run's CPU goes"). With both
-- at 1, a session opens one connection per worker node once and runs its shard queries
-- over it, one after the other. A larger cache is not safe: cached connections of idle
-- sessions count against citus.max_shared_pool_size, and once it is full a new session
-- waits for a free one (with 4 cached per session and a pool of 8, the second session's
-- first scan waited until its timeout); one connection per node is the one Citus
-- always grants a session.
--
-- Set on the database, so it applies to every role's new sessions (sessions already
-- open keep their settings until they reconnect). Needs the database's owner, who runs
-- `composer-ops migrate`. A role can set other values (ALTER ROLE ... IN DATABASE ...
-- SET wins over this).
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET citus.max_cached_conns_per_worker = 1', current_database());
    EXECUTE format('ALTER DATABASE %I SET citus.max_adaptive_executor_pool_size = 1', current_database());
END;
$$;
