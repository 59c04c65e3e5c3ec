-- The last TOTP time step each user has used, shared by every gateway process. A code is
-- accepted only for a step later than this one (RFC 6238 section 5.2: a verifier must not
-- accept the same code twice), so a code seen by one process cannot be replayed on another,
-- and an older code is refused once a newer one was used. One row per user, moved forward by
-- a conditional upsert: two processes checking the same code at once accept it once.
CREATE TABLE IF NOT EXISTS identity_totp_last_step (
    workspace_id text NOT NULL,
    user_id      text NOT NULL,
    last_step    bigint NOT NULL,
    PRIMARY KEY (workspace_id, user_id)
);
REVOKE ALL ON identity_totp_last_step FROM PUBLIC;
