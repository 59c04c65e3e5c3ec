-- The index of the sweep of abandoned turns (gateway/turn_sweep.py; the column: 0150). It
-- replaces turns_ws_started, which only the sweep used: one probe finds the turns that expired
-- in a window, and (expires_at NULL, started_at) the turns from before expiries by start.
-- Neither column changes after TurnStarted, so a turn's completion stays a heap-only update.
-- Building it takes a SHARE lock: reads of `turns` go on, its projection waits.

CREATE INDEX IF NOT EXISTS turns_ws_expiry ON turns (workspace_id, expires_at, started_at);
DROP INDEX IF EXISTS turns_ws_started;

-- Turns still running when this runs take their expiry from their TurnStarted: one probe of
-- the stream's (stream_id, version) index per running turn; finished turns need none.
UPDATE turns AS t
SET expires_at = (
    SELECT CASE
        WHEN (e.data ->> 'never_expires')::boolean THEN 'infinity'::timestamptz
        ELSE (e.data ->> 'expires_at')::timestamptz
    END
    FROM events AS e
    WHERE e.stream_id = 'conversation:' || t.conversation_id
      AND e.workspace_id = t.workspace_id
      AND e.type = 'conversation.turn_started'
      AND e.data ->> 'turn_id' = t.turn_id
    LIMIT 1
)
WHERE t.status = 'running' AND t.expires_at IS NULL;
