"""Fixtures of the projection tests: a real store (embedded PostgreSQL) with the read models.

The store is built from its parts (pool, migrations, adapter) rather than `open_store`: the
projection tests need no log tailer, and the one test about wake-ups starts its own notifier.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from eventstore import (
    STORE_MIGRATIONS,
    Database,
    PostgresEventStore,
    apply_migrations,
)
from projections import PROJECTION_MIGRATIONS


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(database_url, max_size=8)
    try:
        await apply_migrations(database, [STORE_MIGRATIONS, PROJECTION_MIGRATIONS])
        yield database
    finally:
        await database.close()


@pytest.fixture
def store(db: Database) -> PostgresEventStore:
    return PostgresEventStore(db)
