"""Where a catch-up read's time goes: fetching rows, decoding columns, building RecordedEvents.

Loads a log like bench/store_read.py does, then times over the whole log, best of N rounds:
- `read_log` end to end (what bench/store_read.py measures), pages of 5000;
- the same query fetched only (asyncpg Records, no RecordedEvent built), client CPU time;
- the same query with `recorded_at` swapped for NULL (what decoding the timestamp costs);
- building RecordedEvents from already fetched rows, page by page, in client CPU time (steadier
  than wall time on a loaded machine), with the GC on and off;
- reading `recorded_at` from every built event (what a lazily decoded timestamp costs later);
- the cyclic garbage collector's share of `read_log` (it runs on allocation counts, and a
  catch-up read allocates several tracked objects per event).

Commits are durable (settings printed). Runs its own embedded PostgreSQL in a temporary
directory unless SVC_BENCH_DATABASE_URL names a server.

    python bench/store_read_profile.py [--events N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import pickle
import time
from pathlib import Path
from typing import Any

from pg_support import create_database, drop_database, server

from eventstore import reads
from eventstore.cursor import ORIGIN
from eventstore.db import Database
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations

_LOAD = """
INSERT INTO events (stream_id, version, event_id, workspace_id, type, data, metadata)
SELECT 'conv-' || ($1::int * 1000 + s), v, gen_random_uuid(), 'ws' || (s % 7),
       'MessageAdded',
       jsonb_build_object('role', 'user', 'text', repeat('x', 80), 'n', v),
       jsonb_build_object('command_id', md5(s::text || '-' || v))
FROM generate_series(1, 1000) AS s, generate_series(1, $2::int) AS v
"""
_PAGE = 5000


async def fetch_all(conn: Any, query: str) -> tuple[list[Any], float]:
    """Every row of the log through `query` (the shape of reads._READ_ALL), in pages; the
    client CPU time it took."""
    rows: list[Any] = []
    tx, position = 0, 0
    started = time.process_time()
    while True:
        page = await conn.fetch(query, tx, position, _PAGE)
        rows.extend(page)
        if len(page) < _PAGE:
            return rows, time.process_time() - started
        tx, position = page[-1]["tx"], page[-1]["position"]


async def read_log_all(conn: Any) -> tuple[int, float]:
    count = 0
    after = ORIGIN
    started = time.perf_counter()
    while True:
        batch = await reads.read_log(conn, after, _PAGE)
        count += len(batch)
        if len(batch) < _PAGE:
            return count, time.perf_counter() - started
        after = batch[-1].point


async def bench(dsn: str, events: int, rounds: int) -> None:
    db = await Database.connect(dsn, max_size=2)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        async with db.acquire() as conn:
            fsync = await conn.fetchval("SHOW fsync")
            sync = await conn.fetchval("SHOW synchronous_commit")
        print(f"store_read_profile: durable commits (fsync={fsync} synchronous_commit={sync})")
        for chunk in range(max(1, events // 10_000)):
            async with db.transaction() as conn:
                await conn.execute(_LOAD, chunk, 10)
        async with db.acquire() as conn:
            await conn.execute("VACUUM ANALYZE events")
            total = await conn.fetchval("SELECT count(*) FROM events")
        frozen = f", {gc.get_freeze_count():,} objects frozen" if gc.get_freeze_count() else ""
        print(f"{total:,} events, pages of {_PAGE}, best of {rounds} rounds{frozen}; "
              f"load {_loadavg()}")  # fmt: skip

        # The same query with whatever it selects as `recorded_at` swapped for a NULL.
        head, _, rest = reads._READ_ALL.partition("metadata, ")
        no_ts = head + "metadata, NULL AS recorded_at " + rest[rest.index("FROM events") :]
        best: dict[str, float] = {}

        def keep(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, float("inf")), seconds)

        build = getattr(reads, "rows_to_events", None) or (
            lambda rows: list(map(reads.row_to_event, rows))
        )
        rows: list[Any] = []
        built: list[Any] = []
        gc_s = [0.0, 0.0]

        def gc_timer(phase: str, _info: dict[str, int]) -> None:
            if phase == "start":
                gc_s[1] = time.perf_counter()
            else:
                gc_s[0] += time.perf_counter() - gc_s[1]

        async with db.acquire() as conn:
            for _ in range(rounds):
                # Keep nothing of the last round alive: full collections would rescan it.
                rows, built = [], []
                gc.collect()
                gc_s[0] = 0.0
                gc.callbacks.append(gc_timer)
                cpu = time.process_time()
                try:
                    count, elapsed = await read_log_all(conn)
                finally:
                    gc.callbacks.remove(gc_timer)
                cpu = time.process_time() - cpu
                assert count == total, (count, total)
                if elapsed < best.get("read_log", float("inf")):
                    best["read_log_gc"] = gc_s[0]
                keep("read_log", elapsed)
                keep("read_log_cpu", cpu)
                rows, elapsed = await fetch_all(conn, reads._READ_ALL)
                keep("fetch", elapsed)
                _, elapsed = await fetch_all(conn, no_ts)
                keep("fetch_no_ts", elapsed)
                pages = [rows[i : i + _PAGE] for i in range(0, len(rows), _PAGE)]
                started = time.process_time()
                for page in pages:
                    built = build(page)
                keep("build", time.process_time() - started)
                gc.disable()
                try:
                    started = time.process_time()
                    for page in pages:
                        built = build(page)
                    keep("build_nogc", time.process_time() - started)
                finally:
                    gc.enable()
                del pages
                started = time.process_time()
                for e in built:
                    e.recorded_at  # noqa: B018
                keep("recorded_at", (time.process_time() - started) * total / len(built))
        us = {name: seconds / total * 1e6 for name, seconds in best.items()}
        print(f"read_log end to end:     {total / best['read_log']:>9,.0f} events/s"
              f"  {us['read_log']:.2f} us/event  (target >= 300,000/s)")  # fmt: skip
        print(f"  client CPU (best):     {us['read_log_cpu']:>9.2f} us/event")
        print(f"  GC time (best round):  {us['read_log_gc']:>9.2f} us/event")
        print(f"fetch only (Records):    {us['fetch']:>9.2f} us/row client CPU")
        print(f"  of which recorded_at:  {us['fetch'] - us['fetch_no_ts']:>9.2f} us/row"
              "  (fetch minus fetch with NULL timestamps)")  # fmt: skip
        print(f"build RecordedEvents:    {us['build']:>9.2f} us/row CPU, pages of {_PAGE}"
              f" ({us['build_nogc']:.2f} with the GC off)")  # fmt: skip
        print(f"later .recorded_at read: {us['recorded_at']:>9.2f} us/event")
        sample = built[-1]
        assert pickle.loads(pickle.dumps(sample)) == sample
        print(f"sample: {sample.cursor} {sample.recorded_at.isoformat()} pickles: yes")
    finally:
        await db.close()


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events to load")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (best is kept)")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() before reading, as a service could after startup: the collector "
        "then stops rescanning every module object on each full collection",
    )
    args = parser.parse_args()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    with server() as url:
        dsn = asyncio.run(create_database(url))
        try:
            asyncio.run(bench(dsn, args.events, args.rounds))
        finally:
            asyncio.run(drop_database(url, dsn))


if __name__ == "__main__":
    main()
