"""Secret instance-setting values, kept outside the append-only log (`instance_secrets`).

The settings stream records only that a secret was set (schemas/settings.py), so removing a
secret really removes it and no log export, feed or replay can ever carry it.
"""

from __future__ import annotations

from eventstore.db import Database

_PUT = """
INSERT INTO instance_secrets (key, value) VALUES ($1, $2)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
"""


class DatabaseVault:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def put(self, key: str, value: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute(_PUT, key, value)

    async def delete(self, key: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute("DELETE FROM instance_secrets WHERE key = $1", key)

    async def all(self) -> dict[str, str]:
        async with self._db.acquire() as conn:
            rows = await conn.fetch("SELECT key, value FROM instance_secrets")
        return {str(r["key"]): str(r["value"]) for r in rows}
