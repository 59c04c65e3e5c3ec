"""`Pipeline.fold`: a row written by several events of a batch is written once, in order."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from projection_events import append, assistant_message, started, turn_started, user_message

from eventstore import Database, PostgresEventStore
from eventstore.cursor import ORIGIN
from eventstore.reads import read_log
from projections.conversations import ConversationsProjector
from projections.pipeline import Pipeline, fold

_INSERT = "INSERT INTO folded (k, n) VALUES ($1, $2)"
_TIMES_TEN = "UPDATE folded SET n = n * 10 WHERE k = $1"


def _add(earlier: tuple[Any, ...], later: tuple[Any, ...]) -> tuple[Any, ...]:
    return (earlier[0], earlier[1] + later[1])


async def _rows(conn: Any) -> dict[str, int]:
    return {row["k"]: row["n"] for row in await conn.fetch("SELECT k, n FROM folded")}


@pytest.fixture
async def conn(db: Database) -> Any:
    async with db.acquire() as connection, connection.transaction():
        await connection.execute("CREATE TEMP TABLE folded (k text PRIMARY KEY, n int)")
        yield connection


async def test_folds_on_one_key_merge_into_one_execution(conn: Any) -> None:
    # A second insert of one key would break the primary key: only merged writes get in.
    pipeline = Pipeline(conn)
    for key, n in [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("b", 5)]:
        await pipeline.fold(_INSERT, key, (key, n), _add)
    assert await _rows(conn) == {}  # nothing sent before the run ends
    await pipeline.flush()
    assert await _rows(conn) == {"a": 8, "b": 7}


async def test_a_different_statement_ends_the_fold_run_first(conn: Any) -> None:
    pipeline = Pipeline(conn)
    await pipeline.fold(_INSERT, "a", ("a", 1), _add)
    await pipeline.fold(_INSERT, "a", ("a", 2), _add)
    await pipeline.execute(_TIMES_TEN, "a")  # must see the folded insert
    await pipeline.fold(_INSERT, "b", ("b", 1), _add)
    assert await pipeline.fetchval("SELECT count(*) FROM folded") == 2  # a read flushes too
    await pipeline.execute(_TIMES_TEN, "b")
    await pipeline.flush()
    assert await _rows(conn) == {"a": 30, "b": 10}


async def test_folds_do_not_merge_across_runs(conn: Any) -> None:
    pipeline = Pipeline(conn)
    await pipeline.fold(_INSERT, "a", ("a", 1), _add)
    await pipeline.execute(_TIMES_TEN, "a")
    await pipeline.fold(_INSERT, "a", ("a", 2), _add)  # a new run: a second insert of "a"
    with pytest.raises(asyncpg.UniqueViolationError):
        await pipeline.flush()


async def test_on_a_plain_connection_a_fold_runs_at_once(conn: Any) -> None:
    await fold(conn, _INSERT, "a", ("a", 1), _add)
    assert await _rows(conn) == {"a": 1}


async def test_folds_and_executes_of_one_statement_alternate_without_loss(conn: Any) -> None:
    pipeline = Pipeline(conn)
    await pipeline.fold(_INSERT, "a", ("a", 1), _add)
    await pipeline.execute(_INSERT, "b", 2)
    await pipeline.fold(_INSERT, "c", ("c", 3), _add)
    await pipeline.execute(_INSERT, "d", 4)
    await pipeline.execute(_INSERT, "e", 5)
    await pipeline.fold(_INSERT, "f", ("f", 6), _add)  # and a fold after them keeps them
    await pipeline.flush()
    assert await _rows(conn) == {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}


_WRITES = """
SELECT pg_stat_get_xact_tuples_inserted('conversations'::regclass),
       pg_stat_get_xact_tuples_updated('conversations'::regclass)
"""


async def test_a_conversation_started_and_answered_in_one_batch_is_one_insert(
    store: PostgresEventStore, db: Database
) -> None:
    """Counted by PostgreSQL in the applying transaction: one row written once, where the
    events one by one insert it and update it twice."""
    await append(
        store,
        "ws-fold",
        "conversation:once",
        started("ws-fold", "once", 0),
        user_message("once", "m1", "hi", 1, "t1"),
        turn_started("once", "t1", 1),
    )
    await append(
        store,
        "ws-fold",
        "conversation:once",
        assistant_message("once", "t1", "m2", "hello", 2, (1, 1)),
    )
    projector = ConversationsProjector()
    async with db.acquire() as conn:
        events = await read_log(conn, ORIGIN, 100)
        for target_of in (Pipeline, lambda c: c):
            async with conn.transaction():
                # The counters hold the session's writes not yet reported: read a difference.
                before = await conn.fetchrow(_WRITES)
                target = target_of(conn)
                for event in events:
                    await projector.apply(target, event)
                if isinstance(target, Pipeline):
                    await target.flush()
                after = await conn.fetchrow(_WRITES)
                writes = (after[0] - before[0], after[1] - before[1])
                count = await conn.fetchval("SELECT message_count FROM conversations")
                await conn.execute("DELETE FROM conversations")
            expected = (1, 0) if target_of is Pipeline else (1, 2)
            assert (writes, count) == (expected, 2)
