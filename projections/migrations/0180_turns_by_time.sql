-- A workspace's turns newest first, and a window of them, without reading all of them.
-- The turn list (GET /v1/admin/conversations/turns) and analytics order and filter by a
-- turn's time, its start or (for a turn that failed before it started) its finish: no index
-- served that, so both read and sorted every turn the workspace ever had, per request.
--
-- Two indexes instead of one on the expression coalesce(started_at, finished_at): a turn's
-- completion sets finished_at, and an index over an expression of it would make every
-- completion update every index of the table (no heap-only update); started_at never
-- changes after TurnStarted. The turns that never started are few, and have their own
-- partial index. projections/queries.py reads the two and merges them.
-- Building them takes a SHARE lock: reads of `turns` go on, its projection waits.

CREATE INDEX IF NOT EXISTS turns_ws_started_at ON turns (workspace_id, started_at DESC, turn_id);
CREATE INDEX IF NOT EXISTS turns_ws_unstarted ON turns (workspace_id, finished_at DESC, turn_id)
    WHERE started_at IS NULL;
