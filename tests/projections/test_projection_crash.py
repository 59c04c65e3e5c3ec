"""Exactly one effect per event, whatever crashes: the checkpoint moves in the batch's
transaction with a compare-and-set (projections/runner.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from projection_events import chat

from eventstore import Database, PostgresEventStore
from projections import (
    ConversationsProjector,
    MessagesProjector,
    ProjectionRunner,
    default_projectors,
)

CHILD = Path(__file__).with_name("crash_child.py")
ROOT = Path(__file__).resolve().parents[2]
PATIENCE_S = 60.0
WS = "ws-crash"


async def _message_counts(db: Database) -> dict[str, tuple[int, int]]:
    """conversation id -> (message_count of the conversations model, rows in messages)."""
    async with db.acquire() as conn:
        rows = await conn.fetch(
            """
            SELECT c.id, c.message_count,
                   (SELECT count(*) FROM messages m
                    WHERE m.workspace_id = c.workspace_id AND m.conversation_id = c.id)
            FROM conversations c ORDER BY c.id
            """
        )
    return {r[0]: (r[1], r[2]) for r in rows}


async def _checkpoint(db: Database, name: str) -> tuple[int, int] | None:
    async with db.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT tx, position FROM projection_checkpoints WHERE name = $1", name
        )
    return None if row is None else (row[0], row[1])


async def test_sigkill_mid_batch_then_restart_applies_each_event_once(
    store: PostgresEventStore, db: Database, database_url: str
) -> None:
    # 3 conversations x (1 start + 4 turns x (2 messages + 1 turn start)) = 39 events.
    for cid in ("c1", "c2", "c3"):
        await chat(store, WS, cid, 4)
    # Seven full batches commit (each projector in its own transaction); the eighth, partial
    # (4 events), is one transaction for both projectors: conversations applies all of it,
    # then messages hangs on its second event.
    batch, hang_at = 5, 37
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        database_url,
        str(batch),
        str(hang_at),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), PATIENCE_S)
        assert line.strip() == b"HANGING"
        # While the child hangs, its batch holds the checkpoint rows: it has moved them (not yet
        # committed) and applied five events. Nothing of that batch is visible.
        assert await _checkpoint(db, "conversations") is not None
        assert await _checkpoint(db, "messages") == await _checkpoint(db, "conversations")
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    assert child.returncode == -signal.SIGKILL

    async with db.acquire() as conn:
        events = await conn.fetch("SELECT tx, position, type FROM events ORDER BY tx, position")
    # Exactly the committed batches: both checkpoints are the 35th event, and both models hold
    # the effects of events 1..35 and nothing of the killed batch, not even the conversations
    # projector's part of it, which had finished.
    committed = events[: 7 * batch]
    assert await _checkpoint(db, "conversations") == tuple(committed[-1][:2])
    assert await _checkpoint(db, "messages") == tuple(committed[-1][:2])
    counts = await _message_counts(db)
    started = sum(1 for e in committed if e[2] == "conversation.started")
    messages = sum(1 for e in committed if e[2].endswith("message_received"))
    messages += sum(1 for e in committed if e[2].endswith("message_completed"))
    assert len(counts) == started and started >= 1
    assert sum(count for count, _ in counts.values()) == messages
    assert sum(rows for _, rows in counts.values()) == messages

    # Restart: a fresh runner with every projector finishes the log.
    await ProjectionRunner(db, default_projectors(), batch_size=batch).catch_up()
    counts = await _message_counts(db)
    assert counts == {"c1": (8, 8), "c2": (8, 8), "c3": (8, 8)}
    async with db.acquire() as conn:
        seqs = await conn.fetch(
            "SELECT conversation_id, array_agg(seq ORDER BY seq) FROM messages GROUP BY 1"
        )
    assert all(list(r[1]) == list(range(1, 9)) for r in seqs)
    assert await _checkpoint(db, "conversations") == tuple(events[-1][:2])


async def test_concurrent_runners_apply_each_event_once(
    store: PostgresEventStore, db: Database, database_url: str
) -> None:
    """Several runners (as in several processes, each with its own pool) race over the same
    checkpoints: the compare-and-set lets exactly one of them apply each batch."""
    for i in range(6):
        await chat(store, WS, f"c{i}", 5)
    pools = [await Database.connect(database_url, max_size=3) for _ in range(3)]
    try:
        runners = [
            ProjectionRunner(pool, [ConversationsProjector(), MessagesProjector()], batch_size=3)
            for pool in pools
        ]
        await asyncio.gather(*(runner.catch_up() for runner in runners))
    finally:
        for pool in pools:
            await pool.close()
    counts = await _message_counts(db)
    assert counts == {f"c{i}": (10, 10) for i in range(6)}
