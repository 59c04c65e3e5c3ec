"""Commit-to-delivery latency of subscriptions under a steady append load.

Target (ARCHITECTURE.md "Figures", 2-core machine): p99 <= 20 ms from an append's commit to
the event reaching a subscriber of the in-process log tailer, at about 2,000 appends/s. The
clock starts when `store.append` returns (the commit is acknowledged; the store has already
fired the after-commit wake-up) and stops when the subscriber's iterator yields the event; a
delivery that beats the acknowledgement counts as 0. The same from the start of the append
call is printed too, as an upper bound.
Commits are durable (settings printed below). `--subscribers N` adds idle-consuming
subscribers to show the fan-out cost; `--remote` measures a tailer in a second pool woken
only by NOTIFY (as another process would be).

Runs its own embedded PostgreSQL in a temporary directory unless SVC_BENCH_DATABASE_URL names
a server (a database is created on it and dropped afterwards).

    python bench/store_subscribe.py [--quick] [--rate 2000] [--subscribers N] [--remote]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid

from pg_support import create_database, drop_database, durability, server

from eventstore.db import Database
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.notify import CommitNotifier
from eventstore.records import NewEvent
from eventstore.store import PostgresEventStore
from eventstore.tailer import LogTailer

WRITERS = 32


class Side:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.notifier = CommitNotifier(db)
        self.tailer = LogTailer(db, self.notifier)
        self.store = PostgresEventStore(
            db, on_commit=self.notifier.committed, subscriber=self.tailer
        )

    async def start(self) -> None:
        await self.notifier.start()
        await self.tailer.start()

    async def stop(self) -> None:
        await self.tailer.stop()
        await self.notifier.stop()
        await self.db.close()


async def bench(dsn: str, rate: float, seconds: float, subscribers: int, remote: bool) -> None:
    setup = await Database.connect(dsn)
    try:
        await apply_migrations(setup, [STORE_MIGRATIONS])
    finally:
        await setup.close()
    writer_side = Side(await Database.connect(dsn, max_size=WRITERS))
    reader_side = Side(await Database.connect(dsn, max_size=4)) if remote else writer_side
    await writer_side.start()
    if remote:
        await reader_side.start()
        for _ in range(1000):
            if reader_side.notifier.listening:
                break
            await asyncio.sleep(0.01)
    acked: dict[uuid.UUID, float] = {}
    begun: dict[uuid.UUID, float] = {}
    delivered: dict[uuid.UUID, float] = {}
    expected = 0
    all_seen = asyncio.Event()

    async def measured() -> None:
        async for event in reader_side.tailer.subscribe(reader_side.tailer.live_cursor):
            delivered[event.event_id] = time.perf_counter()
            if len(delivered) >= expected:
                all_seen.set()

    async def idle() -> None:
        async for _ in reader_side.tailer.subscribe(reader_side.tailer.live_cursor):
            pass

    readers = [asyncio.create_task(measured())]
    readers += [asyncio.create_task(idle()) for _ in range(subscribers)]

    async def writer(w: int, count: int) -> None:
        # Paced: each writer sends one append every WRITERS / rate seconds.
        interval = WRITERS / rate
        next_at = time.perf_counter() + interval * w / WRITERS
        for n in range(count):
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            next_at += interval
            event = NewEvent("BenchTicked", {"w": w, "n": n})
            begun[event.event_id] = time.perf_counter()
            await writer_side.store.append(
                f"tick-{w}",
                [event],
                expected_version=None,
                command_id=uuid.uuid4().hex,
                workspace_id="bench",
            )
            acked[event.event_id] = time.perf_counter()

    per_writer = max(1, int(rate * seconds / WRITERS))
    expected = per_writer * WRITERS
    started = time.perf_counter()
    await asyncio.gather(*(writer(w, per_writer) for w in range(WRITERS)))
    achieved = expected / (time.perf_counter() - started)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_seen.wait(), 10.0)
    for task in readers:
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    if remote:
        await reader_side.stop()
    await writer_side.stop()

    if len(delivered) < expected:
        print(f"WARNING: only {len(delivered)} of {expected} events delivered")
    # A reader can see a commit before the writer has read the server's reply to COMMIT;
    # such a delivery counts as zero latency.
    latencies = [max(0.0, delivered[e] - t) for e, t in acked.items() if e in delivered]
    whole = [delivered[e] - t for e, t in begun.items() if e in delivered]
    cuts = statistics.quantiles(latencies, n=100)
    mode = "other pool, NOTIFY wake-up" if remote else "same process, after-commit wake-up"
    print(f"appends: {expected:,} at {achieved:,.0f}/s (asked {rate:,.0f}/s), {WRITERS} writers")
    print(f"subscribers: 1 measured + {subscribers} others; {mode}")
    print(
        f"commit-to-delivery: p50 {cuts[49] * 1000:.1f} ms, p99 {cuts[98] * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.1f} ms  (target p99 <= 20 ms)"
    )
    cuts = statistics.quantiles(whole, n=100)
    print(
        f"append-call-to-delivery (includes the append itself): p50 {cuts[49] * 1000:.1f} ms, "
        f"p99 {cuts[98] * 1000:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run, to check it works")
    parser.add_argument("--rate", type=float, default=None, help="appends per second")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--subscribers", type=int, default=0, help="extra subscribers")
    parser.add_argument("--remote", action="store_true", help="reader woken by NOTIFY only")
    args = parser.parse_args()
    rate = args.rate or (500.0 if args.quick else 2000.0)
    seconds = args.seconds or (2.0 if args.quick else 15.0)
    with server() as url:
        dsn = asyncio.run(create_database(url))
        try:
            print(f"store_subscribe: durable commits ({asyncio.run(durability(dsn))})")
            asyncio.run(bench(dsn, rate, seconds, args.subscribers, args.remote))
        finally:
            asyncio.run(drop_database(url, dsn))


if __name__ == "__main__":
    main()
