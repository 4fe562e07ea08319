-- schema_migrations: the engine role may read it.
--
-- A worker or coordinator (composer-ops worker, coordinator) checks, before it serves
-- anything, that the database holds every migration of its version
-- (composer_ops/db/migrate.py, require_current): started against a database not
-- migrated (a forgotten COMPOSER_DATABASE_URL, an upgrade whose migrate was skipped) it
-- otherwise looked alive while every claim failed. It reads the files' names and
-- checksums, nothing else. A database without this file refuses the engine role the
-- read, which the check takes for what it is: a migration of this version pending.
-- The table is migrate's: a file applied by hand (psql -f, no runner) has none to grant.
DO $$
BEGIN
    IF to_regclass('schema_migrations') IS NOT NULL THEN
        GRANT SELECT ON schema_migrations TO composer_ops_engine;
    END IF;
END;
$$;
