-- The primary key of `events` becomes (tx, position), the order every log read follows, in
-- place of `position` alone: one B-tree fewer to update on every event appended. Nothing
-- looks an event up by its position alone (readers page by (tx, position), streams by
-- (stream_id, version)), and positions stay unique because they come from one sequence.
-- Measured on the 2-core machine, batches of 10 events at 32 writers, eight alternated pairs:
-- 39,000 -> 41,300 events/s (docs/performance.md, session 5).
--
-- The read index keeps its name, which plans and tests refer to. On an existing log the
-- unique index is built under a SHARE lock: appends wait while it builds, reads go on.
CREATE UNIQUE INDEX events_tx_position_unique ON events (tx, position);
DROP INDEX events_tx_position;
ALTER TABLE events DROP CONSTRAINT events_pkey;
ALTER TABLE events
    ADD CONSTRAINT events_tx_position PRIMARY KEY USING INDEX events_tx_position_unique;
