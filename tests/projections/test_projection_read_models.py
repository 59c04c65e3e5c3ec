"""Each read model, built by the runner from real events appended through the store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from projection_events import (
    T0,
    append,
    assistant_message,
    at,
    chat,
    deleted,
    key_hash,
    key_issued,
    key_revoked,
    moved,
    renamed,
    started,
    tagged,
    turn_failed,
    turn_started,
    user_message,
    workspace_created,
)

from eventstore import STORE_MIGRATIONS, Database, PostgresEventStore, apply_migrations
from projections import PROJECTION_MIGRATIONS, ProjectionRunner, default_projectors, queries

WS = "ws-alpha"


async def test_workspace_and_api_keys(store: PostgresEventStore, db: Database) -> None:
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Alpha", 0))
    await append(
        store,
        WS,
        f"workspace:{WS}",
        key_issued(WS, "k1", "svc_first_key", 1, scopes=("admin:read", "admin:write")),
        key_issued(WS, "k2", "svc_second_key", 2, rate_limit_rpm=60, expires_at=at(100)),
        key_revoked(WS, "k1", 3),
    )
    await ProjectionRunner(db, default_projectors()).catch_up()

    workspace = await queries.get_workspace(db, WS)
    assert workspace == queries.Workspace(WS, "Alpha", at(0))
    assert await queries.get_workspace(db, "ws-none") is None

    keys = await queries.list_api_keys(db, WS)
    assert [k.key_id for k in keys] == ["k2", "k1"]
    k2, k1 = keys
    assert k1.scopes == ["admin:read", "admin:write"] and k1.revoked_at == at(3)
    assert not k1.usable_at(at(4))
    assert k2.rate_limit_rpm == 60 and k2.expires_at == at(100) and k2.prefix == "svc_seco"
    assert k2.usable_at(at(99)) and not k2.usable_at(at(100))
    assert [k.key_id for k in await queries.list_api_keys(db, WS, include_revoked=False)] == ["k2"]

    found = await queries.find_api_key_by_hash(db, key_hash("svc_second_key"))
    assert found == k2
    assert await queries.find_api_key_by_hash(db, key_hash("svc_unknown")) is None


async def test_conversations_messages_and_turns(store: PostgresEventStore, db: Database) -> None:
    stream = "conversation:c1"
    await append(
        store,
        WS,
        stream,
        started(WS, "c1", 0, title="First", project_id="p1", tags=("a",)),
        user_message("c1", "m1", "hello", 1, "t1"),
        turn_started("c1", "t1", 1),
    )
    await append(store, WS, stream, assistant_message("c1", "t1", "m2", "hi there", 2, (10, 5)))
    await append(
        store,
        WS,
        stream,
        user_message("c1", "m3", "and now?", 3, "t2"),
        turn_started("c1", "t2", 3),
    )
    await append(store, WS, stream, turn_failed("c1", "t2", 5))
    await append(
        store,
        WS,
        stream,
        renamed("c1", "Renamed", 6),
        tagged("c1", ("x", "y"), 7),
        moved("c1", "inbox", 8),
    )
    await chat(store, WS, "c2", 1, first_minute=10)
    await chat(store, WS, "c3", 1, first_minute=20)
    await append(store, WS, "conversation:c3", deleted("c3", 30))

    await ProjectionRunner(db, default_projectors(), batch_size=4).catch_up()

    items, total = await queries.list_conversations(db, WS, limit=10)
    assert total == 2
    assert [c.id for c in items] == ["c2", "c1"]  # most recently updated first
    c1 = items[1]
    assert (c1.title, c1.project_id, c1.folder, c1.tags) == ("Renamed", "p1", "inbox", ["x", "y"])
    assert c1.created_at == T0 and c1.updated_at == at(8)
    assert c1.message_count == 3 and not c1.deleted
    page, total = await queries.list_conversations(db, WS, limit=1, offset=1)
    assert [c.id for c in page] == ["c1"] and total == 2
    with_deleted, total = await queries.list_conversations(db, WS, include_deleted=True)
    assert total == 3 and with_deleted[0].id == "c3"
    gone = await queries.get_conversation(db, WS, "c3")
    assert gone is not None and gone.deleted

    messages = await queries.get_messages(db, WS, "c1")
    assert [(m.seq, m.message_id, m.role, m.content, m.turn_id) for m in messages] == [
        (1, "m1", "user", "hello", "t1"),
        (2, "m2", "assistant", "hi there", "t1"),
        (3, "m3", "user", "and now?", "t2"),
    ]
    assert await queries.get_messages(db, WS, "nope") == []

    turns = await queries.list_turns(db, WS, "c1")
    assert [t.turn_id for t in turns] == ["t2", "t1"]
    failed, done = turns
    assert (done.status, done.prompt_tokens, done.completion_tokens, done.total_tokens) == (
        "completed",
        10,
        5,
        15,
    )
    assert (done.model, done.command_id, done.started_at, done.finished_at) == (
        "offline",
        "cmd-t1",
        at(1),
        at(2),
    )
    assert (failed.status, failed.error_code, failed.duration_ms) == (
        "failed",
        "ErrCallTimeout",
        120_000,
    )
    assert len(await queries.list_turns(db, WS)) == 4
    assert len(await queries.list_turns(db, WS, limit=1)) == 1

    overview = await queries.overview(db, WS)
    assert overview == queries.Overview(
        conversations=2,
        messages=7,
        turns=4,
        turns_running=0,
        turns_failed=1,
        total_tokens=15 + 7 + 7,
        api_keys_active=0,
    )


async def test_a_failed_turn_moves_the_conversations_updated_at(
    store: PostgresEventStore, db: Database
) -> None:
    """As the actor's state does: a conversation whose last turn failed (or was recorded as
    abandoned) was updated then, and lists before one whose last message came in between."""
    stream = "conversation:slow"
    await append(
        store,
        WS,
        stream,
        started(WS, "slow", 0),
        user_message("slow", "m1", "hi", 1, "t1"),
        turn_started("slow", "t1", 1),
    )
    await chat(store, WS, "quick", 1, first_minute=2)
    await append(store, WS, stream, turn_failed("slow", "t1", 5))
    await ProjectionRunner(db, default_projectors()).catch_up()

    items, _ = await queries.list_conversations(db, WS, limit=10)
    assert [(c.id, c.updated_at) for c in items] == [("slow", at(5)), ("quick", at(3))]


async def test_a_conversations_events_in_one_batch_give_its_row_as_one_by_one(
    store: PostgresEventStore, db: Database
) -> None:
    """The conversations projector folds a batch's writes per conversation (one insert for a
    start and its messages); a rename between two messages still lands on the inserted row,
    and the count and times are those of the events applied one at a time."""
    stream = "conversation:busy"
    await append(
        store,
        WS,
        stream,
        started(WS, "busy", 0, title="First"),
        user_message("busy", "m1", "hi", 1, "t1"),
        turn_started("busy", "t1", 1),
    )
    await chat(store, WS, "other", 2, first_minute=2)
    await append(store, WS, stream, assistant_message("busy", "t1", "m2", "hello", 3, (1, 1)))
    await append(store, WS, stream, renamed("busy", "Renamed", 4))
    await append(
        store,
        WS,
        stream,
        user_message("busy", "m3", "more", 5, "t2"),
        turn_started("busy", "t2", 5),
    )
    await append(store, WS, stream, turn_failed("busy", "t2", 9))
    await ProjectionRunner(db, default_projectors(), batch_size=500).catch_up()
    one_batch = await queries.get_conversation(db, WS, "busy")
    other = await queries.get_conversation(db, WS, "other")

    assert one_batch is not None and other is not None
    assert (one_batch.title, one_batch.message_count) == ("Renamed", 3)
    assert (one_batch.created_at, one_batch.updated_at) == (T0, at(9))
    assert other.message_count == 4 and other.created_at == at(2)


async def test_running_turn_and_analytics(store: PostgresEventStore, db: Database) -> None:
    await chat(store, WS, "c1", 2)  # turns at minutes 1 and 2, 7 tokens each
    stream = "conversation:c1"
    await append(
        store,
        WS,
        stream,
        user_message("c1", "late", "x", 60 * 25, "t9"),
        turn_started("c1", "t9", 60 * 25),
    )
    await append(store, WS, stream, user_message("c1", "late2", "y", 60 * 26, "t10"))
    await append(store, WS, stream, turn_failed("c1", "t10", 60 * 26))
    await ProjectionRunner(db, default_projectors()).catch_up()

    result = await queries.analytics(db, WS, since=T0, until=T0 + timedelta(days=2), bucket="day")
    assert result.totals.turns == 4
    assert (result.totals.completed, result.totals.failed, result.totals.running) == (2, 1, 1)
    assert result.totals.total_tokens == 14
    # [09:00 on day 1, 09:00 on day 3) touches three UTC days; the last one is empty.
    assert len(result.series) == 3
    day1, day2, day3 = result.series
    assert day3.figures.turns == 0 and day3.figures.avg_duration_ms is None
    assert day1.start == T0.replace(hour=0) and day2.start == day1.start + timedelta(days=1)
    assert (day1.figures.turns, day1.figures.completed, day1.figures.total_tokens) == (2, 2, 14)
    assert day1.figures.avg_duration_ms == 100.0
    assert (day2.figures.turns, day2.figures.running, day2.figures.failed) == (2, 1, 1)

    hourly = await queries.analytics(db, WS, since=T0, until=T0 + timedelta(hours=3), bucket="hour")
    assert [b.figures.turns for b in hourly.series] == [2, 0, 0]
    assert hourly.totals.turns == 2


async def test_day_buckets_are_utc_days_whatever_the_database_time_zone(
    database_url: str,
) -> None:
    """A database whose default time zone keeps summer time (Europe/Berlin, which leaves it
    on 2026-10-25): the buckets still start at UTC midnights and add up to the totals."""
    admin = await asyncpg.connect(database_url)
    try:
        name = await admin.fetchval("SELECT current_database()")
        await admin.execute(f"ALTER DATABASE \"{name}\" SET timezone = 'Europe/Berlin'")
    finally:
        await admin.close()
    db = await Database.connect(database_url, max_size=4)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS, PROJECTION_MIGRATIONS])
        store = PostgresEventStore(db)
        for cid, day in (("before", 24), ("after", 27)):
            when = datetime(2026, 10, day, 12, 0, tzinfo=UTC)
            await chat(store, WS, cid, 1, first_minute=(when - T0).total_seconds() / 60)
        await ProjectionRunner(db, default_projectors()).catch_up()
        since, until = datetime(2026, 10, 20, tzinfo=UTC), datetime(2026, 10, 30, tzinfo=UTC)
        result = await queries.analytics(db, WS, since=since, until=until, bucket="day")
    finally:
        await db.close()
    assert result.totals.turns == 2
    assert sum(b.figures.turns for b in result.series) == 2
    assert [b.start for b in result.series] == [since + timedelta(days=n) for n in range(10)]


async def test_conversation_pages_after_a_row_tie_break_on_id(
    store: PostgresEventStore, db: Database
) -> None:
    """Paging by `after` goes on past the page's last row in `updated_at DESC, id` order:
    rows updated at the same instant are neither skipped nor met twice."""
    ws = "ws-keyset"
    for cid, minute in (("k-b", 5), ("k-a", 5), ("k-c", 5), ("k-z", 9), ("k-old", 1)):
        await append(store, ws, f"conversation:{cid}", started(ws, cid, minute))
    await ProjectionRunner(db, default_projectors()).catch_up()

    walked: list[str] = []
    after = None
    while True:
        page, total = await queries.list_conversations(db, ws, limit=2, after=after)
        assert total == 5  # counts every conversation, wherever the page starts
        walked += [c.id for c in page]
        if len(page) < 2:
            break
        after = (page[-1].updated_at, page[-1].id)
    assert walked == ["k-z", "k-a", "k-b", "k-c", "k-old"]
