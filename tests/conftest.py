"""Shared fixtures: one real PostgreSQL per test session, a fresh database per test.

The server is the embedded one (started in a temporary directory) unless
SVC_TEST_DATABASE_URL points at an external server, whose user may create databases.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from eventstore import STORE_MIGRATIONS, Database, apply_migrations
from eventstore.embedded import temporary_server


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    external = os.environ.get("SVC_TEST_DATABASE_URL")
    if external:
        yield external
        return
    with temporary_server("svc-test-pg-") as url:
        yield url


@pytest.fixture
async def database_url(pg_server_url: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = "t_" + uuid.uuid4().hex[:16]
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield _with_database(pg_server_url, name)
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def store_db(database_url: str) -> AsyncIterator[Database]:
    """A pool on the test's fresh database, with the event store's migrations applied."""
    db = await Database.connect(database_url, max_size=10)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        yield db
    finally:
        await db.close()
