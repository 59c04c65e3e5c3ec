"""Appends that share a round trip (svc_append_batch) still succeed or fail one by one.

The store runs with one lane, so appends started together (up to 32) leave as one batch.
Each test checks the batch really formed (events grouped by transaction id) so it cannot
pass by sending the appends one at a time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from eventstore.db import Database
from eventstore.errors import ConcurrencyConflict, InvalidAppend, StoreUnavailable
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.records import AppendResult, NewEvent
from eventstore.store import PostgresEventStore

WS = "ws-batch"


def ev(**data: Any) -> NewEvent:
    return NewEvent(type="thing.Happened", data=data or {"n": 1})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def append(
    store: PostgresEventStore,
    stream_id: str | None = None,
    *events: NewEvent,
    expected: int | None = 0,
    command_id: str | None = None,
    workspace_id: str = WS,
) -> Any:
    """One append of `events` (one plain event when none), as a coroutine to run together."""
    return store.append(
        stream_id or new_id("s"),
        list(events) or [ev()],
        expected_version=expected,
        command_id=command_id or new_id("c"),
        workspace_id=workspace_id,
    )


@pytest.fixture
def store(store_db: Database) -> PostgresEventStore:
    return PostgresEventStore(store_db, append_lanes=1)


async def together(*appends: Any) -> list[AppendResult | BaseException]:
    return list(await asyncio.gather(*appends, return_exceptions=True))


async def batch_sizes(db: Database) -> list[int]:
    """How many events each transaction wrote, oldest first."""
    async with db.acquire() as conn:
        rows = await conn.fetch("SELECT count(*) FROM events GROUP BY tx ORDER BY tx")
    return [r[0] for r in rows]


async def test_appends_to_many_streams_share_one_transaction(
    store: PostgresEventStore, store_db: Database
) -> None:
    streams = [new_id("s") for _ in range(20)]
    results = await together(*(append(store, s, ev(k=k), ev(k=k)) for k, s in enumerate(streams)))
    assert all(isinstance(r, AppendResult) for r in results)
    assert [(r.stream_id, r.first_version, r.last_version) for r in results] == [  # type: ignore[union-attr]
        (s, 1, 2) for s in streams
    ]
    assert await batch_sizes(store_db) == [40]
    for k, s in enumerate(streams):
        recorded = await store.read_stream(s)
        assert [(e.version, e.data) for e in recorded] == [(1, {"k": k}), (2, {"k": k})]
    cursors = [r.cursor for r in results if isinstance(r, AppendResult)]
    assert len(set(cursors)) == len(cursors)


async def test_a_conflict_fails_only_its_own_append(
    store: PostgresEventStore, store_db: Database
) -> None:
    busy, ok_a, ok_b = new_id("s"), new_id("s"), new_id("s")
    await append(store, busy)
    results = await together(
        append(store), append(store, ok_a), append(store, busy), append(store, ok_b)
    )
    assert isinstance(results[2], ConcurrencyConflict)
    assert isinstance(results[1], AppendResult) and isinstance(results[3], AppendResult)
    assert await batch_sizes(store_db) == [1, 3]
    assert len(await store.read_stream(busy)) == 1
    assert [len(await store.read_stream(s)) for s in (ok_a, ok_b)] == [1, 1]


async def test_two_appends_of_one_stream_in_a_batch_act_in_order(
    store: PostgresEventStore, store_db: Database
) -> None:
    s = new_id("s")
    results = await together(
        append(store),
        append(store, s, ev(n=1), expected=0),
        append(store, s, ev(n=2), expected=1),
        append(store, s, ev(n=3), expected=1),
    )
    assert [getattr(r, "last_version", None) for r in results[1:3]] == [1, 2]
    assert isinstance(results[3], ConcurrencyConflict)
    assert await batch_sizes(store_db) == [3]
    assert [e.data["n"] for e in await store.read_stream(s)] == [1, 2]


async def test_a_command_repeated_inside_a_batch_acts_once(
    store: PostgresEventStore, store_db: Database
) -> None:
    s, command = new_id("s"), new_id("c")
    results = await together(
        append(store), append(store, s, command_id=command), append(store, s, command_id=command)
    )
    first, repeat = results[1], results[2]
    assert isinstance(first, AppendResult) and isinstance(repeat, AppendResult)
    assert (first.duplicate, repeat.duplicate) == (False, True)
    assert repeat.cursor == first.cursor and repeat.last_version == first.last_version
    assert await batch_sizes(store_db) == [2]


async def test_unstorable_data_fails_only_its_own_append(store: PostgresEventStore) -> None:
    good = new_id("s")
    results = await together(
        append(store), append(store, None, ev(text="a\u0000b")), append(store, good)
    )
    assert isinstance(results[1], InvalidAppend)
    assert "\u0000" not in str(results[1])
    assert isinstance(results[2], AppendResult)
    assert len(await store.read_stream(good)) == 1


async def test_a_foreign_stream_fails_only_its_own_append(store: PostgresEventStore) -> None:
    theirs = new_id("s")
    await append(store, theirs, workspace_id="ws-other")
    results = await together(append(store), append(store, theirs, expected=None), append(store))
    assert isinstance(results[1], InvalidAppend)
    assert "another workspace" in str(results[1])
    assert isinstance(results[2], AppendResult)


async def test_close_waits_for_appends_in_flight(store_db: Database) -> None:
    store = PostgresEventStore(store_db, append_lanes=1)
    pending = [asyncio.create_task(append(store)) for _ in range(10)]
    await asyncio.sleep(0)
    await store.close()
    assert all(t.done() and not t.cancelled() and t.exception() is None for t in pending)


async def test_a_retry_racing_its_uncommitted_first_attempt_gets_the_first_result(
    store: PostgresEventStore, store_db: Database
) -> None:
    s, command = new_id("s"), new_id("c")
    event = ev()
    async with store_db.acquire() as first_attempt:
        tx = first_attempt.transaction()
        await tx.start()
        first = await first_attempt.fetchrow(
            "SELECT * FROM svc_append($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            WS, command, s, 0, [event.event_id], [event.type], [1], [event.data], [{}],
        )  # fmt: skip
        retry = asyncio.create_task(append(store, s, ev(), command_id=command))
        async with store_db.acquire() as admin:
            await waiting_append(admin)  # on the first attempt's ledger row
        assert not retry.done()
        await tx.commit()
    result = await asyncio.wait_for(retry, timeout=30)
    assert result.duplicate
    assert (result.first_version, result.last_version) == (first["first_version"], 1)
    assert [e.event_id for e in await store.read_stream(s)] == [event.event_id]


async def test_a_duplicate_in_a_batch_gets_its_first_result_and_the_rest_is_written(
    store: PostgresEventStore,
) -> None:
    s, command, fresh = new_id("s"), new_id("c"), new_id("s")
    first = await append(store, s, ev(n=1), ev(n=2), command_id=command)
    results = await together(
        append(store), append(store, s, ev(n=3), command_id=command), append(store, fresh)
    )
    repeat, written = results[1], results[2]
    assert isinstance(repeat, AppendResult) and isinstance(written, AppendResult)
    assert repeat == AppendResult(s, 1, 2, first.cursor, duplicate=True)
    assert (written.duplicate, written.last_version) == (False, 1)
    assert [e.data["n"] for e in await store.read_stream(s)] == [1, 2]


async def test_a_batch_losing_a_race_for_one_stream_fails_only_that_append(
    store: PostgresEventStore, store_db: Database
) -> None:
    """Both the batch and another transaction read head 0 of `contested`; the other commits
    version 1 first. The batch's set-based insert hits the fence, is rolled back and the batch
    runs again one by one: only the append to `contested` fails."""
    contested, other = new_id("s"), new_id("s")
    rival = ev(n=0)
    async with store_db.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await conn.fetchrow(
            "SELECT * FROM svc_append($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            WS, new_id("c"), contested, 0, [rival.event_id], [rival.type], [1], [rival.data],
            [{}],
        )  # fmt: skip
        batch = asyncio.create_task(
            together(append(store), append(store, contested, ev(n=1)), append(store, other))
        )
        async with store_db.acquire() as admin:
            await waiting_append(admin)  # on the rival's uncommitted version 1
        assert not batch.done()
        await tx.commit()
    results = await asyncio.wait_for(batch, timeout=30)
    assert isinstance(results[1], ConcurrencyConflict)
    assert isinstance(results[2], AppendResult) and results[2].last_version == 1
    assert [e.data for e in await store.read_stream(contested)] == [{"n": 0}]
    assert len(await store.read_stream(other)) == 1


async def test_the_set_function_refuses_arrays_that_do_not_line_up(store_db: Database) -> None:
    event = ev()
    async with store_db.acquire() as conn:
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await conn.fetch(
                "SELECT * FROM svc_append_set($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                [WS], [new_id("c")], [new_id("s")], [0], [2], [event.event_id], [event.type],
                [1], [event.data], [{}],
            )  # fmt: skip
        assert await conn.fetchval("SELECT count(*) FROM events") == 0


async def test_a_batched_retry_racing_its_uncommitted_first_attempt_gets_the_first_result(
    store: PostgresEventStore, store_db: Database
) -> None:
    """The retry's set-based claim waits on the first attempt's ledger row and, once that
    commits, is skipped: the batch is rolled back and runs one by one, finding the command."""
    s, command, other = new_id("s"), new_id("c"), new_id("s")
    event = ev()
    async with store_db.acquire() as first_attempt:
        tx = first_attempt.transaction()
        await tx.start()
        await first_attempt.fetchrow(
            "SELECT * FROM svc_append($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            WS, command, s, 0, [event.event_id], [event.type], [1], [event.data], [{}],
        )  # fmt: skip
        batch = asyncio.create_task(
            together(
                append(store), append(store, s, ev(), command_id=command), append(store, other)
            )
        )
        async with store_db.acquire() as admin:
            await waiting_append(admin)  # on the first attempt's ledger row
        assert not batch.done()
        await tx.commit()
    results = await asyncio.wait_for(batch, timeout=30)
    retry, written = results[1], results[2]
    assert isinstance(retry, AppendResult) and retry.duplicate and retry.last_version == 1
    assert isinstance(written, AppendResult) and not written.duplicate
    assert [e.event_id for e in await store.read_stream(s)] == [event.event_id]
    assert len(await store.read_stream(other)) == 1


async def test_batches_crossing_on_the_same_streams_never_deadlock(store_db: Database) -> None:
    """Two stores (two processes, or lanes of one) each batching appends to the same streams
    in a different order: every stream gets exactly one append at version 1 and the other
    is a ConcurrencyConflict, never a deadlock surfacing as StoreUnavailable."""
    stores = [PostgresEventStore(store_db, append_lanes=2) for _ in range(2)]
    for _ in range(4):
        streams = [new_id("s") for _ in range(120)]
        orders = [streams, streams[::-1]]
        outcomes = await together(
            *(
                append(store, stream)
                for store, order in zip(stores, orders, strict=True)
                for stream in order
            )
        )
        kinds = {type(o).__name__ for o in outcomes}
        assert kinds <= {"AppendResult", "ConcurrencyConflict"}, kinds
        wins = [o for o in outcomes if isinstance(o, AppendResult)]
        assert sorted(w.stream_id for w in wins) == sorted(streams)


async def test_appends_without_an_expected_version_all_land(store_db: Database) -> None:
    """ANY_VERSION means "do not check": concurrent appends to a few streams, batched in
    several lanes, each land at the next free version, however they race."""
    store = PostgresEventStore(store_db, append_lanes=4)
    streams = [new_id("s") for _ in range(5)]
    outcomes = await together(*(append(store, streams[i % 5], expected=None) for i in range(200)))
    assert all(isinstance(o, AppendResult) for o in outcomes), {type(o).__name__ for o in outcomes}
    for stream in streams:
        recorded = await store.read_stream(stream)
        assert [e.version for e in recorded] == list(range(1, 41))


# Lock waits (migration 0008). The store's statement timeout is 2 s here: each wait on a row
# another transaction holds uncommitted is bounded to 0.5 s, all of a statement's to 1 s.
_SHORT_STATEMENT_MS = 2000


@pytest.fixture
async def short_db(database_url: str) -> AsyncIterator[Database]:
    db = await Database.connect(database_url, max_size=4, statement_timeout_ms=_SHORT_STATEMENT_MS)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        yield db
    finally:
        await db.close()


async def hold_uncommitted(conn: Any, stream_id: str, command_id: str) -> None:
    """Another process's append of `command_id`, version 1 of `stream_id`, left open: its
    ledger row and its version are locked until `conn`'s transaction ends."""
    event = ev()
    await conn.fetchrow(
        "SELECT * FROM svc_append($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        WS, command_id, stream_id, 0, [event.event_id], [event.type], [1], [event.data], [{}],
    )  # fmt: skip


def blocked(outcome: AppendResult | BaseException) -> bool:
    text = str(outcome)
    return isinstance(outcome, StoreUnavailable) and "waited too long on another" in text


@pytest.mark.parametrize("retry_of_the_same_command", [True, False])
async def test_an_append_waiting_on_an_open_transaction_fails_alone_in_its_batch(
    short_db: Database, retry_of_the_same_command: bool
) -> None:
    """The append waits on the open transaction's ledger row (a retry of its command) or on
    its version 1 (a rival writer of the stream). Before migration 0008 that wait held the
    whole batch's statement until the statement timeout, failing every append in it."""
    store = PostgresEventStore(short_db, append_lanes=1)
    contested, command = new_id("s"), new_id("c")
    other_command = command if retry_of_the_same_command else new_id("c")
    async with short_db.acquire() as conn, conn.transaction():
        await hold_uncommitted(conn, contested, command)
        results = await together(
            *(append(store) for _ in range(10)),
            append(store, contested, command_id=other_command),
            *(append(store) for _ in range(10)),
        )
        assert blocked(results[10]), results[10]
        others = results[:10] + results[11:]
        assert all(isinstance(r, AppendResult) and not r.duplicate for r in others), others
        assert await batch_sizes(short_db) == [20]  # they really shared a statement
    if retry_of_the_same_command:  # the open transaction committed that command
        assert (await append(store, contested, command_id=command)).duplicate
    else:  # and version 1 of the stream
        with pytest.raises(ConcurrencyConflict):
            await append(store, contested, command_id=other_command)


async def test_several_appends_waiting_in_one_batch_fail_alone_within_the_statement_timeout(
    short_db: Database,
) -> None:
    """Each blocked append waits in turn on the one-by-one path: all of them share half the
    statement timeout, so the statement itself never times out."""
    store = PostgresEventStore(short_db, append_lanes=1)
    held = [(new_id("s"), new_id("c")) for _ in range(5)]
    async with short_db.acquire() as conn, conn.transaction():
        for stream, command in held:
            await hold_uncommitted(conn, stream, command)
        results = await together(
            *(append(store) for _ in range(5)),
            *(append(store, stream, command_id=command) for stream, command in held),
            *(append(store) for _ in range(5)),
        )
    assert all(blocked(r) for r in results[5:10]), results[5:10]
    others = results[:5] + results[10:]
    assert all(isinstance(r, AppendResult) for r in others), others


async def test_an_append_sent_alone_fails_on_a_long_lock_wait_not_the_statement_timeout(
    short_db: Database,
) -> None:
    store = PostgresEventStore(short_db, append_lanes=1)
    contested, command = new_id("s"), new_id("c")
    async with short_db.acquire() as conn, conn.transaction():
        await hold_uncommitted(conn, contested, command)
        with pytest.raises(StoreUnavailable, match="was not made"):
            await append(store, contested, command_id=command)
    assert (await append(store, contested, command_id=command)).duplicate


async def test_the_append_functions_leave_the_callers_lock_timeout_as_it_was(
    short_db: Database,
) -> None:
    async with short_db.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL lock_timeout = '7s'")
        await hold_uncommitted(conn, new_id("s"), new_id("c"))
        assert await conn.fetchval("SHOW lock_timeout") == "7s"


_WAITING_APPEND = r"""
SELECT pid FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query ~ 'svc_append(_set)?\(' AND pid <> pg_backend_pid()
"""


async def waiting_append(admin: Any) -> int:
    """The backend of the append (alone or in a set) that waits on a lock; polled, for 30 s
    at most."""
    for _ in range(3000):
        pid: int | None = await admin.fetchval(_WAITING_APPEND)
        if pid is not None:
            return pid
        await asyncio.sleep(0.01)
    raise AssertionError("no append waited on the open transaction")


async def test_a_batch_sent_one_by_one_reports_each_append_when_its_connection_is_lost(
    store_db: Database,
) -> None:
    """Unstorable data fails the set statement before anything is written, so the batch is
    sent again one append at a time, in stream order. The connection is lost on the second
    (terminated while it waits on an open transaction's row): the first committed and says
    so (and wakes the commit listeners), the second fails, the last two were never sent."""
    commits: list[None] = []
    store = PostgresEventStore(store_db, append_lanes=1, on_commit=lambda: commits.append(None))
    tag = new_id("")
    first, waiting, third, unstorable = (f"{tag}-{n}" for n in range(1, 5))
    async with store_db.acquire() as holder, store_db.acquire() as admin:
        async with holder.transaction():
            await hold_uncommitted(holder, waiting, new_id("c"))
            batch = asyncio.create_task(
                together(
                    append(store, first),
                    append(store, waiting),
                    append(store, third),
                    append(store, unstorable, ev(text="a\u0000b")),
                )
            )
            await admin.execute("SELECT pg_terminate_backend($1)", await waiting_append(admin))
            results = await batch
    assert isinstance(results[0], AppendResult) and not results[0].duplicate
    assert len(await store.read_stream(first)) == 1
    assert commits
    assert isinstance(results[1], StoreUnavailable) and not blocked(results[1])
    for unsent in results[2:]:
        assert isinstance(unsent, StoreUnavailable) and "was never sent" in str(unsent), unsent
        # What the client is told names no cause: the driver's words are detail, for the log.
        assert unsent.message.endswith("failed; retry shortly") and unsent.detail
        assert results[1].detail and results[1].detail not in unsent.message
    assert await store.read_stream(third) == []
