"""Projectors at the same checkpoint share one transaction per batch; one behind catches up on
its own and joins them; a steady stream is batched without delaying read-your-writes."""

from __future__ import annotations

import asyncio

from commit_signal import CommitSignal
from projection_events import append, chat, renamed, workspace_created

from eventstore import Database, PostgresEventStore
from projections import ProjectionRunner, default_projectors, queries

PATIENCE_S = 30.0
WS = "ws-groups"


async def _checkpoint_writers(db: Database) -> dict[str, tuple[int, int, int]]:
    """name -> (transaction that last wrote the row, tx, position)."""
    async with db.acquire() as conn:
        rows = await conn.fetch(
            "SELECT name, xmin::text::bigint, tx, position FROM projection_checkpoints"
        )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


async def test_projectors_at_one_checkpoint_commit_each_batch_together(
    store: PostgresEventStore, db: Database
) -> None:
    runner = ProjectionRunner(db, default_projectors(), batch_size=1000)
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Groups"))
    await chat(store, WS, "c1", 2)
    await runner.catch_up()
    first = await _checkpoint_writers(db)
    assert set(first) == set(runner.names)
    # One transaction moved every checkpoint to the same point.
    assert len({writer for writer, _, _ in first.values()}) == 1
    assert len({(tx, position) for _, tx, position in first.values()}) == 1

    await chat(store, WS, "c2", 1)
    await runner.catch_up()
    second = await _checkpoint_writers(db)
    assert len({writer for writer, _, _ in second.values()}) == 1
    assert second["messages"] != first["messages"]


async def test_a_projector_behind_catches_up_alone_then_joins_the_others(
    store: PostgresEventStore, db: Database
) -> None:
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Groups"))
    await chat(store, WS, "c1", 3)
    runner = ProjectionRunner(db, default_projectors(), batch_size=4)
    await runner.catch_up(names=["messages"])
    await chat(store, WS, "c2", 3)
    # "messages" is ahead of the six others, which start from the origin: two groups. The
    # laggards' batches stop at the leader's checkpoint, so they merge instead of chasing it.
    await runner.catch_up()
    caught_up = await _checkpoint_writers(db)
    assert len({(tx, position) for _, tx, position in caught_up.values()}) == 1
    assert len(await queries.get_messages(db, WS, "c1")) == 6
    assert len(await queries.get_messages(db, WS, "c2")) == 6

    await append(store, WS, "conversation:c1", renamed("c1", "one group again"))
    await runner.catch_up()
    joined = await _checkpoint_writers(db)
    assert len({writer for writer, _, _ in joined.values()}) == 1
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None
    assert (conversation.title, conversation.message_count) == ("one group again", 6)


async def test_a_reader_waiting_cuts_the_linger_short(
    store: PostgresEventStore, db: Database
) -> None:
    """With an hour of linger after each batch and no fallback poll, only `wait_for` can get
    the next batch going: if it did not, these waits would time out."""
    await chat(store, WS, "c1", 1)
    await chat(store, WS, "c2", 1)
    notifier = CommitSignal()
    runner = ProjectionRunner(
        db, default_projectors(), notifier=notifier, poll_interval_s=3600, linger_s=3600
    )
    await runner.start()
    try:
        for i in range(4):
            result = await append(store, WS, "conversation:c1", renamed("c1", f"title {i}"))
            notifier.committed()
            assert await runner.wait_for(result.cursor, PATIENCE_S)
            assert await _title(db, "c1") == f"title {i}"
        # A stream of commits nobody waits for is still applied, a batch per linger at most:
        # here the next reader collects it.
        for i in range(3):
            last = await append(store, WS, "conversation:c2", renamed("c2", f"stream {i}"))
            notifier.committed()
            await asyncio.sleep(0)
        # The last append's own cursor: the gap-free head may stop short of it while a batch
        # the first appends started is still open.
        assert await runner.wait_for(last.cursor, PATIENCE_S)
        assert await _title(db, "c2") == "stream 2"
    finally:
        await runner.stop()


async def _title(db: Database, cid: str) -> str | None:
    conversation = await queries.get_conversation(db, WS, cid)
    assert conversation is not None
    return conversation.title


async def test_a_group_behind_lands_on_the_leader_which_waits_for_it(
    store: PostgresEventStore, db: Database
) -> None:
    """Step by step, events arriving between the steps (review finding: the test above passes
    with no cap at all, every projector ending at the head). The group behind stops exactly
    on the leader's point, while the leader moves on in the same step (a live batch is never
    delayed by a catching-up one); then the leader is held back for the one step in which
    the group behind lands on it again, and from then on they are one group."""
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Groups"))
    await chat(store, WS, "c1", 3)
    runner = ProjectionRunner(db, default_projectors(), batch_size=1000)
    await runner.catch_up(names=["messages"])
    leader = (await _checkpoint_writers(db))["messages"][1:]

    async def step_with_traffic(n: int) -> dict[str, tuple[int, int]]:
        await chat(store, WS, f"t{n}", 1)  # past every checkpoint: a batch takes it all
        await runner._step(runner._select(None), wait=True)
        return {name: row[1:] for name, row in (await _checkpoint_writers(db)).items()}

    first = await step_with_traffic(1)
    moved_on = first.pop("messages")
    assert set(first.values()) == {leader} and moved_on > leader
    second = await step_with_traffic(2)
    assert set(second.values()) == {moved_on}  # the leader held; the others on its point
    third = await _checkpoint_writers(db)
    await step_with_traffic(3)
    joined = await _checkpoint_writers(db)
    assert len({writer for writer, _, _ in joined.values()}) == 1  # one commit for all
    assert all(joined[name] != third[name] for name in joined)
