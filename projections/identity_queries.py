"""Reads of the identity read models (projections/identity.py).

Tenant reads run in `Database.scoped(workspace_id)` (row-level security). The lookups by the
hash of a secret the caller holds (a session cookie, a SCIM token) and by OAuth client id run
as the service role, like `queries.find_api_key_by_hash`: they are what tell the gateway the
workspace in the first place, and they never return a hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from eventstore.db import Database
from schemas.identity import BUILTIN_ROLES, DOMAINS, Access, user_name_key

_ROLES_OF_U = """
coalesce((SELECT array_agg(b.role ORDER BY b.role) FROM identity_role_bindings b
          WHERE b.workspace_id = u.workspace_id AND b.user_id = u.user_id), '{}') AS roles
"""
"""The roles bound to the user row aliased `u`, sorted."""
_USER_COLUMNS = f"""
u.workspace_id, u.user_id, u.user_name, u.display_name, u.given_name, u.family_name, u.emails,
u.external_id, u.active, u.source, u.has_password, u.totp_enrolled, u.deleted, u.version,
u.created_at, u.updated_at, {_ROLES_OF_U}
"""


@dataclass(frozen=True, slots=True)
class UserRow:
    workspace_id: str
    user_id: str
    user_name: str
    display_name: str | None
    given_name: str | None
    family_name: str | None
    emails: list[dict[str, Any]]
    external_id: str | None
    active: bool | None
    source: str
    has_password: bool
    totp_enrolled: bool
    deleted: bool
    version: int
    created_at: datetime
    updated_at: datetime
    roles: list[str]

    @property
    def usable(self) -> bool:
        return self.active is not False and not self.deleted


@dataclass(frozen=True, slots=True)
class SessionRow:
    workspace_id: str
    session_id: str
    user_id: str
    method: str
    second_factor: bool
    expires_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class ScimTokenRow:
    workspace_id: str
    token_id: str
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class OAuthClientRow:
    workspace_id: str
    client_id: str
    name: str
    secret_hash: str
    scopes: list[str]
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class AuditRow:
    position: int
    at: datetime
    action: str
    user_id: str | None
    user_name: str | None
    client_ip: str | None
    detail: dict[str, Any]


def _user(row: Any) -> UserRow:
    return UserRow(**{f.name: row[f.name] for f in fields(UserRow)})


async def get_user(db: Database, workspace_id: str, user_id: str) -> UserRow | None:
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            f"SELECT {_USER_COLUMNS} FROM identity_users u WHERE u.user_id = $1", user_id
        )
    return None if row is None else _user(row)


async def active_owners(db: Database, workspace_id: str) -> list[str]:
    """The ids of the workspace's users who hold `owner` and may sign in."""
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            "SELECT u.user_id FROM identity_users u JOIN identity_role_bindings b"
            " ON b.workspace_id = u.workspace_id AND b.user_id = u.user_id"
            " WHERE b.role = 'owner' AND u.active IS NOT FALSE AND NOT u.deleted"
            " ORDER BY u.user_id"
        )
    return [str(r[0]) for r in rows]


async def find_user_by_name(db: Database, workspace_id: str, user_name: str) -> UserRow | None:
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            f"SELECT {_USER_COLUMNS} FROM identity_users u WHERE u.name_key = $1 AND NOT u.deleted "
            "ORDER BY u.created_at, u.user_id LIMIT 1",
            user_name_key(user_name),
        )
    return None if row is None else _user(row)


class AmbiguousSubject(Exception):
    """Two live users hold the external id an external identity names."""


async def find_user_by_subject(db: Database, workspace_id: str, subject: str) -> UserRow | None:
    """The live user an external identity (OIDC `sub`) names: the one whose external id it
    is, else one linked to no external id whose user name is exactly it. A user linked to
    another subject is never matched by name, and names are compared as typed, not folded
    (`ADA`, or `ada` in full-width letters, are other subjects at the IdP). AmbiguousSubject
    when two users hold it as their external id (SCIM's externalId is not unique): which
    one the IdP means is not guessed, the oldest no more than another."""
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            f"SELECT {_USER_COLUMNS} FROM identity_users u "
            "WHERE NOT u.deleted AND (u.external_id = $1 OR (coalesce(u.external_id, '') = '' "
            "AND u.name_key = $2 AND u.user_name = $1)) "
            "ORDER BY (u.external_id = $1) DESC NULLS LAST, u.created_at, u.user_id LIMIT 2",
            subject,
            user_name_key(subject),
        )
    users = [_user(row) for row in rows]
    if len(users) == 2 and all(user.external_id == subject for user in users):
        raise AmbiguousSubject(subject)
    return users[0] if users else None


async def list_users(
    db: Database,
    workspace_id: str,
    *,
    user_name: str | None = None,
    external_id: str | None = None,
    user_id: str | None = None,
    offset: int = 0,
    limit: int = 100,
    include_deleted: bool = False,
) -> tuple[list[UserRow], int]:
    """Users, oldest first, and the total: those with this user name (equal by
    `user_name_key`), external id or id when given. Only the conditions given are in the
    statement: each filter has a statement (and a cached plan) of its own, on its index."""
    where: list[str] = []
    args: list[object] = []
    for column, value in (
        ("name_key", None if user_name is None else user_name_key(user_name)),
        ("external_id", external_id),
        ("user_id", user_id),
    ):
        if value is not None:
            args.append(value)
            where.append(f"u.{column} = ${len(args)}")
    if not include_deleted:
        where.append("NOT u.deleted")
    cond = " AND ".join(where) or "true"
    paging = f"OFFSET ${len(args) + 1} LIMIT ${len(args) + 2}"
    async with db.scoped(workspace_id) as conn:
        total = await conn.fetchval(f"SELECT count(*) FROM identity_users u WHERE {cond}", *args)
        rows = await conn.fetch(
            f"SELECT {_USER_COLUMNS} FROM identity_users u WHERE {cond} "
            f"ORDER BY u.created_at, u.user_id {paging}",
            *args,
            offset,
            limit,
        )
    return [_user(r) for r in rows], int(total)


async def role_permissions(
    db: Database, workspace_id: str, roles: Sequence[str]
) -> dict[str, Access]:
    """The union of what `roles` grant, per domain (write includes read)."""
    custom: dict[str, dict[str, Access]] = {}
    wanted = [r for r in roles if r not in BUILTIN_ROLES]
    if wanted:
        async with db.scoped(workspace_id) as conn:
            rows = await conn.fetch(
                "SELECT role, permissions FROM identity_custom_roles WHERE role = ANY($1)",
                wanted,
            )
        custom = {str(r["role"]): dict(r["permissions"]) for r in rows}
    out: dict[str, Access] = {}
    for role in roles:
        grants = BUILTIN_ROLES.get(role) or custom.get(role) or {}
        for domain, access in grants.items():
            if domain in DOMAINS and (access == "write" or domain not in out):
                out[domain] = access
    return out


async def list_custom_roles(db: Database, workspace_id: str) -> dict[str, dict[str, Access]]:
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch("SELECT role, permissions FROM identity_custom_roles ORDER BY role")
    return {str(r["role"]): dict(r["permissions"]) for r in rows}


async def find_session(db: Database, token_hash: str) -> SessionRow | None:
    async with db.acquire() as conn:
        row = await conn.fetchrow(
            """
            SELECT workspace_id, session_id, user_id, method, second_factor, expires_at,
                   revoked_at
            FROM identity_sessions WHERE token_hash = $1
            """,
            token_hash,
        )
    return None if row is None else SessionRow(**dict(row))


DEACTIVATED, DEPROVISIONED = "user deactivated", "user deprovisioned"
"""The reasons a user's cut-off records its sessions' revocations with."""


async def user_session_ids(db: Database, workspace_id: str, user_id: str) -> list[str]:
    """Sessions of a user to revoke: unexpired (one that expired signs in no more, and
    revoking each of a long history took minutes), and unrevoked or revoked by the read
    model with the user (no reason yet: their revocation is not recorded). One recorded is
    not asked again."""
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            "SELECT session_id FROM identity_sessions "
            "WHERE user_id = $1 AND (revoked_at IS NULL OR revoke_reason IS NULL) "
            # A margin for the gateway's clock, which judges expiry, running behind this one.
            "AND expires_at > now() - interval '1 hour'",
            user_id,
        )
    return [str(r["session_id"]) for r in rows]


async def user_api_keys(db: Database, workspace_id: str, user_id: str) -> list[str]:
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            "SELECT key_id FROM identity_user_api_keys WHERE user_id = $1 ORDER BY linked_at",
            user_id,
        )
    return [str(r["key_id"]) for r in rows]


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """The user an API key belongs to, as authentication needs them."""

    user_id: str
    user_name: str
    blocked: bool
    """Deactivated or deprovisioned: the key is refused."""
    roles: tuple[str, ...]


async def key_owner(db: Database, workspace_id: str, key_id: str) -> KeyOwner | None:
    """The user `key_id` belongs to, None when it belongs to no user.

    Part of authenticating the key, like the key lookup itself: one statement as the service
    role with the workspace named in the query (a scoped transaction would take four round
    trips), and no cache, so a user cut off or demoted through any gateway process is seen by
    all of them at once."""
    async with db.acquire(stateless=True) as conn:
        row = await conn.fetchrow(
            f"""
            SELECT u.user_id, u.user_name, u.deleted OR u.active IS FALSE AS blocked,
                   {_ROLES_OF_U}
            FROM identity_user_api_keys k
            JOIN identity_users u ON u.workspace_id = k.workspace_id AND u.user_id = k.user_id
            WHERE k.workspace_id = $1 AND k.key_id = $2
            """,
            workspace_id,
            key_id,
        )
    if row is None:
        return None
    return KeyOwner(row["user_id"], row["user_name"], bool(row["blocked"]), tuple(row["roles"]))


async def find_scim_token(db: Database, token_hash: str) -> ScimTokenRow | None:
    async with db.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT workspace_id, token_id, revoked_at FROM identity_scim_tokens "
            "WHERE token_hash = $1",
            token_hash,
        )
    return None if row is None else ScimTokenRow(**dict(row))


async def find_oauth_client(db: Database, client_id: str) -> OAuthClientRow | None:
    async with db.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT workspace_id, client_id, name, secret_hash, scopes, revoked_at "
            "FROM identity_oauth_clients WHERE client_id = $1",
            client_id,
        )
    return None if row is None else OAuthClientRow(**dict(row))


@dataclass(frozen=True, slots=True)
class OAuthClientSummary:
    client_id: str
    name: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None


async def list_oauth_clients(
    db: Database, workspace_id: str, *, include_revoked: bool, offset: int, limit: int
) -> tuple[list[OAuthClientSummary], int]:
    """The workspace's OAuth clients, newest first, and the total (never a secret's hash)."""
    live = "true" if include_revoked else "revoked_at IS NULL"
    async with db.scoped(workspace_id) as conn:
        total = await conn.fetchval(f"SELECT count(*) FROM identity_oauth_clients WHERE {live}")
        rows = await conn.fetch(
            "SELECT client_id, name, scopes, created_at, revoked_at FROM identity_oauth_clients "
            f"WHERE {live} ORDER BY created_at DESC, client_id OFFSET $1 LIMIT $2",
            offset,
            limit,
        )
    return [OAuthClientSummary(**dict(row)) for row in rows], int(total)


async def list_audit(
    db: Database,
    workspace_id: str,
    *,
    limit: int = 100,
    before: int | None = None,
    action: str | None = None,
) -> list[AuditRow]:
    """Newest first; `before` is the position of the last row of the previous page."""
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            """
            SELECT position, at, action, user_id, user_name, client_ip, detail
            FROM identity_audit_log
            WHERE ($1::bigint IS NULL OR position < $1) AND ($2::text IS NULL OR action = $2)
            ORDER BY position DESC LIMIT $3
            """,
            before,
            action,
            limit,
        )
    return [AuditRow(**dict(r)) for r in rows]


PRUNE_BATCH = 5000
"""Rows one pruning statement deletes: each is a short transaction of its own, since every
writing transaction holds back the log's gap-free readers until it ends, and one over
months of rows could outlast the statement timeout and so never finish."""


async def prune_audit(db: Database, retention_days: int, batch: int = PRUNE_BATCH) -> int:
    """Delete audit rows older than `retention_days` in every workspace (0 keeps
    everything), `batch` rows a transaction, oldest first; how many were deleted."""
    if retention_days <= 0:
        return 0
    removed = 0
    while True:
        async with db.acquire() as conn:
            status: str = await conn.execute(_PRUNE_SOME, retention_days, batch)
        deleted = int(status.rsplit(" ", 1)[-1])
        removed += deleted
        if deleted < batch:
            return removed


_PRUNE_SOME = """
DELETE FROM identity_audit_log WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM identity_audit_log
    WHERE at < now() - make_interval(days => $1)
    ORDER BY at LIMIT $2
))
"""
