"""A host whose start fails (here: its database has no shard map yet) keeps no connection:
the next command starts it again, and each failed start used to keep a pool and a LISTEN
connection until the database refused everyone. Without Ray: the host class itself."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from actors.ray.host import ActorHost, HostSpec
from eventstore import StoreError


async def _connections(database_url: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()
    return count


async def test_a_failed_start_closes_what_it_opened(database_url: str) -> None:
    before = await _connections(database_url)
    host = ActorHost(HostSpec("svc", "svc-host-0", database_url, behaviours=list))
    for _ in range(3):
        with pytest.raises(StoreError, match="actor_shards"):
            await host.ready()
    # Backends leave pg_stat_activity as they exit, a moment after their clients close.
    for _ in range(600):  # a bound on a wait (30 s), not a measurement
        left = await _connections(database_url)
        if left <= before:
            break
        await asyncio.sleep(0.05)
    assert left == before
