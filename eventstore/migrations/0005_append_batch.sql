-- svc_append_batch: several independent appends (any streams, any workspaces) in one statement
-- and one transaction, so appends that arrive while others are in flight share one round trip
-- and one durable commit (eventstore/coalescer.py). ARCHITECTURE.md decision 2 still holds per
-- item: each item is exactly `svc_append` (migration 0004), run inside its own subtransaction.
--
-- Invariants (eventstore/store.py relies on each of them):
-- * Items are independent: an item that fails (version conflict, foreign stream, unique
--   violation, lock wait cancelled) rolls back its own subtransaction only, releasing its claim
--   and its locks, and is reported with its SQLSTATE and constraint; the other items go on.
-- * Items run in array order, so two items of one stream, or a repeated command id, behave as
--   two consecutive appends would: the second sees the first's rows (same transaction).
-- * All successful items commit together or not at all: the caller acknowledges none of them
--   before the statement (its implicit transaction) has committed.
-- * `tx` is the top-level transaction id (pg_current_xact_id() in a subtransaction returns it),
--   so gap-free readers (decision 3) see the whole batch at once.
-- * Each item takes one subtransaction id; the caller keeps a batch under 64 items so the
--   backend's subxid cache never overflows (an overflow slows every other backend's snapshots).
CREATE OR REPLACE FUNCTION svc_append_batch(
    p_workspace_ids    text[],
    p_command_ids      text[],
    p_stream_ids       text[],
    p_expected         bigint[],
    p_counts           int[],
    p_event_ids        uuid[],
    p_types            text[],
    p_schema_versions  int2[],
    p_datas            jsonb[],
    p_metadatas        jsonb[]
)
RETURNS TABLE (
    item            int,
    error_state     text,
    error_constraint text,
    duplicate       boolean,
    stream_id       text,
    first_version   integer,
    last_version    integer,
    last_tx         xid8,
    last_position   bigint
)
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    first_event int := 1;
    last_event  int;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_stream_ids, 1), 0) LOOP
        item := i;
        last_event := first_event + p_counts[i] - 1;
        error_state := NULL;
        error_constraint := NULL;
        BEGIN
            SELECT a.duplicate, a.stream_id, a.first_version, a.last_version, a.last_tx,
                   a.last_position
            INTO duplicate, stream_id, first_version, last_version, last_tx, last_position
            FROM svc_append(
                p_workspace_ids[i], p_command_ids[i], p_stream_ids[i], p_expected[i],
                p_event_ids[first_event:last_event], p_types[first_event:last_event],
                p_schema_versions[first_event:last_event], p_datas[first_event:last_event],
                p_metadatas[first_event:last_event]
            ) AS a;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS error_state = RETURNED_SQLSTATE,
                                    error_constraint = CONSTRAINT_NAME;
            duplicate := NULL;
            stream_id := p_stream_ids[i];
            first_version := NULL;
            last_version := NULL;
            last_tx := NULL;
            last_position := NULL;
        END;
        first_event := last_event + 1;
        RETURN NEXT;
    END LOOP;
END
$fn$;

REVOKE ALL ON FUNCTION svc_append_batch(text[], text[], text[], bigint[], int[], uuid[], text[],
                                        int2[], jsonb[], jsonb[]) FROM PUBLIC;
