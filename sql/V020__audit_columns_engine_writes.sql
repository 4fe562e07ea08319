-- operator_audit: the engine role may write only the columns its commands fill in.
--
-- V001 granted it INSERT on the whole table, so a worker's or coordinator's login could
-- write a row with any `at`, `login_role`, `db_role` and `client_addr`: an action dated
-- two days back and signed by the owner, shown by `audit list` beside the genuine rows.
-- Those four columns are what the database fills in (their defaults: now(),
-- session_user, current_user, the client address it sees); with INSERT granted on the
-- others only, a row the engine role writes always carries them, and a statement that
-- names one of them is refused (permission denied). The owner, who owns the table, is
-- unaffected (it could change the table itself). composer_ops/repo/audit.py writes
-- exactly these columns.
REVOKE INSERT ON operator_audit FROM composer_ops_engine;
GRANT INSERT (action, target, counts, detail, command, client_host, request, command_id)
    ON operator_audit TO composer_ops_engine;
