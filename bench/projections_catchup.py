"""Benchmarks of the projections. Prints figures; asserts nothing.

    .venv/bin/python bench/projections_catchup.py [--quick] [--dsn DSN]

(a) catch-up throughput: every read model built from a log of N conversations (events/s),
    for a few batch sizes; each batch is one transaction moving the checkpoint (durable commits).
(b) rebuild of the messages read model with progress, events/s.
(c) read-your-writes latency: append one event, then `wait_for(cursor)` on a started runner
    woken by the commit signal; p50/p99 over many round trips.
(d) cost per chat turn under load: a writer process appends chat turns the way the
    conversation actor does (UserMessageReceived + TurnStarted in one append, a
    ConversationStarted before every fifth turn's pair, AssistantMessageCompleted in a second
    append) at `--rate` turns/s, while this process runs the 7 read models in the background
    woken by LISTEN/NOTIFY, as `svc serve` does. Prints this process's CPU per turn (the runner
    and its notifier), its statements (round trips) and transactions per turn, the database
    server's CPU per turn (writer included: compare runs at the same rate), and how long the
    runner takes to reach the head once the writer stops.

Without --dsn it runs on a throwaway embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
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
from eventstore.notify import CommitNotifier
from projections import (
    PROJECTION_MIGRATIONS,
    ProjectionRunner,
    default_projectors,
)
from projections import rebuild as rebuild_module
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


def _started(cid: str) -> NewEvent:
    return _new(
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


def _turn(cid: str, i: int) -> tuple[NewEvent, NewEvent, NewEvent]:
    """Turn `i` of a conversation: the user's message, the turn's start, the answer."""
    at = T0 + timedelta(seconds=i)
    tid = f"{cid}-t{i}"
    user = UserMessageReceived(
        conversation_id=cid,
        message_id=f"{tid}-u",
        content="question " * 20,
        name=None,
        turn_id=tid,
        at=at,
    )
    started = TurnStarted(
        conversation_id=cid,
        turn_id=tid,
        command_id=tid,
        model="offline",
        params=TurnParams(),
        request_messages=2 * i + 1,
        at=at,
    )
    answer = AssistantMessageCompleted(
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
    return _new(user), _new(started), _new(answer)


def _conversation(cid: str, turns: int) -> list[NewEvent]:
    out = [_started(cid)]
    for i in range(turns):
        out.extend(_turn(cid, i))
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


async def _write_turns(dsn: str, rate: float, seconds: float, workers: int) -> None:
    """Writer process of (d): `rate` turns/s from `workers` tasks, 5 turns per conversation.

    Worker k takes the global turn slots k, k + workers, ...: its conversations' turns are
    appended in order, two appends per turn, like the conversation actor's."""
    db = await Database.connect(dsn, max_size=workers)
    notifier = CommitNotifier(db)
    await notifier.start()
    store = PostgresEventStore(db, on_commit=notifier.committed)
    total = int(rate * seconds)
    begin = time.perf_counter()

    async def worker(k: int) -> None:
        for j, slot in enumerate(range(k, total, workers)):
            await asyncio.sleep(max(0.0, begin + slot / rate - time.perf_counter()))
            cid, i = f"load{k}-{j // 5}", j % 5
            user, started, answer = _turn(cid, i)
            request = ([_started(cid)] if i == 0 else []) + [user, started]
            for events in (request, [answer]):
                await store.append(
                    f"conversation:{cid}",
                    events,
                    expected_version=None,
                    command_id=uuid.uuid4().hex,
                    workspace_id=WS,
                )

    await asyncio.gather(*(worker(k) for k in range(workers)))
    elapsed = time.perf_counter() - begin
    print(f"{total} {elapsed:.3f}", flush=True)
    await notifier.stop()
    await db.close()


class _Statements:
    """Counts what this process sends to the server: one count per statement (a round trip;
    an executemany is one), and BEGINs apart."""

    def __init__(self) -> None:
        self.sent = 0
        self.begins = 0
        self._originals: dict[str, object] = {}

    def install(self) -> None:
        for name in ("execute", "executemany", "fetch", "fetchrow", "fetchval"):
            original = getattr(asyncpg.Connection, name)
            self._originals[name] = original

            async def counted(conn, query, *args, __original=original, **kwargs):  # type: ignore[no-untyped-def]
                self.sent += 1
                if isinstance(query, str) and query.lstrip().upper().startswith("BEGIN"):
                    self.begins += 1
                return await __original(conn, query, *args, **kwargs)

            setattr(asyncpg.Connection, name, counted)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(asyncpg.Connection, name, original)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _server_cpu_s(pgdata: Path | None) -> float | None:
    """CPU seconds of the server's processes now alive (postmaster's children), or None."""
    if pgdata is None:
        return None
    try:
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster or int(entry.name) == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


async def bench_load(
    server_url: str, pgdata: Path | None, rate: float, seconds: float, workers: int
) -> None:
    db, name = await _fresh_db(server_url)
    dsn = urlunsplit(urlsplit(server_url)._replace(path="/" + name))
    notifier = CommitNotifier(db)
    await notifier.start()
    runner = ProjectionRunner(db, default_projectors(), notifier=notifier)
    await runner.start()
    counter = _Statements()
    await asyncio.sleep(0.5)  # the runner's first batches and the LISTEN connection
    counter.install()
    cpu0, server0, started = _cpu_s(), _server_cpu_s(pgdata), time.perf_counter()
    writer = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--writer",
        dsn,
        "--rate",
        str(rate),
        "--seconds",
        str(seconds),
        "--workers",
        str(workers),
        stdout=subprocess.PIPE,
    )
    out, _ = await writer.communicate()
    turns, write_s = int(out.split()[0]), float(out.split()[1])
    head = await PostgresEventStore(db).head()
    stopped = time.perf_counter()
    ok = await runner.wait_for(head, 120.0)
    drained = time.perf_counter() - stopped
    cpu, server = _cpu_s() - cpu0, _server_cpu_s(pgdata)
    elapsed = time.perf_counter() - started
    counter.uninstall()
    await runner.stop()
    await notifier.stop()
    async with db.acquire() as conn:
        events = await conn.fetchval("SELECT count(*) FROM events")
    await db.close()
    server_txt = (
        f", server CPU {(server - server0) / turns * 1e3:.2f} ms/turn (writer included)"
        if server is not None and server0 is not None
        else ""
    )
    print(
        f"(d) chat load, 7 read models: {turns} turns ({events} events) in {write_s:.1f} s "
        f"= {turns / write_s:,.0f} turns/s offered; runner process CPU "
        f"{cpu / turns * 1e3:.3f} ms/turn ({cpu / elapsed * 100:.0f}% of a core), "
        f"{counter.sent / turns:.1f} statements/turn, {counter.begins / turns:.2f} "
        f"transactions/turn{server_txt}; head reached {drained * 1e3:.0f} ms after the "
        f"writer stopped{'' if ok else ' (NOT reached in 120 s)'}"
    )


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
                await conn.execute("TRUNCATE " + ", ".join(projector.tables))
        started = time.perf_counter()
        await runner.catch_up()
        elapsed = time.perf_counter() - started
        print(
            f"(a) catch-up, {len(runner.names)} read models, batch {batch}: {elapsed:.2f} s, "
            f"{events / elapsed:,.0f} events/s per read model"
        )

    runner = ProjectionRunner(db, default_projectors())
    reports: list[tuple[int, int]] = []
    switches: list[float] = []
    real_switch = rebuild_module._switch

    async def timed_switch(*args: Any) -> Any:
        began = time.perf_counter()
        try:
            return await real_switch(*args)
        finally:
            switches.append(time.perf_counter() - began)

    rebuild_module._switch = timed_switch  # type: ignore[assignment]
    started = time.perf_counter()
    replayed = await runner.rebuild(
        "messages", lambda done, total, _phase: reports.append((done, total))
    )
    elapsed = time.perf_counter() - started
    rebuild_module._switch = real_switch  # type: ignore[assignment]
    async with db.acquire() as conn:
        rows = await conn.fetchval("SELECT count(*) FROM messages")
    print(
        f"(b) rebuild messages: {elapsed:.2f} s for {replayed} events of its types "
        f"({replayed / elapsed:,.0f}/s; log of {events}), {len(reports)} progress reports; "
        f"the switch {switches[0] * 1e3:.0f} ms for {rows} rows"
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
        f"(c) append + read-your-writes on {len(runner.names)} read models: "
        f"p50 {statistics.median(samples):.1f} ms, p99 {p99:.1f} ms over {rounds} round trips"
    )
    await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dsn", help="a server URL whose user may create databases")
    parser.add_argument(
        "--only", choices=("catchup", "load"), help="run (a)-(c) or (d) only (default: all)"
    )
    parser.add_argument("--rate", type=float, default=300.0, help="(d): turns/s offered")
    parser.add_argument("--seconds", type=float, default=20.0, help="(d): writer duration")
    parser.add_argument("--workers", type=int, default=16, help="(d): concurrent writers")
    parser.add_argument("--writer", metavar="DSN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        asyncio.run(_write_turns(args.writer, args.rate, args.seconds, args.workers))
        return

    async def run(url: str, pgdata: Path | None) -> None:
        if args.only != "load":
            await bench(url, args.quick)
        if args.only != "catchup":
            seconds = min(args.seconds, 10.0) if args.quick else args.seconds
            await bench_load(url, pgdata, args.rate, seconds, args.workers)

    if args.dsn:
        asyncio.run(run(args.dsn, None))
        return
    with tempfile.TemporaryDirectory(prefix="svc-bench-pg-") as tmp:
        Path(tmp).chmod(0o755)
        server = EmbeddedPostgres(Path(tmp))
        url = server.start()
        try:
            asyncio.run(run(url, server.pgdata))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
