-- Read models built by projections/ from the global log, and their checkpoints.
--
-- Tenancy (ARCHITECTURE.md decision 6): every read-model row carries workspace_id, and row-level
-- security limits a session to the workspace named by `SET LOCAL svc.workspace_id`. The
-- projector writes as the table owner, which RLS does not restrict (no FORCE ROW LEVEL
-- SECURITY): the projector is the only writer and must see every workspace. Reads for a tenant
-- run as svc_reader (`Database.scoped`), which only has SELECT and is always filtered. Without
-- the setting, current_setting(..., true) is NULL and the policy matches no row at all.
--
-- Every statement is idempotent: this file may be applied again on every start.

DO $$
BEGIN
    -- Normally created by the event store's migrations; repeated here so that this file does
    -- not depend on their order.
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'svc_reader') THEN
        BEGIN
            CREATE ROLE svc_reader NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

-- Not workspace-scoped: one row per projector. (tx, position) is the last event the projector
-- has consumed, in the gap-free order of the log (eventstore/reads.py). It moves in the same
-- transaction as the read-model rows it accounts for (see projections/runner.py).
CREATE TABLE IF NOT EXISTS projection_checkpoints (
    name       text PRIMARY KEY,
    tx         xid8 NOT NULL DEFAULT '0',
    position   bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS workspaces (
    id           text PRIMARY KEY,
    workspace_id text NOT NULL,
    name         text NOT NULL,
    created_at   timestamptz NOT NULL,
    CHECK (workspace_id = id)
);

CREATE TABLE IF NOT EXISTS conversations (
    workspace_id  text NOT NULL,
    id            text NOT NULL,
    title         text,
    project_id    text,
    folder        text,
    tags          text[] NOT NULL DEFAULT '{}',
    agent         text,
    model         text,
    created_at    timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL,
    message_count integer NOT NULL DEFAULT 0,
    deleted       boolean NOT NULL DEFAULT false,
    PRIMARY KEY (workspace_id, id)
);
CREATE INDEX IF NOT EXISTS conversations_ws_updated
    ON conversations (workspace_id, updated_at DESC, id);

-- seq is dense per conversation (1, 2, 3...) in log order: the order the operator saw.
CREATE TABLE IF NOT EXISTS messages (
    workspace_id    text NOT NULL,
    conversation_id text NOT NULL,
    seq             integer NOT NULL,
    message_id      text NOT NULL,
    role            text NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content         text NOT NULL,
    name            text,
    turn_id         text,
    created_at      timestamptz NOT NULL,
    PRIMARY KEY (workspace_id, conversation_id, seq),
    UNIQUE (workspace_id, message_id)
);

-- status: 'running' (TurnStarted seen), 'completed' (assistant message recorded) or 'failed'.
CREATE TABLE IF NOT EXISTS turns (
    workspace_id      text NOT NULL,
    turn_id           text NOT NULL,
    conversation_id   text NOT NULL,
    status            text NOT NULL CHECK (status IN ('running', 'completed', 'failed')),
    model             text,
    prompt_tokens     integer,
    completion_tokens integer,
    total_tokens      integer,
    duration_ms       integer,
    error_code        text,
    error_message     text,
    started_at        timestamptz,
    finished_at       timestamptz,
    command_id        text,
    PRIMARY KEY (workspace_id, turn_id)
);
CREATE INDEX IF NOT EXISTS turns_ws_conversation
    ON turns (workspace_id, conversation_id, started_at DESC);
CREATE INDEX IF NOT EXISTS turns_ws_started ON turns (workspace_id, started_at);

-- Only the sha256 of a key is kept; the key itself is shown once at issue and never stored.
CREATE TABLE IF NOT EXISTS api_keys (
    workspace_id   text NOT NULL,
    key_id         text NOT NULL,
    name           text NOT NULL,
    key_hash       text NOT NULL UNIQUE,
    prefix         text NOT NULL,
    scopes         text[] NOT NULL,
    rate_limit_rpm integer,
    created_at     timestamptz NOT NULL,
    expires_at     timestamptz,
    revoked_at     timestamptz,
    PRIMARY KEY (workspace_id, key_id)
);

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['workspaces', 'conversations', 'messages', 'turns', 'api_keys']
    LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('DROP POLICY IF EXISTS workspace_isolation ON %I', t);
        EXECUTE format(
            'CREATE POLICY workspace_isolation ON %I '
            'USING (workspace_id = current_setting(''svc.workspace_id'', true))', t);
        IF t <> 'api_keys' THEN
            EXECUTE format('GRANT SELECT ON %I TO svc_reader', t);
        END IF;
    END LOOP;
END
$$;

-- A tenant session may list its keys but never read their hashes: the hash is the lookup key
-- of authentication (projections.queries.find_api_key_by_hash runs as the service role).
REVOKE SELECT ON api_keys FROM svc_reader;
GRANT SELECT (workspace_id, key_id, name, prefix, scopes, rate_limit_rpm, created_at,
              expires_at, revoked_at) ON api_keys TO svc_reader;
