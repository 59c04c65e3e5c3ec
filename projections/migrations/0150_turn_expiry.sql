-- Each turn's recorded expiry (TurnStarted.expires_at: actors/conversation.py, turn_lifetime),
-- for the gateways' sweep of abandoned turns (gateway/turn_sweep.py), which picks running
-- turns by the expiry each recorded, not by their age under the budget in force now.
--
-- expires_at is 'infinity' for a turn that never expires (its call had no time limit) and
-- NULL for a turn recorded before turns carried an expiry: the sweep judges those by their
-- start and the budget in force, as the conversation does.
--
-- The index replaces turns_ws_started, which only the sweep used: one probe finds the turns
-- that expired in a window, and (expires_at NULL, started_at) the old turns by start. Neither
-- column changes after TurnStarted, so a turn's completion stays a heap-only update.

ALTER TABLE turns ADD COLUMN IF NOT EXISTS expires_at timestamptz;
CREATE INDEX IF NOT EXISTS turns_ws_expiry ON turns (workspace_id, expires_at, started_at);
DROP INDEX IF EXISTS turns_ws_started;

-- Turns still running when this runs take their expiry from their TurnStarted (one probe of
-- the stream's index each); finished turns do not need one.
UPDATE turns AS t
SET expires_at = CASE
    WHEN (e.data ->> 'never_expires')::boolean THEN 'infinity'::timestamptz
    ELSE (e.data ->> 'expires_at')::timestamptz
END
FROM events AS e
WHERE t.status = 'running'
  AND e.stream_id = 'conversation:' || t.conversation_id
  AND e.type = 'conversation.turn_started'
  AND e.data ->> 'turn_id' = t.turn_id;
