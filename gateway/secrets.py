"""Secret instance-setting values, kept outside the append-only log (`instance_secrets`).

The settings stream records only that a secret was set (schemas/settings.py), so removing a
secret really removes it and no log export, feed or replay can ever carry it. Each value is a
row of its own version, written before the event that names the version is recorded
(SettingsService.set): the value in force is the one the newest event names, so a change
that fails to record changes nothing (migrations/0102).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from eventstore.db import Database, translate_errors
from eventstore.errors import StoreError

log = logging.getLogger(__name__)

_PUT = """
INSERT INTO instance_secrets (key, version, value) VALUES ($1, $2, $3)
ON CONFLICT (key, version) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
"""


# A version younger than this is never pruned: it may belong to a set of the same key still
# on its way to recording its event (bounded by the ask's timeout, far shorter), which a
# prune by a concurrent set must not take from under it.
PRUNE_AFTER_S = 600.0


class DatabaseVault:
    def __init__(self, db: Database, *, prune_after_s: float = PRUNE_AFTER_S) -> None:
        self._db = db
        self._prune_after_s = prune_after_s

    async def put(self, key: str, value: str, version: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute(_PUT, key, version, value)

    async def prune(self, key: str, keep: str) -> None:
        """Delete the key's other versions older than `prune_after_s` (once the event naming
        `keep` is recorded): the value it replaced, usually; a younger one goes at the next
        set."""
        async with self._db.acquire() as conn:
            await conn.execute(
                "DELETE FROM instance_secrets WHERE key = $1 AND version <> $2 "
                "AND updated_at < now() - make_interval(secs => $3)",
                key,
                keep,
                self._prune_after_s,
            )

    async def delete(self, key: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute("DELETE FROM instance_secrets WHERE key = $1", key)

    @asynccontextmanager
    async def changing(self, key: str) -> AsyncIterator[None]:
        """A session advisory lock on the key, on a connection of its own for the change
        (the server drops it with the connection, should this process die holding it)."""
        lock = ("svc.secret-setting:" + key,)
        async with self._db.acquire() as conn:
            await conn.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", *lock)
            try:
                yield
            finally:
                try:
                    with translate_errors():
                        await conn.execute(
                            "SELECT pg_advisory_unlock(hashtextextended($1, 0))", *lock
                        )
                except StoreError as exc:
                    # The connection went, and the lock with it: the change it guarded is
                    # done (or failed on its own), and must not be reported as failed here.
                    log.warning("releasing the lock of setting %s failed: %s", key, exc)

    async def all(self) -> dict[str, dict[str, str]]:
        """key -> version -> value."""
        async with self._db.acquire() as conn:
            rows = await conn.fetch("SELECT key, version, value FROM instance_secrets")
        out: dict[str, dict[str, str]] = {}
        for r in rows:
            out.setdefault(str(r["key"]), {})[str(r["version"])] = str(r["value"])
        return out
