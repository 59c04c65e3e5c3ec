-- Lock waits of an append are bounded well inside the statement timeout, so that one append
-- that waits on a row lock fails alone instead of taking every append of its statement with
-- it. An append waits on a row only while another transaction holds it uncommitted: the
-- ledger row of the same command (a duplicate still in flight, perhaps in a stalled process)
-- or the same (stream_id, version) on the fence. Coalesced appends share one statement
-- (svc_append_set); before this migration such a wait held every other item of the statement
-- until statement_timeout, which then failed all of them as unavailable.
--
-- svc_bound_lock_waits() sets `lock_timeout` for the calling append function: a quarter of
-- the statement timeout per wait, and never past half of it counted from the statement's
-- start, at least 1 ms. A wait that runs out raises lock_not_available (55P03):
-- * in svc_append_set's set-based path it is caught like any other failure there: that path
--   is rolled back and the one-by-one path runs (svc_append_batch, one subtransaction per
--   item), where only the item that waits again fails, with 55P03, and the others are
--   written. Several blocked items share what is left of the half: each fails after at most
--   its share (the 1 ms floor once it is spent), never the statement.
-- * an append sent alone (svc_append) fails with 55P03 after the same bound, instead of
--   waiting for the statement timeout.
-- The store reports 55P03 as a retryable StoreUnavailable for that append alone
-- (eventstore/store.py); retrying with the same command id is safe. Without a statement
-- timeout (0) lock waits are not bounded either, as before.
--
-- The setting is made with set_config(..., true) from inside functions that carry a
-- `SET lock_timeout` clause: PostgreSQL then restores the caller's value when the function
-- returns, so a caller's own transaction (a test, psql) keeps its lock_timeout.
-- svc_append and svc_append_set are otherwise exactly as in migrations 0004 and 0006
-- (svc_append_batch runs each item through svc_append, so it needs no change).
CREATE FUNCTION svc_bound_lock_waits() RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    statement_ms double precision :=
        extract(epoch FROM current_setting('statement_timeout')::interval) * 1000;
    elapsed_ms   double precision;
BEGIN
    IF statement_ms <= 0 THEN
        RETURN;  -- no statement timeout: the caller's clause leaves lock waits unbounded
    END IF;
    elapsed_ms := extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000;
    PERFORM set_config(
        'lock_timeout',
        greatest(1, least(statement_ms / 4, statement_ms / 2 - elapsed_ms))::bigint::text,
        true
    );
END
$fn$;

REVOKE ALL ON FUNCTION svc_bound_lock_waits() FROM PUBLIC;

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
-- Scopes the lock timeout svc_bound_lock_waits() sets to this call (see above).
SET lock_timeout = 0
AS $fn$
DECLARE
    event_count    int := array_length(p_event_ids, 1);
    head_version   integer;
    head_workspace text;
    positions      bigint[];
BEGIN
    PERFORM svc_bound_lock_waits();
    -- The ledger lookup and the head read in one statement (one executor run instead of two).
    SELECT pc.command_id IS NOT NULL, pc.stream_id, pc.first_version, pc.last_version,
           pc.last_tx, pc.last_position, h.version, h.workspace_id
    INTO duplicate, stream_id, first_version, last_version, last_tx, last_position,
         head_version, head_workspace
    FROM (SELECT) AS one
    LEFT JOIN processed_commands AS pc
        ON pc.workspace_id = p_workspace_id AND pc.command_id = p_command_id
    LEFT JOIN LATERAL (
        SELECT e.version, e.workspace_id FROM events AS e WHERE e.stream_id = p_stream_id
        ORDER BY e.version DESC LIMIT 1
    ) AS h ON true;
    IF duplicate THEN
        RETURN;
    END IF;

    head_version := coalesce(head_version, 0);
    IF (head_workspace IS DISTINCT FROM p_workspace_id AND head_workspace IS NOT NULL)
       OR (p_expected_version IS NOT NULL AND p_expected_version <> head_version) THEN
        -- The same command may have committed since the lookup's snapshot (a retry racing
        -- its first attempt): its ledger row committed with the events that moved the head,
        -- so this statement's fresh snapshot sees it. The duplicate wins.
        SELECT true, pc.stream_id, pc.first_version, pc.last_version, pc.last_tx,
               pc.last_position
        INTO duplicate, stream_id, first_version, last_version, last_tx, last_position
        FROM processed_commands AS pc
        WHERE pc.workspace_id = p_workspace_id AND pc.command_id = p_command_id;
        IF FOUND THEN
            RETURN;
        END IF;
        IF head_workspace IS DISTINCT FROM p_workspace_id AND head_workspace IS NOT NULL THEN
            RAISE EXCEPTION 'stream belongs to another workspace' USING ERRCODE = 'SV403';
        END IF;
        RAISE EXCEPTION 'stream moved past the expected version' USING ERRCODE = 'SV409';
    END IF;

    IF event_count = 1 THEN  -- a plain expression, no query
        positions := ARRAY[nextval('events_position_seq')];
    ELSE
        positions := ARRAY(
            SELECT nextval('events_position_seq') AS p FROM generate_series(1, event_count)
            ORDER BY p
        );
    END IF;
    duplicate := false;
    stream_id := p_stream_id;
    first_version := head_version + 1;
    last_version := head_version + event_count;
    last_tx := pg_current_xact_id();
    last_position := positions[event_count];

    INSERT INTO processed_commands AS pc
        (workspace_id, command_id, stream_id, first_version, last_version, last_tx,
         last_position)
    VALUES (p_workspace_id, p_command_id, p_stream_id, first_version, last_version, last_tx,
            last_position)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN  -- the same command committed while we waited on its ledger row
        SELECT true, pc.stream_id, pc.first_version, pc.last_version, pc.last_tx,
               pc.last_position
        INTO duplicate, stream_id, first_version, last_version, last_tx, last_position
        FROM processed_commands AS pc
        WHERE pc.workspace_id = p_workspace_id AND pc.command_id = p_command_id;
        RETURN;
    END IF;

    IF event_count = 1 THEN  -- the common case, without the unnest
        INSERT INTO events AS e
            (position, stream_id, version, event_id, workspace_id, type, schema_version,
             data, metadata)
        OVERRIDING SYSTEM VALUE
        VALUES (positions[1], p_stream_id, first_version, p_event_ids[1], p_workspace_id,
                p_types[1], p_schema_versions[1], p_datas[1], p_metadatas[1]);
    ELSE
        INSERT INTO events AS e
            (position, stream_id, version, event_id, workspace_id, type, schema_version,
             data, metadata)
        OVERRIDING SYSTEM VALUE
        SELECT positions[u.ord], p_stream_id, head_version + u.ord, u.event_id,
               p_workspace_id, u.type, u.schema_version, u.data, u.metadata
        FROM unnest(p_event_ids, p_types, p_schema_versions, p_datas, p_metadatas)
             WITH ORDINALITY AS u(event_id, type, schema_version, data, metadata, ord);
    END IF;
END
$fn$;

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
-- Scopes the lock timeout svc_bound_lock_waits() sets to this call (see above).
SET lock_timeout = 0
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
    PERFORM svc_bound_lock_waits();
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
