-- V022: the rows one command wrote (one per chunk, month or run) share the id the CLI mints
-- per invocation, so the audit shows a command as one line. NULL for rows written before.
ALTER TABLE operator_audit ADD COLUMN IF NOT EXISTS command_id TEXT;
