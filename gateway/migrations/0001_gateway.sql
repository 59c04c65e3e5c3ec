-- Gateway tables: per-key rate-limit windows and secret instance-setting values.

-- One row per key and fixed window. The window is the epoch-aligned minute (window_start is
-- `now()` of the database truncated to the minute), so every gateway process sharing this
-- database counts into the same row: one atomic INSERT ... ON CONFLICT DO UPDATE ... RETURNING
-- per request makes the limit exact under concurrency and across processes.
CREATE TABLE IF NOT EXISTS rate_limit_windows (
    key_id       text NOT NULL,
    window_start timestamptz NOT NULL,
    count        integer NOT NULL,
    PRIMARY KEY (key_id, window_start)
);
CREATE INDEX IF NOT EXISTS rate_limit_windows_start ON rate_limit_windows (window_start);

-- Secret instance settings (schemas/settings.py): the settings stream records only a marker,
-- the value lives here, outside the append-only log, so that deleting it really deletes it.
CREATE TABLE IF NOT EXISTS instance_secrets (
    key        text PRIMARY KEY,
    value      text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
