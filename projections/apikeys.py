"""Read model `api_keys`: issued keys by their sha256 hash (the key itself is never stored)."""

from __future__ import annotations

from typing import ClassVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.events import Event
from schemas.workspace import ApiKeyIssued, ApiKeyRevoked


class ApiKeysProjector(Projector):
    name: ClassVar[str] = "api_keys"
    tables: ClassVar[tuple[str, ...]] = ("api_keys",)

    def handlers(self) -> dict[type[Event], Handler]:
        return {ApiKeyIssued: self._issued, ApiKeyRevoked: self._revoked}

    async def _issued(self, conn: Connection, rec: RecordedEvent, ev: ApiKeyIssued) -> None:
        await conn.execute(
            """
            INSERT INTO api_keys (workspace_id, key_id, name, key_hash, prefix, scopes,
                                  rate_limit_rpm, created_at, expires_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
            ON CONFLICT (workspace_id, key_id) DO NOTHING
            """,
            rec.workspace_id,
            ev.key_id,
            ev.name,
            ev.key_hash,
            ev.prefix,
            list(ev.scopes),
            ev.rate_limit_rpm,
            ev.at,
            ev.expires_at,
        )

    async def _revoked(self, conn: Connection, rec: RecordedEvent, ev: ApiKeyRevoked) -> None:
        await conn.execute(
            """
            UPDATE api_keys SET revoked_at = coalesce(revoked_at, $3)
            WHERE workspace_id = $1 AND key_id = $2
            """,
            rec.workspace_id,
            ev.key_id,
            ev.at,
        )
