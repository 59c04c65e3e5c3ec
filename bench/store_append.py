"""Append throughput of the event store: single-event appends at 1/8/32/64 concurrent writers
and batched appends of 10 events.

Targets (ARCHITECTURE.md "Figures", 2-core machine): >= 8,000 single-event appends/s at 32
writers; >= 50,000 events/s in batches of 10. Commits are durable (fsync and
synchronous_commit as the server has them, printed below). Each append is the real
PostgresEventStore.append: one transaction claiming the idempotency ledger row, reading the
stream head, inserting the events and completing the ledger row.

Runs its own embedded PostgreSQL in a temporary directory unless SVC_BENCH_DATABASE_URL names
a server (a database is created on it and dropped afterwards).

    python bench/store_append.py [--quick] [--procs N] [--only single|batch]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pg_support import create_database, drop_database, durability, server

from eventstore.db import Database
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.records import NewEvent
from eventstore.store import PostgresEventStore


async def _writers(
    dsn: str, writers: int, batch: int, start_at: float, duration_s: float, tag: str, lanes: int
) -> tuple[int, float]:
    """Events appended in the round, and the CPU seconds this client process spent on it."""
    db = await Database.connect(dsn, min_size=writers, max_size=writers)
    store = PostgresEventStore(db, append_lanes=lanes)
    done = 0
    # Every process starts at the same wall-clock instant, after its pool is connected.
    await asyncio.sleep(max(0.0, start_at - time.time()))
    deadline = time.perf_counter() + duration_s
    cpu_start = time.process_time()

    async def writer(w: int) -> None:
        nonlocal done
        stream = f"bench-{tag}-{w}"
        version = 0
        while time.perf_counter() < deadline:
            events = [NewEvent("BenchAppended", {"w": w, "n": version + k}) for k in range(batch)]
            result = await store.append(
                stream,
                events,
                expected_version=version,
                command_id=uuid.uuid4().hex,
                workspace_id="bench",
            )
            version = result.last_version
            done += batch

    try:
        await asyncio.gather(*(writer(w) for w in range(writers)))
        cpu = time.process_time() - cpu_start
    finally:
        await db.close()
    return done, cpu


def _proc_main(
    dsn: str,
    writers: int,
    batch: int,
    start_at: float,
    duration_s: float,
    tag: str,
    lanes: int,
    out: Any,
) -> None:
    out.put(asyncio.run(_writers(dsn, writers, batch, start_at, duration_s, tag, lanes)))


@dataclass(frozen=True)
class Round:
    events_per_s: float
    client_cpu_us_per_event: float
    """CPU time of the client processes (building events, encoding, the driver) per event."""


def run_round(
    dsn: str, writers: int, batch: int, duration_s: float, procs: int, lanes: int
) -> Round:
    """Events per second with `writers` concurrent appenders spread over `procs` processes."""
    procs = max(1, min(procs, writers))
    share = [writers // procs + (1 if p < writers % procs else 0) for p in range(procs)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tag = uuid.uuid4().hex[:6]
    start_at = time.time() + _STARTUP_S
    workers = [
        ctx.Process(
            target=_proc_main,
            args=(dsn, n, batch, start_at, duration_s, f"{tag}{p}", lanes, out),
        )
        for p, n in enumerate(share)
    ]
    for w in workers:
        w.start()
    outcomes = [out.get() for _ in workers]
    for w in workers:
        w.join()
    events = sum(done for done, _ in outcomes)
    cpu = sum(cpu for _, cpu in outcomes)
    return Round(events / duration_s, 1e6 * cpu / events if events else float("nan"))


_STARTUP_S = 3.0
"""Time given to client processes to import and connect before the round starts."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short rounds, to check it works")
    parser.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per round")
    parser.add_argument(
        "--lanes", type=int, default=4, help="appends in flight per client process (default 4)"
    )
    parser.add_argument(
        "--only", choices=("single", "batch"), help="run only the single-event or batch rounds"
    )
    args = parser.parse_args()
    duration = args.seconds or (1.0 if args.quick else 8.0)

    with server() as url:
        dsn = asyncio.run(create_database(url))
        try:

            async def prepare() -> str:
                db = await Database.connect(dsn)
                try:
                    await apply_migrations(db, [STORE_MIGRATIONS])
                finally:
                    await db.close()
                return await durability(dsn)

            print(f"store_append: durable commits ({asyncio.run(prepare())}), "
                  f"{duration:.0f} s per round, {args.procs} client processes, "
          f"{args.lanes} appends in flight per process")  # fmt: skip
            for writers in (1, 8, 32, 64) if args.only != "batch" else ():
                r = run_round(dsn, writers, 1, duration, args.procs, args.lanes)
                target = "  (target >= 8,000/s)" if writers == 32 else ""
                print(
                    f"single-event appends, {writers:>2} writers: {r.events_per_s:>9,.0f}/s  "
                    f"client CPU {r.client_cpu_us_per_event:5.1f} us/event{target}"
                )
            for writers in (8, 32) if args.only != "single" else ():
                r = run_round(dsn, writers, 10, duration, args.procs, args.lanes)
                print(
                    f"batches of 10 events,  {writers:>2} writers: {r.events_per_s:>9,.0f} "
                    f"events/s  client CPU {r.client_cpu_us_per_event:5.1f} us/event"
                    "  (target >= 50,000 events/s)"
                )
        finally:
            asyncio.run(drop_database(url, dsn))


if __name__ == "__main__":
    main()
