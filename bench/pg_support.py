"""Shared by the store benchmarks: a real PostgreSQL (embedded, or SVC_BENCH_DATABASE_URL),
a throw-away database per run, and the durability settings every figure must state."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from eventstore.embedded import temporary_server


@contextmanager
def server() -> Iterator[str]:
    external = os.environ.get("SVC_BENCH_DATABASE_URL")
    if external:
        yield external
        return
    with temporary_server("svc-bench-pg-") as url:
        yield url


async def create_database(url: str) -> str:
    name = "bench_" + uuid.uuid4().hex[:12]
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


async def drop_database(url: str, dsn: str) -> None:
    name = urlsplit(dsn).path.lstrip("/")
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def durability(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        fsync = await conn.fetchval("SHOW fsync")
        sync = await conn.fetchval("SHOW synchronous_commit")
    finally:
        await conn.close()
    return f"fsync={fsync} synchronous_commit={sync}"
