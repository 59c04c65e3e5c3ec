-- Identity secrets kept outside the append-only log (gateway/identity/vault.py): password
-- hashes (scrypt), TOTP seeds, the OAuth signing key and the LDAP bind password. The log only
-- records that they changed (schemas/identity.py), so deleting a row really deletes the secret.
-- `workspace_id` is '*' for instance-wide secrets. Never granted to svc_reader.
CREATE TABLE IF NOT EXISTS identity_secrets (
    workspace_id text NOT NULL,
    subject      text NOT NULL,
    kind         text NOT NULL,
    value        text NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, subject, kind)
);
REVOKE ALL ON identity_secrets FROM PUBLIC;

-- SAML service-provider state shared by every gateway process: outstanding AuthnRequest ids
-- (kind 'request', consumed by the response that answers them) and the ids of assertions
-- already used (kind 'assertion', kept until they expire), so a response cannot be replayed.
CREATE TABLE IF NOT EXISTS identity_saml_state (
    kind       text NOT NULL CHECK (kind IN ('request', 'assertion')),
    id         text NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (kind, id)
);
CREATE INDEX IF NOT EXISTS identity_saml_state_expiry ON identity_saml_state (expires_at);
REVOKE ALL ON identity_saml_state FROM PUBLIC;
