"""A database that is down, slow or exhausted gives StoreUnavailable quickly, never a driver
error, and the same Database recovers by itself when PostgreSQL comes back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from eventstore.db import Database
from eventstore.embedded import EmbeddedPostgres
from eventstore.errors import StoreUnavailable
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.records import NewEvent
from eventstore.store import PostgresEventStore

T = TypeVar("T")

# Generous bounds on "fails fast" and "recovers": far above what a healthy run takes (well
# under a second each) yet far below a hang; they are not measurements.
FAST_S = 5.0
RECOVERY_S = 30.0


async def fails_fast(op: Callable[[], Awaitable[object]]) -> StoreUnavailable:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        await op()
    assert time.monotonic() - started < FAST_S
    return info.value


async def eventually(op: Callable[[], Awaitable[T]]) -> T:
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            return await op()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_an_unreachable_server_fails_fast(tmp_path: Path) -> None:
    for dsn in (
        "postgresql://svc@127.0.0.1:1/svc",
        f"postgresql://svc@/svc?host={tmp_path / 'no-such-socket-dir'}",
    ):

        async def connect(dsn: str = dsn) -> Database:
            return await Database.connect(dsn, connect_timeout_s=1.0)

        error = await fails_fast(connect)
        assert dsn not in str(error)  # a DSN may carry a password


async def test_a_closed_database_is_unavailable(database_url: str) -> None:
    db = await Database.connect(database_url, max_size=2)
    await db.close()

    async def use() -> None:
        async with db.acquire() as conn:
            await conn.fetchval("SELECT 1")

    await fails_fast(use)


async def test_an_exhausted_pool_times_out_as_unavailable(database_url: str) -> None:
    db = await Database.connect(database_url, min_size=1, max_size=1, acquire_timeout_s=0.2)
    try:
        async with db.acquire():
            assert db.pool_stats() == (1, 0, 1)

            async def second() -> None:
                async with db.acquire():
                    pass

            await fails_fast(second)
        assert db.pool_stats() == (1, 1, 1)
    finally:
        await db.close()


async def test_a_statement_timeout_is_unavailable(database_url: str) -> None:
    db = await Database.connect(database_url, max_size=1, statement_timeout_ms=100)
    try:

        async def slow() -> None:
            async with db.acquire() as conn:
                await conn.execute("SELECT pg_sleep(3)")

        await fails_fast(slow)
        async with db.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await db.close()


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    tmp_path.chmod(0o755)
    server = EmbeddedPostgres(tmp_path / "pg")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def outage_store(private_server: EmbeddedPostgres) -> AsyncIterator[PostgresEventStore]:
    url = private_server.start()  # already running: returns its URL
    db = await Database.connect(url, min_size=2, max_size=4, connect_timeout_s=1.0)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        yield PostgresEventStore(db)
    finally:
        await db.close()


async def test_the_store_fails_fast_while_the_server_is_down_and_recovers(
    private_server: EmbeddedPostgres, outage_store: PostgresEventStore
) -> None:
    store = outage_store
    stream = "s-" + uuid.uuid4().hex

    def append(version: int) -> Callable[[], Awaitable[object]]:
        return lambda: store.append(
            stream,
            [NewEvent(type="t.Happened", data={"v": version})],
            expected_version=version,
            command_id=f"c-{stream}-{version}",
            workspace_id="w",
        )

    await append(0)()
    url = private_server.start()
    await asyncio.to_thread(private_server.stop)
    for _ in range(3):
        await fails_fast(append(1))
        await fails_fast(store.read_all)
        await fails_fast(store.head)

    assert await asyncio.to_thread(private_server.start) == url
    await eventually(append(1))
    assert [e.version for e in await store.read_stream(stream)] == [1, 2]
    assert len(await store.read_all()) == 2
