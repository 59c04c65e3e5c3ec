"""The turn list and analytics read a page or a window of a workspace's turns, never all of
them (projections/queries.py, migration 0180), in the order of each turn's time: its start,
or its finish for a turn that failed before it started."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from eventstore import Database
from eventstore.db import _StoreConnection
from projections import queries

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def add_turns(db: Database, ws: str, rows: list[tuple[str, str, Any, Any]]) -> None:
    """(turn_id, conversation_id, started_at, finished_at) rows, as the projector leaves
    them, written directly: a test of the reads, not of the projection."""
    async with db.acquire() as conn:
        await conn.executemany(
            "INSERT INTO turns (workspace_id, turn_id, conversation_id, status, started_at,"
            " finished_at) VALUES ($1, $2, $3, 'completed', $4, $5)",
            [(ws, *row) for row in rows],
        )


async def test_turns_that_never_started_sort_by_their_finish_among_the_rest(
    db: Database,
) -> None:
    ws = f"ws-{uuid.uuid4().hex[:8]}"
    at = [T0 + timedelta(minutes=m) for m in range(6)]
    await add_turns(
        db,
        ws,
        [
            ("s1", "c1", at[1], at[2]),
            ("s3", "c1", at[3], at[5]),
            ("s5", "c2", at[5], None),
            ("u4", "c1", None, at[4]),  # failed before it started
            ("u0", "c2", None, at[0]),
        ],
    )
    newest = await queries.list_turns(db, ws, limit=3)
    assert [t.turn_id for t in newest] == ["s5", "u4", "s3"]
    everything = await queries.list_turns(db, ws, limit=10)
    assert [t.turn_id for t in everything] == ["s5", "u4", "s3", "s1", "u0"]
    of_c1 = await queries.list_turns(db, ws, "c1", limit=10)
    assert [t.turn_id for t in of_c1] == ["u4", "s3", "s1"]
    window = await queries.analytics(db, ws, since=at[0], until=at[4], bucket="hour")
    assert window.totals.turns == 3  # u0, s1, s3; u4 finished at the window's end


@pytest.fixture
def plans(db: Database, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The plan (EXPLAIN ANALYZE) of every statement the reads send that reads `turns`."""
    found: list[Any] = []
    fetch, fetchrow = _StoreConnection.fetch, _StoreConnection.fetchrow

    async def explained(conn: Any, sql: str, *args: Any) -> None:
        if "FROM turns" in sql:
            raw = await fetchrow(conn, f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
            plan = raw[0]
            found.append(orjson.loads(plan) if isinstance(plan, str) else plan)

    async def fetch_explained(conn: Any, sql: str, *args: Any, **kw: Any) -> Any:
        await explained(conn, sql, *args)
        return await fetch(conn, sql, *args, **kw)

    async def fetchrow_explained(conn: Any, sql: str, *args: Any, **kw: Any) -> Any:
        await explained(conn, sql, *args)
        return await fetchrow(conn, sql, *args, **kw)

    monkeypatch.setattr(_StoreConnection, "fetch", fetch_explained)
    monkeypatch.setattr(_StoreConnection, "fetchrow", fetchrow_explained)
    yield found


def rows_read_from_turns(node: dict[str, Any]) -> int:
    """Rows the plan took from `turns`: returned by its scans, and those their filters
    dropped, over every loop."""
    own = 0
    if node.get("Relation Name") == "turns":
        loops = node.get("Actual Loops", 1)
        kept = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        own = kept * loops
    return own + sum(rows_read_from_turns(child) for child in node.get("Plans", []))


async def test_a_page_or_a_window_reads_only_its_own_turns(db: Database, plans: list[Any]) -> None:
    ws = f"ws-{uuid.uuid4().hex[:8]}"
    # 20,000 turns over 200 days, 100 a day; a few that never started.
    rows: list[tuple[str, str, Any, Any]] = []
    for n in range(20_000):
        when = T0 + timedelta(minutes=n * 14.4)
        started = None if n % 500 == 0 else when
        rows.append((f"t{n:05d}", f"c{n % 300}", started, when + timedelta(seconds=3)))
    await add_turns(db, ws, rows)
    async with db.acquire() as conn:
        await conn.execute("ANALYZE turns")

    page = await queries.list_turns(db, ws, limit=50)
    assert [t.turn_id for t in page][:2] == ["t19999", "t19998"]
    one_day = await queries.analytics(
        db, ws, since=T0 + timedelta(days=100), until=T0 + timedelta(days=101), bucket="hour"
    )
    assert one_day.totals.turns == 100
    assert sum(b.figures.turns for b in one_day.series) == 100

    read = [rows_read_from_turns(plan[0]["Plan"]) for plan in plans]
    assert len(read) == 3, plans  # the page, the window's totals, its buckets
    assert read[0] <= 2 * 50, plans[0]
    assert read[1] <= 150 and read[2] <= 150, plans[1:]


async def test_a_turn_s_completion_stays_a_heap_only_update(db: Database) -> None:
    """No index of `turns` names a column a completion changes (finished_at, status,
    usage): a completion then rewrites the row in place, without a new entry in each of the
    table's indexes."""
    ws = f"ws-{uuid.uuid4().hex[:8]}"
    await add_turns(db, ws, [("t1", "c1", T0, None)])
    async with db.acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE turns SET status = 'completed', finished_at = $3, total_tokens = 5,"
            " duration_ms = 20 WHERE workspace_id = $1 AND turn_id = $2",
            ws,
            "t1",
            T0 + timedelta(seconds=2),
        )
        hot = await conn.fetchval("SELECT pg_stat_get_xact_tuples_hot_updated('turns'::regclass)")
    assert hot == 1
