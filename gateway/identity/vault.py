"""Identity secrets outside the append-only log (table `identity_secrets`).

Password hashes, TOTP seeds, the OAuth signing key and the LDAP bind password. Values are
read here and nowhere else; they are never logged, returned by an endpoint or put in an event.
"""

from __future__ import annotations

from collections.abc import Callable

from eventstore.db import Database

INSTANCE = "*"
PASSWORD = "password"
TOTP = "totp"
TOTP_PENDING = "totp_pending"

_PUT = """
INSERT INTO identity_secrets (workspace_id, subject, kind, value) VALUES ($1, $2, $3, $4)
ON CONFLICT (workspace_id, subject, kind) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
"""
_PUT_ONCE = """
INSERT INTO identity_secrets (workspace_id, subject, kind, value) VALUES ($1, $2, $3, $4)
ON CONFLICT (workspace_id, subject, kind) DO NOTHING
"""
_GET = """
SELECT value FROM identity_secrets WHERE workspace_id = $1 AND subject = $2 AND kind = $3
"""
_LOCK = _GET.rstrip() + " FOR UPDATE"
_DELETE = "DELETE FROM identity_secrets WHERE workspace_id = $1 AND subject = $2 AND kind = $3"


class IdentityVault:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def put(self, workspace_id: str, subject: str, kind: str, value: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute(_PUT, workspace_id, subject, kind, value)

    async def get(self, workspace_id: str, subject: str, kind: str) -> str | None:
        async with self._db.acquire() as conn:
            value = await conn.fetchval(_GET, workspace_id, subject, kind)
        return None if value is None else str(value)

    async def get_or_create(self, workspace_id: str, subject: str, kind: str, value: str) -> str:
        """The stored value, storing `value` first when there is none (race-free)."""
        async with self._db.acquire() as conn:
            await conn.execute(_PUT_ONCE, workspace_id, subject, kind, value)
            stored = await conn.fetchval(_GET, workspace_id, subject, kind)
        return str(stored)

    async def rotate(
        self, workspace_id: str, subject: str, kind: str, previous: str, fresh: Callable[[], str]
    ) -> None:
        """A `fresh()` value for `kind`, whose value until now becomes `previous` (the one
        before is dropped). One transaction, the row locked: two rotations at once are one
        after the other. A row none made yet is made first, so there is one to lock, and a
        `get_or_create` racing the rotation cannot have its value overwritten unkept."""
        async with self._db.transaction() as conn:
            await conn.execute(_PUT_ONCE, workspace_id, subject, kind, fresh())
            current = await conn.fetchval(_LOCK, workspace_id, subject, kind)
            await conn.execute(_PUT, workspace_id, subject, previous, current)
            await conn.execute(_PUT, workspace_id, subject, kind, fresh())

    async def delete(self, workspace_id: str, subject: str, kind: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute(_DELETE, workspace_id, subject, kind)
