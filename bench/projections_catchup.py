"""Benchmarks of the projections. Prints figures; asserts nothing.

    .venv/bin/python bench/projections_catchup.py [--quick] [--dsn DSN]

(a) catch-up throughput: every read model built from a log of N conversations (events/s),
    for a few batch sizes; each batch is one transaction moving the checkpoint (durable commits).
(b) rebuild of the messages read model with progress, events/s.
(c) read-your-writes latency: append one event, then `wait_for(cursor)` on a started runner
    woken by the commit signal; p50/p99 over many round trips.

Without --dsn it runs on a throwaway embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from eventstore import (
    STORE_MIGRATIONS,
    Database,
    NewEvent,
    PostgresEventStore,
    apply_migrations,
)
from eventstore.embedded import EmbeddedPostgres
from projections import (
    PROJECTION_MIGRATIONS,
    ProjectionRunner,
    default_projectors,
)
from schemas.conversation import (
    AssistantMessageCompleted,
    ConversationStarted,
    TurnParams,
    TurnStarted,
    UserMessageReceived,
)
from schemas.events import EVENTS, Event

T0 = datetime(2026, 1, 1, tzinfo=UTC)
WS = "ws-bench"


def _new(ev: Event) -> NewEvent:
    type_name, version, data = EVENTS.encode(ev)
    return NewEvent(type=type_name, data=data, schema_version=version)


def _conversation(cid: str, turns: int) -> list[NewEvent]:
    out = [
        _new(
            ConversationStarted(
                conversation_id=cid,
                workspace_id=WS,
                title=f"bench {cid}",
                project_id=None,
                folder=None,
                tags=("bench",),
                agent=None,
                model="offline",
                at=T0,
            )
        )
    ]
    for i in range(turns):
        at = T0 + timedelta(seconds=i)
        tid = f"{cid}-t{i}"
        out.append(
            _new(
                UserMessageReceived(
                    conversation_id=cid,
                    message_id=f"{tid}-u",
                    content="question " * 20,
                    name=None,
                    turn_id=tid,
                    at=at,
                )
            )
        )
        out.append(
            _new(
                TurnStarted(
                    conversation_id=cid,
                    turn_id=tid,
                    command_id=tid,
                    model="offline",
                    params=TurnParams(),
                    request_messages=2 * i + 1,
                    at=at,
                )
            )
        )
        out.append(
            _new(
                AssistantMessageCompleted(
                    conversation_id=cid,
                    turn_id=tid,
                    message_id=f"{tid}-a",
                    content="answer " * 60,
                    finish_reason="stop",
                    prompt_tokens=100,
                    completion_tokens=60,
                    total_tokens=160,
                    duration_ms=900,
                    at=at,
                )
            )
        )
    return out


async def _fresh_db(server_url: str) -> tuple[Database, str]:
    name = "bench_" + uuid.uuid4().hex[:10]
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    parts = urlsplit(server_url)
    db = await Database.connect(urlunsplit(parts._replace(path="/" + name)), max_size=8)
    await apply_migrations(db, [STORE_MIGRATIONS, PROJECTION_MIGRATIONS])
    return db, name


async def _fill(store: PostgresEventStore, conversations: int, turns: int) -> int:
    total = 0
    for c in range(conversations):
        events = _conversation(f"c{c}", turns)
        await store.append(
            f"conversation:c{c}",
            events,
            expected_version=0,
            command_id=uuid.uuid4().hex,
            workspace_id=WS,
        )
        total += len(events)
    return total


async def bench(server_url: str, quick: bool) -> None:
    conversations, turns = (100, 10) if quick else (500, 20)
    db, _ = await _fresh_db(server_url)
    store = PostgresEventStore(db)
    events = await _fill(store, conversations, turns)
    print(f"log: {events} events ({conversations} conversations x {turns} turns)")

    for batch in (100, 500, 2000):
        runner = ProjectionRunner(db, default_projectors(), batch_size=batch)
        for name in runner.names:
            await runner.rebuild(name)  # warm-up and reset
        async with db.transaction() as conn:
            await conn.execute("UPDATE projection_checkpoints SET tx = '0', position = 0")
            for projector in default_projectors():
                await projector.reset(conn)
        started = time.perf_counter()
        await runner.catch_up()
        elapsed = time.perf_counter() - started
        print(
            f"(a) catch-up, 5 read models, batch {batch}: {elapsed:.2f} s, "
            f"{events / elapsed:,.0f} events/s per read model"
        )

    runner = ProjectionRunner(db, default_projectors())
    reports: list[tuple[int, int]] = []
    started = time.perf_counter()
    await runner.rebuild("messages", lambda done, total: reports.append((done, total)))
    elapsed = time.perf_counter() - started
    print(
        f"(b) rebuild messages: {elapsed:.2f} s, {events / elapsed:,.0f} events/s, "
        f"{len(reports)} progress reports"
    )

    runner = ProjectionRunner(db, default_projectors(), poll_interval_s=0.075)
    await runner.start()
    samples: list[float] = []
    rounds = 100 if quick else 500
    try:
        for i in range(rounds):
            events_i = _conversation(f"rw{i}", 1)
            started = time.perf_counter()
            result = await store.append(
                f"conversation:rw{i}",
                events_i,
                expected_version=0,
                command_id=uuid.uuid4().hex,
                workspace_id=WS,
            )
            runner.wake()
            await runner.wait_for(result.cursor, 30.0)
            samples.append((time.perf_counter() - started) * 1000)
    finally:
        await runner.stop()
    samples.sort()
    p99 = samples[int(len(samples) * 0.99) - 1]
    print(
        f"(c) append + read-your-writes on 5 read models: p50 {statistics.median(samples):.1f} ms, "
        f"p99 {p99:.1f} ms over {rounds} round trips"
    )
    await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dsn", help="a server URL whose user may create databases")
    args = parser.parse_args()
    if args.dsn:
        asyncio.run(bench(args.dsn, args.quick))
        return
    with tempfile.TemporaryDirectory(prefix="svc-bench-pg-") as tmp:
        Path(tmp).chmod(0o755)
        server = EmbeddedPostgres(Path(tmp))
        url = server.start()
        try:
            asyncio.run(bench(url, args.quick))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
