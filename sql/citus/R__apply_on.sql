-- Citus only: composer_apply_on (sql/R__apply.sql) is NOT delegated: it runs on the
-- coordinator and each of its statements is routed to the run's node, in the event's
-- transaction. A forced delegation (create_distributed_function(..., force_delegation
-- => true)) was tried and failed the chaos run (docs/scaling.md).
SELECT 1;
