-- Identity read models (projections/identity.py): users, role bindings, custom roles, admin
-- sessions, SCIM tokens, OAuth clients and the security audit log.
--
-- Same tenancy rules as 0001_read_models.sql: every row carries workspace_id, row-level
-- security limits svc_reader to `svc.workspace_id`, the projector writes as the owner. Hash
-- columns (session tokens, SCIM tokens, OAuth client secrets) are never granted to svc_reader:
-- lookups by hash run as the service role (projections/identity_queries.py), like API keys.

CREATE TABLE IF NOT EXISTS identity_users (
    workspace_id   text NOT NULL,
    user_id        text NOT NULL,
    user_name      text NOT NULL,
    display_name   text,
    given_name     text,
    family_name    text,
    emails         jsonb NOT NULL DEFAULT '[]',
    external_id    text,
    active         boolean DEFAULT true,  -- NULL: not stated; only false disables
    source         text NOT NULL,
    has_password   boolean NOT NULL DEFAULT false,
    totp_enrolled  boolean NOT NULL DEFAULT false,
    deleted        boolean NOT NULL DEFAULT false,
    version        integer NOT NULL DEFAULT 1,
    created_at     timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL,
    PRIMARY KEY (workspace_id, user_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS identity_users_name
    ON identity_users (workspace_id, lower(user_name)) WHERE NOT deleted;
CREATE INDEX IF NOT EXISTS identity_users_external
    ON identity_users (workspace_id, external_id) WHERE external_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS identity_role_bindings (
    workspace_id text NOT NULL,
    user_id      text NOT NULL,
    role         text NOT NULL,
    bound_at     timestamptz NOT NULL,
    PRIMARY KEY (workspace_id, user_id, role)
);

-- API keys issued to a user (the keys themselves are in api_keys): revoked with the user, and
-- refused at once while the user is deactivated or deprovisioned (gateway/identity/authn.py).
CREATE TABLE IF NOT EXISTS identity_user_api_keys (
    workspace_id text NOT NULL,
    key_id       text NOT NULL,
    user_id      text NOT NULL,
    linked_at    timestamptz NOT NULL,
    PRIMARY KEY (workspace_id, key_id)
);
CREATE INDEX IF NOT EXISTS identity_user_api_keys_key ON identity_user_api_keys (key_id);

CREATE TABLE IF NOT EXISTS identity_custom_roles (
    workspace_id text NOT NULL,
    role         text NOT NULL,
    permissions  jsonb NOT NULL,
    defined_at   timestamptz NOT NULL,
    PRIMARY KEY (workspace_id, role)
);

CREATE TABLE IF NOT EXISTS identity_sessions (
    workspace_id  text NOT NULL,
    session_id    text NOT NULL,
    user_id       text NOT NULL,
    token_hash    text NOT NULL UNIQUE,
    method        text NOT NULL,
    second_factor boolean NOT NULL,
    created_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    revoked_at    timestamptz,
    revoke_reason text,
    PRIMARY KEY (workspace_id, session_id)
);
CREATE INDEX IF NOT EXISTS identity_sessions_user ON identity_sessions (workspace_id, user_id);

CREATE TABLE IF NOT EXISTS identity_scim_tokens (
    workspace_id text NOT NULL,
    token_id     text NOT NULL,
    token_hash   text NOT NULL UNIQUE,
    prefix       text NOT NULL,
    issued_at    timestamptz NOT NULL,
    revoked_at   timestamptz,
    PRIMARY KEY (workspace_id, token_id)
);

CREATE TABLE IF NOT EXISTS identity_oauth_clients (
    workspace_id text NOT NULL,
    client_id    text NOT NULL UNIQUE,
    name         text NOT NULL,
    secret_hash  text NOT NULL,
    scopes       text[] NOT NULL,
    created_at   timestamptz NOT NULL,
    revoked_at   timestamptz,
    PRIMARY KEY (workspace_id, client_id)
);

-- One row per identity or security event, keyed by its log position. Pruned by age when
-- SVC_AUDIT_RETENTION_DAYS > 0 (the events themselves stay in the append-only log).
CREATE TABLE IF NOT EXISTS identity_audit_log (
    workspace_id text NOT NULL,
    position     bigint NOT NULL,
    at           timestamptz NOT NULL,
    action       text NOT NULL,
    user_id      text,
    user_name    text,
    client_ip    text,
    detail       jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (workspace_id, position)
);
CREATE INDEX IF NOT EXISTS identity_audit_log_at ON identity_audit_log (workspace_id, at DESC);
CREATE INDEX IF NOT EXISTS identity_audit_log_age ON identity_audit_log (at);

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['identity_users', 'identity_role_bindings', 'identity_custom_roles',
                             'identity_user_api_keys',
                             'identity_sessions', 'identity_scim_tokens', 'identity_oauth_clients',
                             'identity_audit_log']
    LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('DROP POLICY IF EXISTS workspace_isolation ON %I', t);
        EXECUTE format(
            'CREATE POLICY workspace_isolation ON %I '
            'USING (workspace_id = current_setting(''svc.workspace_id'', true))', t);
        EXECUTE format('REVOKE ALL ON %I FROM svc_reader', t);
    END LOOP;
END
$$;

GRANT SELECT ON identity_users, identity_role_bindings, identity_custom_roles,
                identity_user_api_keys, identity_audit_log TO svc_reader;
GRANT SELECT (workspace_id, session_id, user_id, method, second_factor, created_at, expires_at,
              revoked_at, revoke_reason) ON identity_sessions TO svc_reader;
GRANT SELECT (workspace_id, token_id, prefix, issued_at, revoked_at)
    ON identity_scim_tokens TO svc_reader;
GRANT SELECT (workspace_id, client_id, name, scopes, created_at, revoked_at)
    ON identity_oauth_clients TO svc_reader;
