-- The append-only log, the processed-commands ledger and snapshots.
-- Readers tail the log by (tx, position) below the oldest running transaction's xid
-- (ARCHITECTURE.md decision 3); `position` alone is not safe to tail because
-- transactions commit out of order.

CREATE TABLE IF NOT EXISTS events (
    position       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tx             xid8 NOT NULL DEFAULT pg_current_xact_id(),
    stream_id      text NOT NULL,
    version        integer NOT NULL CHECK (version > 0),
    event_id       uuid NOT NULL UNIQUE,
    workspace_id   text NOT NULL,
    type           text NOT NULL,
    schema_version smallint NOT NULL DEFAULT 1,
    data           jsonb NOT NULL,
    metadata       jsonb NOT NULL DEFAULT '{}'::jsonb,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    -- The single-writer fence: a second writer of the same version fails here.
    CONSTRAINT events_stream_version UNIQUE (stream_id, version)
);
CREATE INDEX IF NOT EXISTS events_tx_position ON events (tx, position);
CREATE INDEX IF NOT EXISTS events_ws_tx_position ON events (workspace_id, tx, position);

-- Idempotency ledger: one row per processed command, written in the append's transaction.
CREATE TABLE IF NOT EXISTS processed_commands (
    workspace_id   text NOT NULL,
    command_id     text NOT NULL,
    stream_id      text NOT NULL,
    first_version  integer NOT NULL,
    last_version   integer NOT NULL,
    last_tx        xid8 NOT NULL DEFAULT pg_current_xact_id(),
    last_position  bigint NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, command_id)
);

CREATE TABLE IF NOT EXISTS snapshots (
    stream_id      text PRIMARY KEY,
    version        integer NOT NULL,
    schema_version smallint NOT NULL,
    state          jsonb NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now()
);
