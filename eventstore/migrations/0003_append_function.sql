-- svc_append: the whole append in one statement, so a client runs it as one round trip in an
-- implicit transaction (Bind/Execute/Sync of a prepared `SELECT * FROM svc_append(...)`)
-- instead of BEGIN + claim + insert + COMMIT. ARCHITECTURE.md decision 2.
--
-- Invariants (the caller, eventstore/store.py, relies on each of them):
-- * The ledger row `(workspace_id, command_id)` is claimed first. A concurrent duplicate of
--   the same command blocks on that row until the first append commits (then this call sees
--   the row and returns its first result with `duplicate`) or rolls back (then this call acts
--   itself). Events and ledger row commit or vanish together: a command never takes effect
--   twice, and is never recorded without its effect.
-- * A duplicate wins over every other outcome: a retried command gets its first result even
--   if the stream moved on since.
-- * The fence is `UNIQUE (stream_id, version)`, never ON CONFLICT on events: versions are
--   head+1.., and a second writer of a version fails with unique_violation on
--   events_stream_version (the caller reports a concurrency conflict). An expected version
--   that is not the head raises SQLSTATE SV409; a stream of another workspace raises SV403.
--   Any error aborts the statement's transaction, the claim with it.
-- * PL/pgSQL takes a fresh snapshot per statement (READ COMMITTED, VOLATILE), so the ledger
--   read after a lost claim sees the row the other transaction just committed.
CREATE OR REPLACE FUNCTION svc_append(
    p_workspace_id     text,
    p_command_id       text,
    p_stream_id        text,
    p_expected_version bigint,
    p_event_ids        uuid[],
    p_types            text[],
    p_schema_versions  int2[],
    p_datas            jsonb[],
    p_metadatas        jsonb[],
    OUT duplicate      boolean,
    OUT stream_id      text,
    OUT first_version  integer,
    OUT last_version   integer,
    OUT last_tx        xid8,
    OUT last_position  bigint
)
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    head_version   integer;
    head_workspace text;
BEGIN
    INSERT INTO processed_commands AS pc
        (workspace_id, command_id, stream_id, first_version, last_version, last_position)
    VALUES (p_workspace_id, p_command_id, p_stream_id, 0, 0, 0)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        SELECT true, pc.stream_id, pc.first_version, pc.last_version, pc.last_tx,
               pc.last_position
        INTO duplicate, stream_id, first_version, last_version, last_tx, last_position
        FROM processed_commands AS pc
        WHERE pc.workspace_id = p_workspace_id AND pc.command_id = p_command_id;
        RETURN;
    END IF;

    SELECT e.version, e.workspace_id INTO head_version, head_workspace
    FROM events AS e WHERE e.stream_id = p_stream_id
    ORDER BY e.version DESC LIMIT 1;
    IF head_workspace IS DISTINCT FROM p_workspace_id AND head_workspace IS NOT NULL THEN
        RAISE EXCEPTION 'stream belongs to another workspace' USING ERRCODE = 'SV403';
    END IF;
    head_version := coalesce(head_version, 0);
    IF p_expected_version IS NOT NULL AND p_expected_version <> head_version THEN
        RAISE EXCEPTION 'stream moved past the expected version' USING ERRCODE = 'SV409';
    END IF;

    WITH written AS (
        INSERT INTO events AS e
            (stream_id, version, event_id, workspace_id, type, schema_version, data, metadata)
        SELECT p_stream_id, head_version + u.ord, u.event_id, p_workspace_id, u.type,
               u.schema_version, u.data, u.metadata
        FROM unnest(p_event_ids, p_types, p_schema_versions, p_datas, p_metadatas)
             WITH ORDINALITY AS u(event_id, type, schema_version, data, metadata, ord)
        ORDER BY u.ord
        RETURNING e.version, e.position, e.tx
    )
    SELECT false, p_stream_id, min(w.version), max(w.version), max(w.tx), max(w.position)
    INTO duplicate, stream_id, first_version, last_version, last_tx, last_position
    FROM written AS w;

    UPDATE processed_commands AS pc
    SET first_version = svc_append.first_version, last_version = svc_append.last_version,
        last_tx = svc_append.last_tx, last_position = svc_append.last_position
    WHERE pc.workspace_id = p_workspace_id AND pc.command_id = p_command_id;
END
$fn$;

-- SECURITY INVOKER: it writes only what its caller may write; nobody else needs to call it.
REVOKE ALL ON FUNCTION svc_append(text, text, text, bigint, uuid[], text[], int2[], jsonb[],
                                  jsonb[]) FROM PUBLIC;
