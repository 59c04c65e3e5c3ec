-- Workspace-scoped reads of the log (a conversation's event history, a feed's catch-up and
-- its head) run as `svc_log_reader` (`Database.scoped`), under row-level security on
-- `svc.workspace_id`, as read-model reads run as `svc_reader` (ARCHITECTURE.md decision 6):
-- a read that lost its workspace condition sees nothing of another workspace's events. A
-- role of its own rather than `svc_reader`: event data holds what the read models keep from
-- `svc_reader` (credential hashes), and `svc_reader` is the role of any query a user may
-- shape. The service's login owns the log (or has BYPASSRLS) and reads all of it, as the
-- projections and the live tail must; the policy is for the log reader alone, and for a
-- session whose login may act as the log's owner: `svc_log_reader` is one role for the
-- whole cluster, and another SVC database's login, a member of it too, must not read this
-- database's events by connecting here. (The owner test is evaluated once per query.)
-- A role neither the owner nor BYPASSRLS (a monitoring role, a `pg_dump -t events` by
-- another login) reads no events from here on. ENABLE and CREATE POLICY take an ACCESS
-- EXCLUSIVE lock on `events` for a moment: run it while no long transaction holds one.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'svc_log_reader') THEN
        BEGIN
            CREATE ROLE svc_log_reader NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
    IF NOT pg_has_role(current_user, 'svc_log_reader', 'MEMBER') THEN
        EXECUTE format('GRANT svc_log_reader TO %I', current_user);
    END IF;
END
$$;

GRANT SELECT ON events TO svc_log_reader;
ALTER TABLE events ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS events_of_the_workspace ON events;
CREATE POLICY events_of_the_workspace ON events FOR SELECT TO svc_log_reader
    USING (
        workspace_id = current_setting('svc.workspace_id', true)
        AND (SELECT pg_has_role(session_user, c.relowner, 'USAGE')
             FROM pg_class c WHERE c.oid = 'events'::regclass)
    );
