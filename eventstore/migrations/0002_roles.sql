-- The least-privilege reader role (ARCHITECTURE.md decision 6). Workspace-scoped reads and
-- the `db_query` tool run as `svc_reader` (`SET LOCAL ROLE`), under the row-level security
-- policies of the read-model tables; the projections migrations grant it what it may read.
-- It reads nothing of the store's own tables: the log is reached through the store's API.
-- Roles are cluster-wide, so creating it must tolerate another database (or process) doing
-- the same at the same moment.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'svc_reader') THEN
        BEGIN
            CREATE ROLE svc_reader NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
    -- The service's own login role must be a member to `SET LOCAL ROLE svc_reader`.
    IF NOT pg_has_role(current_user, 'svc_reader', 'MEMBER') THEN
        EXECUTE format('GRANT svc_reader TO %I', current_user);
    END IF;
END
$$;

REVOKE ALL ON events, processed_commands, snapshots FROM PUBLIC;
REVOKE ALL ON events, processed_commands, snapshots FROM svc_reader;
