-- A workspace's turns newest first, and a window of them, without reading all of them.
-- The turn list (GET /v1/admin/conversations/turns) and analytics order and filter by a
-- turn's time, its start or (for a turn that failed before it started) its finish: no index
-- served that, so both read and sorted every turn the workspace ever had, per request.
--
-- No index names finished_at, nor an expression of it: a turn's completion sets it, and an
-- update of a column any index uses (as a key, in an expression or in a partial index's
-- predicate) is never heap-only, so every completion would update every index of the table.
-- started_at never changes after TurnStarted. The turns that never started are few: a
-- partial index finds them by workspace, and the queries sort them by their finish
-- themselves. projections/queries.py reads the two and merges them.
-- Building them takes a SHARE lock: reads of `turns` go on, and writes to it (its projection)
-- wait; on a large table, build them while the service is stopped (docs/operations.md).

CREATE INDEX IF NOT EXISTS turns_ws_started_at ON turns (workspace_id, started_at DESC, turn_id);
CREATE INDEX IF NOT EXISTS turns_ws_unstarted ON turns (workspace_id) WHERE started_at IS NULL;
