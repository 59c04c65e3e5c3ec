"""Identity read models (projections/migrations/0100_identity.sql).

`identity_users`, `identity_role_bindings`, `identity_custom_roles`, `identity_sessions`,
`identity_scim_tokens`, `identity_oauth_clients` for lookups, and `identity_audit_log`: one
row per identity or security event (API keys issued and revoked included), without hashes.
Deprovisioning or deactivating a user revokes their sessions here too, but authentication does
not rely on that alone: every session lookup joins the user's row and requires it active.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.events import Event
from schemas.identity import (
    CustomRoleDefined,
    LoginFailed,
    LoginSucceeded,
    OAuthClientRegistered,
    OAuthClientRevoked,
    PasswordSet,
    RoleBound,
    RoleUnbound,
    ScimTokenIssued,
    ScimTokenRevoked,
    ScimTokenRotated,
    SessionRevoked,
    SessionStarted,
    SsoSecretSet,
    TotpEnrolled,
    TotpReset,
    UserApiKeyLinked,
    UserDeprovisioned,
    UserProfile,
    UserProvisioned,
    UserUpdated,
    user_name_key,
)
from schemas.workspace import ApiKeyIssued, ApiKeyRevoked

_NEVER_AUDITED = frozenset({"token_hash", "secret_hash", "key_hash", "workspace_id", "at"})

_UPSERT_USER = """
INSERT INTO identity_users (workspace_id, user_id, user_name, display_name, given_name,
                            family_name, emails, external_id, active, name_key, source,
                            created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $12)
"""

_UPDATE_USER = """
UPDATE identity_users SET user_name = $3, display_name = $4, given_name = $5, family_name = $6,
       emails = $7, external_id = $8, active = $9, name_key = $10,
       updated_at = greatest(updated_at, $11),
       version = version + 1
WHERE workspace_id = $1 AND user_id = $2
"""

_REVOKE_USER_SESSIONS = """
UPDATE identity_sessions SET revoked_at = $3
WHERE workspace_id = $1 AND user_id = $2 AND revoked_at IS NULL
"""
"""A deactivated or deprovisioned user's sessions end at once, before each session's own
revocation is recorded: revoked with no reason until that `identity.session_revoked`
gives it (`user_session_ids` finds the sessions still to record by that)."""


def _profile_args(p: UserProfile) -> tuple[Any, ...]:
    emails = [e.model_dump(mode="json", exclude_none=True) for e in p.emails]
    return (
        p.user_name,
        p.display_name,
        p.given_name,
        p.family_name,
        emails,
        p.external_id,
        p.active,
        user_name_key(p.user_name),
    )


def _audit_detail(ev: Event) -> dict[str, Any]:
    data = ev.model_dump(mode="json", exclude=set(_NEVER_AUDITED))
    profile = data.pop("profile", None)
    if isinstance(profile, dict):
        data["user_name"] = profile.get("user_name")
        data["active"] = profile.get("active")
    return {k: v for k, v in data.items() if v is not None}


class IdentityProjector(Projector):
    name: ClassVar[str] = "identity"
    tables: ClassVar[tuple[str, ...]] = (
        "identity_users",
        "identity_role_bindings",
        "identity_user_api_keys",
        "identity_custom_roles",
        "identity_sessions",
        "identity_scim_tokens",
        "identity_oauth_clients",
        "identity_audit_log",
    )

    def handlers(self) -> dict[type[Event], Handler]:
        return {
            UserProvisioned: self._provisioned,
            UserUpdated: self._updated,
            UserDeprovisioned: self._deprovisioned,
            RoleBound: self._bound,
            RoleUnbound: self._unbound,
            CustomRoleDefined: self._role_defined,
            PasswordSet: self._password,
            TotpEnrolled: self._totp,
            TotpReset: self._totp,
            UserApiKeyLinked: self._key_linked,
            ScimTokenIssued: self._scim_issued,
            ScimTokenRotated: self._scim_rotated,
            ScimTokenRevoked: self._scim_revoked,
            OAuthClientRegistered: self._client_registered,
            OAuthClientRevoked: self._client_revoked,
            SessionStarted: self._session_started,
            SessionRevoked: self._session_revoked,
            LoginSucceeded: self._audit_only,
            LoginFailed: self._audit_only,
            ApiKeyIssued: self._audit_only,
            ApiKeyRevoked: self._audit_only,
            SsoSecretSet: self._audit_only,
        }

    NOT_AUDITED: ClassVar[tuple[type[Event], ...]] = (SessionStarted,)
    """Handled without an audit entry: a session's start is its login_succeeded entry."""

    def audited_actions(self) -> frozenset[str]:
        """The actions the audit log can hold: the event types written to it."""
        return frozenset(cls.type_name for cls in self.handlers() if cls not in self.NOT_AUDITED)

    async def _audit(self, conn: Connection, rec: RecordedEvent, ev: Event) -> None:
        detail = _audit_detail(ev)
        at = getattr(ev, "at", rec.recorded_at)
        await conn.execute(
            """
            INSERT INTO identity_audit_log (workspace_id, position, at, action, user_id,
                                            user_name, client_ip, detail)
            VALUES ($1, $2, $3, $4, $5,
                    -- An event that names the user by id only (a role bound, TOTP reset) is
                    -- listed with the name the user had then, as the others are.
                    coalesce($6, (SELECT u.user_name FROM identity_users u
                                  WHERE u.workspace_id = $1 AND u.user_id = $5)),
                    $7, $8)
            """,
            rec.workspace_id,
            rec.position,
            at,
            rec.type,
            detail.get("user_id"),
            detail.get("user_name"),
            detail.get("client_ip"),
            orjson.loads(orjson.dumps(detail)),
        )

    async def _audit_only(self, conn: Connection, rec: RecordedEvent, ev: Event) -> None:
        await self._audit(conn, rec, ev)

    async def _provisioned(self, conn: Connection, rec: RecordedEvent, ev: UserProvisioned) -> None:
        await conn.execute(
            _UPSERT_USER, rec.workspace_id, ev.user_id, *_profile_args(ev.profile), ev.source, ev.at
        )
        await self._audit(conn, rec, ev)

    async def _updated(self, conn: Connection, rec: RecordedEvent, ev: UserUpdated) -> None:
        await conn.execute(
            _UPDATE_USER, rec.workspace_id, ev.user_id, *_profile_args(ev.profile), ev.at
        )
        if ev.profile.active is False:
            await conn.execute(_REVOKE_USER_SESSIONS, rec.workspace_id, ev.user_id, ev.at)
        await self._audit(conn, rec, ev)

    async def _deprovisioned(
        self, conn: Connection, rec: RecordedEvent, ev: UserDeprovisioned
    ) -> None:
        await conn.execute(
            """
            UPDATE identity_users SET deleted = true, active = false,
                   updated_at = greatest(updated_at, $3),
                   version = version + 1
            WHERE workspace_id = $1 AND user_id = $2
            """,
            rec.workspace_id,
            ev.user_id,
            ev.at,
        )
        await conn.execute(
            "DELETE FROM identity_role_bindings WHERE workspace_id = $1 AND user_id = $2",
            rec.workspace_id,
            ev.user_id,
        )
        await conn.execute(_REVOKE_USER_SESSIONS, rec.workspace_id, ev.user_id, ev.at)
        await self._audit(conn, rec, ev)

    async def _bound(self, conn: Connection, rec: RecordedEvent, ev: RoleBound) -> None:
        await conn.execute(
            """
            INSERT INTO identity_role_bindings (workspace_id, user_id, role, bound_at)
            VALUES ($1, $2, $3, $4)
            """,
            rec.workspace_id,
            ev.user_id,
            ev.role,
            ev.at,
        )
        await self._touch(conn, rec.workspace_id, ev.user_id, ev)
        await self._audit(conn, rec, ev)

    async def _unbound(self, conn: Connection, rec: RecordedEvent, ev: RoleUnbound) -> None:
        await conn.execute(
            "DELETE FROM identity_role_bindings WHERE workspace_id = $1 AND user_id = $2 "
            "AND role = $3",
            rec.workspace_id,
            ev.user_id,
            ev.role,
        )
        await self._touch(conn, rec.workspace_id, ev.user_id, ev)
        await self._audit(conn, rec, ev)

    async def _touch(
        self, conn: Connection, workspace_id: str, user_id: str, ev: RoleBound | RoleUnbound
    ) -> None:
        await conn.execute(
            "UPDATE identity_users SET updated_at = greatest(updated_at, $3), "
            "version = version + 1 WHERE workspace_id = $1 AND user_id = $2",
            workspace_id,
            user_id,
            ev.at,
        )

    async def _role_defined(
        self, conn: Connection, rec: RecordedEvent, ev: CustomRoleDefined
    ) -> None:
        await conn.execute(
            """
            INSERT INTO identity_custom_roles (workspace_id, role, permissions, defined_at)
            VALUES ($1, $2, $3, $4)
            ON CONFLICT (workspace_id, role) DO UPDATE
                SET permissions = EXCLUDED.permissions, defined_at = EXCLUDED.defined_at
            """,
            rec.workspace_id,
            ev.role,
            dict(ev.permissions),
            ev.at,
        )
        await self._audit(conn, rec, ev)

    async def _password(self, conn: Connection, rec: RecordedEvent, ev: PasswordSet) -> None:
        await conn.execute(
            "UPDATE identity_users SET has_password = true "
            "WHERE workspace_id = $1 AND user_id = $2",
            rec.workspace_id,
            ev.user_id,
        )
        await self._audit(conn, rec, ev)

    async def _key_linked(self, conn: Connection, rec: RecordedEvent, ev: UserApiKeyLinked) -> None:
        await conn.execute(
            """
            INSERT INTO identity_user_api_keys (workspace_id, key_id, user_id, linked_at)
            VALUES ($1, $2, $3, $4)
            """,
            rec.workspace_id,
            ev.key_id,
            ev.user_id,
            ev.at,
        )
        await self._audit(conn, rec, ev)

    async def _totp(
        self, conn: Connection, rec: RecordedEvent, ev: TotpEnrolled | TotpReset
    ) -> None:
        await conn.execute(
            "UPDATE identity_users SET totp_enrolled = $3 WHERE workspace_id = $1 AND user_id = $2",
            rec.workspace_id,
            ev.user_id,
            isinstance(ev, TotpEnrolled),
        )
        await self._audit(conn, rec, ev)

    async def _insert_token(
        self, conn: Connection, rec: RecordedEvent, ev: ScimTokenIssued | ScimTokenRotated
    ) -> None:
        await conn.execute(
            """
            INSERT INTO identity_scim_tokens (workspace_id, token_id, token_hash, prefix, issued_at)
            VALUES ($1, $2, $3, $4, $5)
            """,
            rec.workspace_id,
            ev.token_id,
            ev.token_hash,
            ev.prefix,
            ev.at,
        )

    async def _revoke_token(
        self, conn: Connection, workspace_id: str, token_id: str, ev: Event, at: Any
    ) -> None:
        await conn.execute(
            "UPDATE identity_scim_tokens SET revoked_at = coalesce(revoked_at, $3) "
            "WHERE workspace_id = $1 AND token_id = $2",
            workspace_id,
            token_id,
            at,
        )

    async def _scim_issued(self, conn: Connection, rec: RecordedEvent, ev: ScimTokenIssued) -> None:
        await self._insert_token(conn, rec, ev)
        await self._audit(conn, rec, ev)

    async def _scim_rotated(
        self, conn: Connection, rec: RecordedEvent, ev: ScimTokenRotated
    ) -> None:
        await self._revoke_token(conn, rec.workspace_id, ev.old_token_id, ev, ev.at)
        await self._insert_token(conn, rec, ev)
        await self._audit(conn, rec, ev)

    async def _scim_revoked(
        self, conn: Connection, rec: RecordedEvent, ev: ScimTokenRevoked
    ) -> None:
        await self._revoke_token(conn, rec.workspace_id, ev.token_id, ev, ev.at)
        await self._audit(conn, rec, ev)

    async def _client_registered(
        self, conn: Connection, rec: RecordedEvent, ev: OAuthClientRegistered
    ) -> None:
        await conn.execute(
            """
            INSERT INTO identity_oauth_clients (workspace_id, client_id, name, secret_hash, scopes,
                                                created_at)
            VALUES ($1, $2, $3, $4, $5, $6)
            """,
            rec.workspace_id,
            ev.client_id,
            ev.name,
            ev.secret_hash,
            list(ev.scopes),
            ev.at,
        )
        await self._audit(conn, rec, ev)

    async def _client_revoked(
        self, conn: Connection, rec: RecordedEvent, ev: OAuthClientRevoked
    ) -> None:
        await conn.execute(
            "UPDATE identity_oauth_clients SET revoked_at = coalesce(revoked_at, $3) "
            "WHERE workspace_id = $1 AND client_id = $2",
            rec.workspace_id,
            ev.client_id,
            ev.at,
        )
        await self._audit(conn, rec, ev)

    async def _session_started(
        self, conn: Connection, rec: RecordedEvent, ev: SessionStarted
    ) -> None:
        # A session recorded after its user's deactivation (a login that checked the user
        # just before it) is revoked as it is stored, as the deactivation revoked the others:
        # otherwise reactivating the user would bring it back to life.
        await conn.execute(
            """
            INSERT INTO identity_sessions (workspace_id, session_id, user_id, token_hash, method,
                                           second_factor, created_at, expires_at, revoked_at,
                                           revoke_reason)
            SELECT $1, $2, $3, $4, $5, $6, $7::timestamptz, $8,
                   CASE WHEN u.deleted OR u.active IS FALSE THEN $7 END,
                   -- No reason until the cut-off records the revocation (user_session_ids
                   -- finds the sessions still to record by that).
                   NULL
            FROM (SELECT) AS one
            LEFT JOIN identity_users u ON u.workspace_id = $1 AND u.user_id = $3
            """,
            rec.workspace_id,
            ev.session_id,
            ev.user_id,
            ev.token_hash,
            ev.method,
            ev.second_factor,
            ev.at,
            ev.expires_at,
        )

    async def _session_revoked(
        self, conn: Connection, rec: RecordedEvent, ev: SessionRevoked
    ) -> None:
        await conn.execute(
            """
            UPDATE identity_sessions SET revoked_at = coalesce(revoked_at, $3),
                   revoke_reason = coalesce(revoke_reason, $4)
            WHERE workspace_id = $1 AND session_id = $2
            """,
            rec.workspace_id,
            ev.session_id,
            ev.at,
            ev.reason,
        )
        await self._audit(conn, rec, ev)
