-- Read model `agents` (projections/agents.py): every agent of every workspace, archived ones
-- included (archived = true). gateway/chat.py resolves a chat request's `model` against the
-- active agents' names; the admin API lists and reads them.
--
-- Names are unique among a workspace's active agents, but the admin API enforces that before
-- it asks the agent actor (gateway/admin_agents.py): a projector must never fail on a row the
-- log already holds, so the index below is not UNIQUE.
--
-- Tenancy and roles as in 0001_read_models.sql. Every statement is idempotent.

CREATE TABLE IF NOT EXISTS agents (
    workspace_id  text NOT NULL,
    agent_id      text NOT NULL,
    name          text NOT NULL,
    description   text NOT NULL DEFAULT '',
    model         text NOT NULL,
    system_prompt text NOT NULL DEFAULT '',
    parameters    jsonb NOT NULL DEFAULT '{}',
    archived      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL,
    archived_at   timestamptz,
    PRIMARY KEY (workspace_id, agent_id)
);
CREATE INDEX IF NOT EXISTS agents_ws_active_name ON agents (workspace_id, name) WHERE NOT archived;

ALTER TABLE agents ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS workspace_isolation ON agents;
CREATE POLICY workspace_isolation ON agents
    USING (workspace_id = current_setting('svc.workspace_id', true));
GRANT SELECT ON agents TO svc_reader;
