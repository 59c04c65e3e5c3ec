"""Catch-up read throughput of the global log: read_all from the start over ~200k events.

Target (ARCHITECTURE.md "Figures", 2-core machine): >= 300,000 events/s through the gap-free
`(tx, position)` read below pg_snapshot_xmin. Events are loaded with plain INSERTs in large
transactions (the load is not what is measured), with realistic small payloads spread over
many streams and transactions; commits are durable (settings printed below).

Runs its own embedded PostgreSQL in a temporary directory unless SVC_BENCH_DATABASE_URL names
a server (a database is created on it and dropped afterwards).

    python bench/store_read.py [--quick] [--events N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from pg_support import create_database, drop_database, durability, server

from eventstore.cursor import ORIGIN
from eventstore.db import Database
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.reads import read_log
from eventstore.store import PostgresEventStore

# Each transaction writes a few events to each of many streams, as concurrent actors would.
_LOAD = """
INSERT INTO events (stream_id, version, event_id, workspace_id, type, data, metadata)
SELECT 'conv-' || ($1::int * 1000 + s), v, gen_random_uuid(), 'ws' || (s % 7),
       'MessageAdded',
       jsonb_build_object('role', 'user', 'text', repeat('x', 80), 'n', v),
       jsonb_build_object('command_id', md5(s::text || '-' || v))
FROM generate_series(1, 1000) AS s, generate_series(1, $2::int) AS v
"""


async def load(db: Database, events: int) -> None:
    per_stream = 10
    chunks = max(1, events // (1000 * per_stream))
    for chunk in range(chunks):
        async with db.transaction() as conn:
            await conn.execute(_LOAD, chunk, per_stream)
    async with db.acquire() as conn:
        await conn.execute("VACUUM ANALYZE events")


async def read_everything(db: Database, page: int) -> tuple[int, float]:
    count = 0
    after = ORIGIN
    started = time.perf_counter()
    while True:
        async with db.acquire() as conn:
            batch = await read_log(conn, after, page)
        count += len(batch)
        if len(batch) < page:
            return count, time.perf_counter() - started
        after = batch[-1].point


async def read_one_workspace(
    db: Database, workspace: str, page: int, *, as_log_reader: bool
) -> tuple[int, float]:
    """A feed's catch-up of one workspace: as the log reader under row-level security (as
    the store reads it), or as the login with the query's own condition only."""
    count = 0
    after = ORIGIN
    started = time.perf_counter()
    while True:
        reading = db.log_reading(workspace) if as_log_reader else db.acquire(stateless=True)
        async with reading as conn:
            batch = await read_log(conn, after, page, workspace)
        count += len(batch)
        if len(batch) < page:
            return count, time.perf_counter() - started
        after = batch[-1].point


async def read_all_api(store: PostgresEventStore, page: int) -> tuple[int, float]:
    count = 0
    cursor: str | None = None
    started = time.perf_counter()
    while True:
        batch = await store.read_all(cursor, page)
        count += len(batch)
        if len(batch) < page:
            return count, time.perf_counter() - started
        cursor = batch[-1].cursor


async def bench(dsn: str, events: int, rounds: int) -> None:
    db = await Database.connect(dsn, max_size=2)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        print(f"store_read: durable commits ({await durability(dsn)})")
        started = time.perf_counter()
        await load(db, events)
        async with db.acquire() as conn:
            total = await conn.fetchval("SELECT count(*) FROM events")
        print(f"loaded {total:,} events in {time.perf_counter() - started:.1f} s")
        store = PostgresEventStore(db)
        for page in (1000, 5000):
            best = 0.0
            for _ in range(rounds):
                count, elapsed = await read_everything(db, page)
                assert count == total, (count, total)
                best = max(best, count / elapsed)
            print(
                f"catch-up read_log, pages of {page:>5}: {best:>9,.0f} events/s"
                "  (target >= 300,000/s)"
            )
        best = 0.0
        for _ in range(rounds):
            count, elapsed = await read_all_api(store, 1000)
            best = max(best, count / elapsed)
        print(f"store.read_all(after=cursor), limit 1000: {best:>9,.0f} events/s")
        # One workspace of the seven, read alternately as the login and as the log reader.
        best_by = {False: 0.0, True: 0.0}
        for _ in range(rounds):
            for as_log_reader in (False, True):
                count, elapsed = await read_one_workspace(
                    db, "ws3", 1000, as_log_reader=as_log_reader
                )
                best_by[as_log_reader] = max(best_by[as_log_reader], count / elapsed)
        print(
            f"one workspace ({count:,} events), limit 1000: as the login "
            f"{best_by[False]:>9,.0f} events/s, as svc_log_reader (row-level security) "
            f"{best_by[True]:>9,.0f} events/s"
        )
    finally:
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small log, to check it works")
    parser.add_argument("--events", type=int, default=None, help="events to load")
    args = parser.parse_args()
    events = args.events or (20_000 if args.quick else 200_000)
    rounds = 1 if args.quick else 3
    with server() as url:
        dsn = asyncio.run(create_database(url))
        try:
            asyncio.run(bench(dsn, events, rounds))
        finally:
            asyncio.run(drop_database(url, dsn))


if __name__ == "__main__":
    main()
