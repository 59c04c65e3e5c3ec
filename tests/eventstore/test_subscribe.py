"""Subscriptions over the gap-free log: the tailer, its fan-out, the handoff and the wake-ups.

Each test runs the real stack on a real PostgreSQL: Database pool, CommitNotifier (after-commit
signal plus LISTEN/NOTIFY), LogTailer and PostgresEventStore.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import asyncpg
import orjson
import pytest

from eventstore.cursor import ORIGIN, LogPoint
from eventstore.db import Database
from eventstore.errors import InvalidCursor
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.notify import CommitNotifier
from eventstore.records import NewEvent, RecordedEvent
from eventstore.store import PostgresEventStore
from eventstore.tailer import LogTailer, SubscriberTooSlow

# A bound on how long a test waits for something that must happen; never a measured figure.
PATIENCE_S = 30.0


@dataclass
class Stack:
    db: Database
    notifier: CommitNotifier
    tailer: LogTailer
    store: PostgresEventStore

    async def close(self) -> None:
        await self.tailer.stop()
        await self.notifier.stop()
        await self.db.close()


async def open_stack(
    dsn: str, *, poll_interval_s: float = 0.075, max_queue: int = 10_000, migrate: bool = True
) -> Stack:
    db = await Database.connect(dsn, max_size=8)
    if migrate:
        await apply_migrations(db, [STORE_MIGRATIONS])
    notifier = CommitNotifier(db)
    tailer = LogTailer(db, notifier, poll_interval_s=poll_interval_s, max_queue=max_queue)
    store = PostgresEventStore(db, on_commit=notifier.committed, subscriber=tailer)
    await notifier.start()
    await tailer.start()
    return Stack(db, notifier, tailer, store)


@pytest.fixture
async def stack(database_url: str) -> AsyncIterator[Stack]:
    s = await open_stack(database_url)
    try:
        yield s
    finally:
        await s.close()


async def full_log(store: PostgresEventStore) -> list[RecordedEvent]:
    """A fresh full read_all from the start: the order every subscriber must reproduce."""
    out: list[RecordedEvent] = []
    cursor: str | None = None
    while True:
        page = await store.read_all(cursor, 5000)
        out.extend(page)
        if len(page) < 5000:
            return out
        cursor = page[-1].cursor


async def append_one(store: PostgresEventStore, stream: str, ws: str = "ws1") -> None:
    await store.append(
        stream,
        [NewEvent("Ticked", {"stream": stream})],
        expected_version=None,
        command_id=uuid.uuid4().hex,
        workspace_id=ws,
    )


async def wait_until(predicate: object, what: str) -> None:
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE_S
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


class Reader:
    """Consumes one subscription into a list, in the background."""

    def __init__(self, it: AsyncIterator[RecordedEvent]) -> None:
        self.events: list[RecordedEvent] = []
        self.error: BaseException | None = None
        self._it = it
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for event in self._it:
                self.events.append(event)
        except Exception as exc:
            self.error = exc

    def ids(self) -> list[uuid.UUID]:
        return [e.event_id for e in self.events]


_RAW_INSERT = """
INSERT INTO events (stream_id, version, event_id, workspace_id, type, data)
SELECT $1, $2 + n, gen_random_uuid(), $3, 'RawWritten', $4::jsonb
FROM generate_series(1, $5) AS n
"""


async def raw_writer(
    dsn: str, idx: int, transactions: int, notifier: CommitNotifier, rng: random.Random
) -> None:
    """Writes in transactions held open 0-20 ms after taking their xid, so commits land out
    of xid order; some roll back; only some signal the notifier (the rest rely on the poll)."""
    conn = await asyncpg.connect(dsn)
    try:
        for t in range(transactions):
            count = rng.randint(1, 3)
            rollback = rng.random() < 0.1
            tr = conn.transaction()
            await tr.start()
            await conn.execute(
                _RAW_INSERT,
                f"raw-{idx}-{t}",
                0,
                f"ws{idx % 3}",
                orjson.dumps({"w": idx, "t": t}).decode(),
                count,
            )
            hold = rng.random() * 0.02
            if rng.random() < 0.5:
                await conn.execute("SELECT pg_sleep($1)", hold)
            else:
                await asyncio.sleep(hold)
            if rollback:
                await tr.rollback()
                continue
            await tr.commit()
            if idx % 2 == 0:
                notifier.committed()
    finally:
        await conn.close()


async def store_writer(
    store: PostgresEventStore, idx: int, appends: int, rng: random.Random
) -> None:
    for n in range(appends):
        events = [NewEvent("StoreWritten", {"w": idx, "n": n}) for _ in range(rng.randint(1, 4))]
        await store.append(
            f"store-{idx}",
            events,
            expected_version=None,
            command_id=f"store-{idx}-{n}",
            workspace_id=f"ws{idx % 3}",
        )
        await asyncio.sleep(rng.random() * 0.005)


def assert_same_sequence(seen: Sequence[RecordedEvent], expected: Sequence[RecordedEvent]) -> None:
    seen_ids = [e.event_id for e in seen]
    expected_ids = [e.event_id for e in expected]
    assert len(set(seen_ids)) == len(seen_ids), "an event was delivered twice"
    missing = set(expected_ids) - set(seen_ids)
    assert not missing, f"{len(missing)} committed events never delivered"
    assert seen_ids == expected_ids, "delivered in a different order than the gap-free log"


async def test_concurrent_writers_every_reader_sees_every_event_once_in_log_order(
    database_url: str, stack: Stack
) -> None:
    rng = random.Random(20261121)
    # History before any reader starts, so mid-way cursors exist.
    for n in range(300):
        await append_one(stack.store, f"pre-{n % 3}", ws=f"ws{n % 3}")
    history = await full_log(stack.store)
    mid_cursor = history[150].cursor

    early = {
        "from_start": Reader(stack.store.subscribe(None)),
        "from_mid": Reader(stack.store.subscribe(mid_cursor)),
        "ws1_from_start": Reader(stack.store.subscribe(None, workspace_id="ws1")),
        "types_raw": Reader(stack.store.subscribe("", types=["RawWritten"])),
    }

    writers = [
        asyncio.create_task(
            raw_writer(database_url, i, 40, stack.notifier, random.Random(rng.random()))
        )
        for i in range(16)
    ]
    writers += [
        asyncio.create_task(store_writer(stack.store, i, 60, random.Random(rng.random())))
        for i in range(4)
    ]
    # Readers joining while writers are busy exercise the catch-up to live handoff under load.
    await asyncio.sleep(0.3)
    late_cursor = (await full_log(stack.store))[-1].cursor
    late = {
        "late_from_start": Reader(stack.store.subscribe(None)),
        "late_from_recent": Reader(stack.store.subscribe(late_cursor)),
    }
    await asyncio.gather(*writers)

    expected = await full_log(stack.store)
    assert len(expected) > 1500
    late_cut = next(i for i, e in enumerate(expected) if e.cursor == late_cursor) + 1
    wants = {
        "from_start": expected,
        "from_mid": expected[151:],
        "ws1_from_start": [e for e in expected if e.workspace_id == "ws1"],
        "types_raw": [e for e in expected if e.type == "RawWritten"],
        "late_from_start": expected,
        "late_from_recent": expected[late_cut:],
    }
    readers = early | late
    await wait_until(
        lambda: all(len(readers[k].events) >= len(wants[k]) for k in readers),
        "every reader to receive every committed event",
    )
    # One more read pass: a duplicate or stray event would arrive now.
    stack.tailer.wake()
    await asyncio.sleep(0.3)
    await stack.tailer.stop()
    await asyncio.gather(*(r.task for r in readers.values()))
    for name, reader in readers.items():
        assert reader.error is None, f"{name}: {reader.error!r}"
        assert_same_sequence(reader.events, wants[name])


async def test_notify_from_another_process_wakes_the_tailer(database_url: str) -> None:
    # The local tailer never polls, so only the NOTIFY sent by the other process can wake it.
    local = await open_stack(database_url, poll_interval_s=3600.0)
    remote = await open_stack(database_url, migrate=False)
    try:
        await wait_until(lambda: local.notifier.listening, "the LISTEN connection")
        reader = Reader(local.store.subscribe(None))
        await append_one(remote.store, "remote-1")
        await wait_until(lambda: len(reader.events) == 1, "the first remote event")
        await append_one(remote.store, "remote-2")
        await wait_until(lambda: len(reader.events) == 2, "the second remote event")
        assert local.notifier.notifies_received >= 1
        assert [e.stream_id for e in reader.events] == ["remote-1", "remote-2"]
    finally:
        await remote.close()
        await local.close()


async def test_listen_connection_comes_back_after_the_database_drops_it(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    local = await open_stack(database_url, poll_interval_s=3600.0)
    remote = await open_stack(database_url, migrate=False)
    try:
        await wait_until(lambda: local.notifier.listening, "the LISTEN connection")
        first = local.notifier.listen_sessions
        admin = await asyncpg.connect(database_url)
        try:
            # An outage as the server sees it: every other session of this database is killed.
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        finally:
            await admin.close()
        await wait_until(
            lambda: local.notifier.listen_sessions > first and local.notifier.listening,
            "the LISTEN connection to come back",
        )
        reader = Reader(local.store.subscribe(None))
        for n in range(3):
            await _append_retrying(remote.store, f"after-outage-{n}")
        await wait_until(lambda: len(reader.events) == 3, "events after the outage")
        assert [e.stream_id for e in reader.events] == [f"after-outage-{n}" for n in range(3)]
        # The log says why the session ended, not what tidying up after it tripped over.
        assert not [r for r in caplog.records if "released back to the pool" in r.getMessage()]
    finally:
        await remote.close()
        await local.close()


async def _append_retrying(store: PostgresEventStore, stream: str) -> None:
    # The pool may hand out a connection killed by the outage once; the store reports it as
    # StoreUnavailable and the command id makes the retry safe.
    command_id = uuid.uuid4().hex
    for _ in range(5):
        try:
            await store.append(
                stream,
                [NewEvent("Ticked", {})],
                expected_version=None,
                command_id=command_id,
                workspace_id="ws1",
            )
            return
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError(f"append to {stream} kept failing")


async def test_slow_subscriber_is_cut_off_with_its_last_cursor(database_url: str) -> None:
    s = await open_stack(database_url, max_queue=50)
    try:
        slow = s.store.subscribe(None)
        fast = Reader(s.store.subscribe(None))
        await append_one(s.store, "e-1")
        first = await asyncio.wait_for(anext(slow), PATIENCE_S)
        # The second event can only reach `slow` through the live queue (its history page was
        # read before this append), so from here on `slow` is a live subscriber.
        second_task: asyncio.Future[RecordedEvent] = asyncio.ensure_future(anext(slow))
        await append_one(s.store, "e-2")
        second = await asyncio.wait_for(second_task, PATIENCE_S)
        assert [first.stream_id, second.stream_id] == ["e-1", "e-2"]

        for n in range(3, 203):
            await append_one(s.store, f"e-{n}")
        await wait_until(lambda: len(fast.events) == 202, "the fast reader to get everything")

        with pytest.raises(SubscriberTooSlow) as cut:
            await asyncio.wait_for(anext(slow), PATIENCE_S)
        assert cut.value.last_cursor == second.cursor
        assert s.tailer.cut_off_total == 1
        assert fast.error is None

        resumed = s.store.subscribe(cut.value.last_cursor)
        rest = [await asyncio.wait_for(anext(resumed), PATIENCE_S) for _ in range(200)]
        await resumed.aclose()  # type: ignore[attr-defined]
        assert [e.stream_id for e in rest] == [f"e-{n}" for n in range(3, 203)]
        assert_same_sequence(fast.events, await full_log(s.store))
    finally:
        await s.close()


async def test_resuming_from_cursors_never_skips_or_repeats(
    database_url: str, stack: Stack
) -> None:
    rng = random.Random(7)
    writers = [
        asyncio.create_task(raw_writer(database_url, i, 30, stack.notifier, random.Random(i)))
        for i in range(6)
    ]
    writers.append(asyncio.create_task(store_writer(stack.store, 0, 60, random.Random(99))))
    seen: list[RecordedEvent] = []
    seen_ws2: list[RecordedEvent] = []
    cursor: str | None = None
    cursor_ws2: str | None = None
    # Take a few events, disconnect, resume from the last cursor; repeat while writers run.
    while not all(w.done() for w in writers):
        cursor = await _take(stack.store.subscribe(cursor), rng.randint(1, 40), seen, cursor)
        cursor_ws2 = await _take(
            stack.store.subscribe(cursor_ws2, workspace_id="ws2"), 5, seen_ws2, cursor_ws2
        )
    await asyncio.gather(*writers)
    expected = await full_log(stack.store)
    expected_ws2 = [e for e in expected if e.workspace_id == "ws2"]
    while len(seen) < len(expected):
        cursor = await _take(stack.store.subscribe(cursor), 100, seen, cursor)
    while len(seen_ws2) < len(expected_ws2):
        cursor_ws2 = await _take(
            stack.store.subscribe(cursor_ws2, workspace_id="ws2"), 100, seen_ws2, cursor_ws2
        )
    assert_same_sequence(seen, expected)
    assert_same_sequence(seen_ws2, expected_ws2)


async def _take(
    it: AsyncIterator[RecordedEvent], n: int, into: list[RecordedEvent], cursor: str | None
) -> str | None:
    """Up to n events (fewer if none arrives for a while); returns the cursor to resume from."""
    try:
        for _ in range(n):
            try:
                event = await asyncio.wait_for(anext(it), 0.5)
            except TimeoutError:
                break
            into.append(event)
            cursor = event.cursor
    finally:
        await it.aclose()  # type: ignore[attr-defined]
    return cursor


async def test_malformed_cursor_is_rejected_before_iterating(stack: Stack) -> None:
    with pytest.raises(InvalidCursor):
        stack.tailer.subscribe("not-a-cursor")
    with pytest.raises(InvalidCursor):
        stack.store.subscribe("c1AAAA")


async def test_stop_ends_every_subscription(stack: Stack) -> None:
    await append_one(stack.store, "s-1")
    readers = [Reader(stack.store.subscribe(None)) for _ in range(3)]
    await wait_until(lambda: all(len(r.events) == 1 for r in readers), "the first event")
    assert stack.tailer.subscriber_count == 3
    await stack.tailer.stop()
    await asyncio.wait_for(asyncio.gather(*(r.task for r in readers)), PATIENCE_S)
    assert all(r.error is None for r in readers)
    assert stack.tailer.subscriber_count == 0


async def test_live_point_follows_the_log(stack: Stack) -> None:
    assert stack.tailer.live_point == ORIGIN
    await append_one(stack.store, "p-1")
    head = (await full_log(stack.store))[-1].point
    await wait_until(lambda: stack.tailer.live_point == head, "the tailer to reach the head")
    assert isinstance(stack.tailer.live_point, LogPoint)
    assert stack.tailer.live_cursor == await stack.store.head()
    assert stack.tailer.lag >= 0.0


async def test_a_burst_of_commits_sends_one_notify_and_wakes_listeners_each_time(
    stack: Stack,
) -> None:
    woken: list[int] = []
    stack.notifier.add_listener(lambda: woken.append(1))
    before = stack.notifier.notifies_sent
    for _ in range(500):
        stack.notifier.committed()
    assert len(woken) == 500
    await wait_until(lambda: stack.notifier.notifies_sent > before, "the NOTIFY")
    await asyncio.sleep(0.2)
    assert stack.notifier.notifies_sent == before + 1


async def test_stop_ends_the_tailer_wherever_its_cancellation_lands(
    store_db: Database, stops_wherever_cancelled: Callable[..., Awaitable[None]]
) -> None:
    """The tailer looped on after a cancellation that Python 3.11's `asyncio.wait_for`
    dropped, and `stop()` waited for it forever: a 300 s teardown hang in CI."""
    notifier = CommitNotifier(store_db)
    await stops_wherever_cancelled(lambda: LogTailer(store_db, notifier, poll_interval_s=30.0))
