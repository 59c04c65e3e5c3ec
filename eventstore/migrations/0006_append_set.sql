-- svc_append_set: one or more independent appends in one statement, done set-based: a fixed
-- number of SQL statements per call instead of a function call, a subtransaction and four
-- statements per append (svc_append_batch, migration 0005). Event data and metadata arrive as
-- one JSON array each (one element per event, in event order) instead of jsonb[]: the client
-- serialises a whole batch in one call and the server parses one document, not an array
-- literal of quoted JSON strings.
--
-- The fast path covers the common case: every item is a new command (or a duplicate of a
-- committed one), on its own stream, at its expected version. Anything else runs the
-- one-by-one path, svc_append_batch, so the per-item semantics are exactly those of
-- migrations 0004 and 0005:
-- * An item refused by the lookup (expected version not the head, stream of another
--   workspace): one-by-one path before anything is written; it looks for the command again
--   with a fresh snapshot first (the duplicate wins).
-- * A ledger claim lost to a concurrent duplicate (ON CONFLICT DO NOTHING skipped a row that
--   committed while we waited on it), or a unique violation on events (a concurrent writer of
--   the same stream: the fence; or a repeated event id): the fast path's writes are rolled
--   back with its subtransaction and the one-by-one path runs from scratch.
-- * Items that depend on each other must act in array order, each seeing the previous one's
--   rows. Set-based, they read the same head and claim the same ledger key, so they always
--   land in one of the two cases above: two new items of one stream are either refused (the
--   second expects the first's last version) or collide on the fence; a command repeated in
--   the batch loses its second claim to its first.
-- All successful items commit together or not at all, in the caller's transaction; `tx` is
-- the top-level transaction id (pg_current_xact_id() in a subtransaction returns it).
-- Positions are drawn from the identity sequence, ascending in event order; numbers drawn by
-- a rolled-back fast path are skipped, as after any rollback (readers never rely on density).
CREATE OR REPLACE FUNCTION svc_append_set(
    p_workspace_ids    text[],
    p_command_ids      text[],
    p_stream_ids       text[],
    p_expected         bigint[],
    p_counts           int[],
    p_event_ids        uuid[],
    p_types            text[],
    p_schema_versions  int2[],
    p_datas            jsonb,
    p_metadatas        jsonb
)
RETURNS TABLE (
    item             int,
    error_state      text,
    error_constraint text,
    duplicate        boolean,
    stream_id        text,
    first_version    integer,
    last_version     integer,
    last_tx          xid8,
    last_position    bigint
)
LANGUAGE plpgsql VOLATILE
-- Custom plans would be made again on every call (their estimates, from the arrays' real
-- sizes, always look cheaper than the generic ones): planning cost more than the work.
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    item_count   int := coalesce(cardinality(p_stream_ids), 0);
    event_count  int := coalesce(cardinality(p_event_ids), 0);
    one_by_one   boolean;
    miscounted   boolean;
    new_items    int;
    claimed      int;
    -- Per item, in item order: a duplicate of a committed command?, its stream's head, and
    -- the index of its last event.
    dups         boolean[];
    heads        int[];
    ends         int[];
    item_of      int[];  -- per event: its item
    positions    bigint[];  -- per event
BEGIN
    IF cardinality(p_types) IS DISTINCT FROM event_count
       OR cardinality(p_schema_versions) IS DISTINCT FROM event_count
       OR cardinality(p_workspace_ids) IS DISTINCT FROM item_count
       OR cardinality(p_command_ids) IS DISTINCT FROM item_count
       OR cardinality(p_expected) IS DISTINCT FROM item_count
       OR cardinality(p_counts) IS DISTINCT FROM item_count
       OR jsonb_array_length(p_datas) <> event_count
       OR jsonb_array_length(p_metadatas) <> event_count THEN
        RAISE EXCEPTION 'svc_append_set: item and event arrays do not line up'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- The ledger lookup and the stream heads of all items in one statement.
    SELECT coalesce(bool_or(pc.command_id IS NULL AND (
               (h.workspace_id IS DISTINCT FROM i.workspace_id AND h.workspace_id IS NOT NULL)
               OR (i.expected IS NOT NULL AND i.expected <> coalesce(h.version, 0)))), false),
           count(*) FILTER (WHERE pc.command_id IS NULL),
           array_agg(pc.command_id IS NOT NULL ORDER BY i.n),
           array_agg(coalesce(h.version, 0) ORDER BY i.n),
           array_agg(i.ends ORDER BY i.n),
           coalesce(max(i.ends), 0) <> event_count OR bool_or(i.cnt < 1)
    INTO one_by_one, new_items, dups, heads, ends, miscounted
    FROM (
        SELECT u.*, (sum(u.cnt) OVER (ORDER BY u.n))::int AS ends
        FROM unnest(p_workspace_ids, p_command_ids, p_stream_ids, p_expected, p_counts)
             WITH ORDINALITY AS u(workspace_id, command_id, stream_id, expected, cnt, n)
    ) AS i
    -- Both lookups are LATERAL with LIMIT: one index probe per item, whatever the estimates
    -- (the plan is generic, see the function's SET clause).
    LEFT JOIN LATERAL (
        SELECT c.command_id FROM processed_commands AS c
        WHERE c.workspace_id = i.workspace_id AND c.command_id = i.command_id LIMIT 1
    ) AS pc ON true
    LEFT JOIN LATERAL (
        SELECT e.version, e.workspace_id FROM events AS e WHERE e.stream_id = i.stream_id
        ORDER BY e.version DESC LIMIT 1
    ) AS h ON true;
    IF miscounted THEN
        RAISE EXCEPTION 'svc_append_set: the item counts do not add up to the events'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF item_count > 0 AND NOT one_by_one AND new_items > 0 THEN
        BEGIN
            SELECT ARRAY(
                       SELECT nextval('events_position_seq') AS p
                       FROM generate_series(1, event_count) ORDER BY p
                   ),
                   ARRAY(
                       SELECT c.n FROM unnest(p_counts) WITH ORDINALITY AS c(cnt, n),
                            generate_series(1, c.cnt)
                       ORDER BY c.n
                   )
            INTO positions, item_of;

            INSERT INTO processed_commands AS pc
                (workspace_id, command_id, stream_id, first_version, last_version, last_tx,
                 last_position)
            SELECT i.workspace_id, i.command_id, i.stream_id, heads[i.n] + 1,
                   heads[i.n] + i.cnt, pg_current_xact_id(), positions[ends[i.n]]
            FROM unnest(p_workspace_ids, p_command_ids, p_stream_ids, p_counts)
                 WITH ORDINALITY AS i(workspace_id, command_id, stream_id, cnt, n)
            WHERE NOT dups[i.n]
            ON CONFLICT DO NOTHING;
            GET DIAGNOSTICS claimed = ROW_COUNT;
            IF claimed < new_items THEN  -- a concurrent duplicate committed while we waited
                RAISE EXCEPTION 'a ledger claim was lost' USING ERRCODE = 'SV300';
            END IF;

            INSERT INTO events AS e
                (position, stream_id, version, event_id, workspace_id, type, schema_version,
                 data, metadata)
            OVERRIDING SYSTEM VALUE
            SELECT positions[u.n], p_stream_ids[x.it],
                   heads[x.it] + u.n - ends[x.it] + p_counts[x.it], u.event_id,
                   p_workspace_ids[x.it], u.type, u.schema_version, u.data, u.metadata
            FROM ROWS FROM (
                     unnest(p_event_ids), unnest(p_types), unnest(p_schema_versions),
                     jsonb_array_elements(p_datas), jsonb_array_elements(p_metadatas)
                 ) WITH ORDINALITY AS u(event_id, type, schema_version, data, metadata, n),
                 LATERAL (SELECT item_of[u.n] AS it) AS x
            WHERE NOT dups[x.it];
        EXCEPTION WHEN OTHERS THEN
            one_by_one := true;
        END;
    END IF;

    IF one_by_one THEN
        RETURN QUERY
        SELECT b.item, b.error_state, b.error_constraint, b.duplicate, b.stream_id,
               b.first_version, b.last_version, b.last_tx, b.last_position
        FROM svc_append_batch(
            p_workspace_ids, p_command_ids, p_stream_ids, p_expected, p_counts, p_event_ids,
            p_types, p_schema_versions,
            ARRAY(SELECT d.value FROM jsonb_array_elements(p_datas) WITH ORDINALITY AS d
                  ORDER BY d.ordinality),
            ARRAY(SELECT m.value FROM jsonb_array_elements(p_metadatas) WITH ORDINALITY AS m
                  ORDER BY m.ordinality)
        ) AS b;
        RETURN;
    END IF;

    -- A duplicate's first result is read again here: its ledger row committed before the
    -- lookup and ledger rows are never changed.
    RETURN QUERY
    SELECT i.n::int, NULL::text, NULL::text, dups[i.n],
           coalesce(pc.stream_id, i.stream_id),
           coalesce(pc.first_version, heads[i.n] + 1),
           coalesce(pc.last_version, heads[i.n] + i.cnt),
           coalesce(pc.last_tx, pg_current_xact_id()),
           coalesce(pc.last_position, positions[ends[i.n]])
    FROM unnest(p_workspace_ids, p_command_ids, p_stream_ids, p_counts)
         WITH ORDINALITY AS i(workspace_id, command_id, stream_id, cnt, n)
    LEFT JOIN LATERAL (
        SELECT c.stream_id, c.first_version, c.last_version, c.last_tx, c.last_position
        FROM processed_commands AS c
        WHERE dups[i.n] AND c.workspace_id = i.workspace_id AND c.command_id = i.command_id
        LIMIT 1
    ) AS pc ON true
    ORDER BY i.n;
END
$fn$;

REVOKE ALL ON FUNCTION svc_append_set(text[], text[], text[], bigint[], int[], uuid[], text[],
                                      int2[], jsonb, jsonb) FROM PUBLIC;
