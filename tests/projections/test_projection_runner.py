"""The runner: rebuild, status and lag, poison events, read-your-writes and wake-ups."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from commit_signal import CommitSignal
from projection_events import (
    append,
    chat,
    key_hash,
    key_issued,
    key_revoked,
    moved,
    renamed,
    started,
    tagged,
    turn_failed,
    user_message,
    workspace_created,
)
from prometheus_client import REGISTRY

from eventstore import Database, NewEvent, PostgresEventStore
from eventstore.cursor import ORIGIN
from eventstore.errors import StoreUnavailable
from eventstore.reads import read_log_cut
from eventstore.tasks import cancel_and_wait
from projections import (
    ConversationsProjector,
    ProjectionFailed,
    ProjectionRunner,
    default_projectors,
    queries,
)
from projections import rebuild as rebuild_module
from projections import runner as runner_module
from projections.errors import failure_reason
from projections.pipeline import Pipeline
from schemas.events import EventFromNewerVersion

PATIENCE_S = 30.0
WS = "ws-run"
READ_MODELS = {
    "workspaces": "id",
    "api_keys": "workspace_id, key_id",
    "conversations": "workspace_id, id",
    "messages": "workspace_id, conversation_id, seq",
    "turns": "workspace_id, turn_id",
}


async def _dump(db: Database) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    async with db.acquire() as conn:
        for table, order in READ_MODELS.items():
            out[table] = [
                tuple(r) for r in await conn.fetch(f"SELECT * FROM {table} ORDER BY {order}")
            ]
    return out


async def _history(store: PostgresEventStore, start: int) -> str:
    """Three conversations and a key's life; the cursor of the last event."""
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Run"))
    await append(store, WS, f"workspace:{WS}", key_issued(WS, f"k{start}", f"svc_key_{start}"))
    for i in range(start, start + 3):
        cid = f"c{i}"
        await chat(store, WS, cid, 3, first_minute=i * 10)
        await append(store, WS, f"conversation:{cid}", renamed(cid, f"renamed {i}", i * 10 + 5))
        await append(store, WS, f"conversation:{cid}", tagged(cid, ("t", f"n{i}"), i * 10 + 6))
        await append(store, WS, f"conversation:{cid}", moved(cid, "f", i * 10 + 7))
    return (await append(store, WS, f"workspace:{WS}", key_revoked(WS, f"k{start}"))).cursor


async def test_rebuild_equals_incremental(store: PostgresEventStore, db: Database) -> None:
    runner = ProjectionRunner(db, default_projectors(), batch_size=7)
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Run"))
    for round_ in range(3):  # incremental: catch up between appends
        await chat(store, WS, f"r{round_}", 2, first_minute=round_)
        await append(store, WS, f"conversation:r{round_}", turn_failed(f"r{round_}", "tf"))
        await runner.catch_up()
        await append(store, WS, f"workspace:{WS}", key_issued(WS, f"k{round_}", f"svc_k{round_}"))
        await append(store, WS, f"conversation:r{round_}", renamed(f"r{round_}", "x"))
        await runner.catch_up()
    incremental = await _dump(db)
    assert all(incremental.values())

    for projector in default_projectors():
        # A rebuild replays the events of the types its projector reads, and counts those.
        async with db.acquire() as conn:
            log_size = await conn.fetchval(
                "SELECT count(*) FROM events WHERE type = ANY($1)", sorted(projector.event_types)
            )
        calls: list[tuple[int, int, str]] = []

        def progress(
            done: int, total: int, phase: str, calls: list[tuple[int, int, str]] = calls
        ) -> None:
            calls.append((done, total, phase))

        replayed = await runner.rebuild(projector.name, progress)
        assert replayed == log_size
        # First the pass over the log for types this version does not know.
        assert calls[:2] == [(0, 0, "checking"), (0, log_size, "replaying")]
        # The switch is announced before it runs (it is as long as the tables are large).
        assert calls[-2] == (log_size, log_size, "switching")
        assert calls[-1] == (log_size, log_size, "done")
        assert [done for done, _, _ in calls] == sorted(done for done, _, _ in calls)
    assert await _dump(db) == incremental
    # A second runner (say `svc projections rebuild` in another process) rebuilds the same.
    other = ProjectionRunner(db, default_projectors(), batch_size=500)
    await other.rebuild("messages")
    assert await _dump(db) == incremental


async def test_status_reports_lag_then_catches_up(store: PostgresEventStore, db: Database) -> None:
    runner = ProjectionRunner(db, default_projectors())
    before = await runner.status()
    lags = [(s.cursor, s.lag_events, s.lag_seconds) for s in before]
    assert lags == [("", 0, 0.0)] * len(default_projectors())

    await _history(store, 0)
    async with db.acquire() as conn:
        log_size = await conn.fetchval("SELECT count(*) FROM events")
    lagging = {s.name: s for s in await runner.status()}
    for s in lagging.values():
        assert s.cursor == "" and s.lag_events == log_size
        assert s.lag_seconds > 0  # the oldest event was recorded before this statement ran
        assert s.failure is None and not s.running
    assert (
        REGISTRY.get_sample_value("svc_projection_lag_events", {"projection": "turns"}) == log_size
    )

    await runner.catch_up(names=["conversations"])
    partial = {s.name: s for s in await runner.status()}
    assert (partial["conversations"].lag_events, partial["conversations"].lag_seconds) == (0, 0.0)
    assert partial["turns"].lag_events == log_size

    head = await store.head()
    await runner.catch_up()
    for s in await runner.status():
        assert (s.cursor, s.lag_events, s.lag_seconds) == (head, 0, 0.0)
    assert REGISTRY.get_sample_value("svc_projection_lag_events", {"projection": "turns"}) == 0
    assert REGISTRY.get_sample_value("svc_projection_lag_seconds", {"projection": "turns"}) == 0

    await chat(store, WS, "later", 1)
    status = {s.name: s for s in await runner.status()}
    assert status["messages"].lag_events == 4 and status["messages"].cursor == head


async def test_the_lag_is_counted_up_to_a_bound(
    store: PostgresEventStore, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A projector at the start of a large log would count the whole log every few seconds
    (the metrics' sampling): the lag is counted up to LAG_BOUND and said to be at least that
    beyond it; its age is still the first pending event's."""
    monkeypatch.setattr(runner_module, "LAG_BOUND", 5)
    await _history(store, 0)  # well over 5 events
    runner = ProjectionRunner(db, default_projectors())
    await runner.catch_up(names=["workspaces"])
    status = {s.name: s for s in await runner.status()}
    assert (status["turns"].lag_events, status["turns"].lag_at_least) == (5, True)
    assert status["turns"].lag_seconds > 0
    assert REGISTRY.get_sample_value("svc_projection_lag_events", {"projection": "turns"}) == 5
    assert (status["workspaces"].lag_events, status["workspaces"].lag_at_least) == (0, False)

    # Exactly at the bound is exact; one more is "at least".
    await chat(store, WS, "more", 1)  # four events
    await append(store, WS, "conversation:more", renamed("more", "five"))
    status = {s.name: s for s in await runner.status()}
    assert (status["workspaces"].lag_events, status["workspaces"].lag_at_least) == (5, False)
    await append(store, WS, "conversation:more", renamed("more", "six"))
    status = {s.name: s for s in await runner.status()}
    assert (status["workspaces"].lag_events, status["workspaces"].lag_at_least) == (5, True)


async def test_poison_event_stops_the_projector_where_it_is(
    store: PostgresEventStore, db: Database
) -> None:
    await chat(store, WS, "c1", 1)
    good = await append(store, WS, "conversation:c1", renamed("c1", "before"))
    # A stored event its schema rejects (no title): the conversations projector cannot apply it.
    bad = await append(
        store,
        WS,
        "conversation:c1",
        NewEvent(type="conversation.renamed", data={"conversation_id": "c1", "at": "x"}),
    )
    after = await append(store, WS, "conversation:c1", user_message("c1", "m9", "after"))
    runner = ProjectionRunner(db, default_projectors(), batch_size=100)

    with pytest.raises(ProjectionFailed, match="conversations"):
        await runner.catch_up()
    status = {s.name: s for s in await runner.status()}
    failure = status["conversations"].failure
    assert failure is not None
    assert (failure.cursor, failure.event_type, failure.stream_id) == (
        bad.cursor,
        "conversation.renamed",
        "conversation:c1",
    )
    assert "title" in failure.error
    assert "\n" not in failure.error  # a validation error's many lines, made one
    # A write before the stop is applied: a wait for it (the CLI's, runner not started) is
    # over, though the projector stopped after it.
    await runner.catch_up(good.cursor)
    assert await runner.wait_for(good.cursor, PATIENCE_S)
    # Everything before the poison event is applied and checkpointed; nothing after it.
    assert status["conversations"].cursor == good.cursor
    assert status["conversations"].lag_events == 2
    assert REGISTRY.get_sample_value("svc_projection_stalled", {"projection": "conversations"}) == 1
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None
    assert (conversation.title, conversation.message_count) == ("before", 2)
    # The other projectors do not care about that event and went on.
    await runner.catch_up(names=["messages", "turns", "workspaces", "api_keys"])
    assert len(await queries.get_messages(db, WS, "c1")) == 3
    assert not await runner.wait_for(after.cursor, PATIENCE_S)

    # Retrying an unchanged projector stops on the same event again: never a silent skip.
    runner.retry("conversations")
    with pytest.raises(ProjectionFailed):
        await runner.catch_up()
    status = {s.name: s for s in await runner.status()}
    assert status["conversations"].cursor == good.cursor
    failure = status["conversations"].failure
    assert failure is not None and failure.cursor == bad.cursor

    # So does a rebuild, which replays up to it and raises.
    with pytest.raises(ProjectionFailed):
        await runner.rebuild("conversations")
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None and conversation.message_count == 2


class _QuotingNul(ConversationsProjector):
    """A handler whose error quotes the event's text, a NUL included. (A lone surrogate, the
    other thing jsonb cannot hold, is `failure_reason`'s test below: in a log record, which
    the test's captured output carries, it would not cross to pytest-xdist's controller.)"""

    async def apply(self, conn: Any, event: Any) -> None:
        if event.type == "conversation.renamed":
            raise ValueError("cannot take the title 'a\x00bc'")
        await super().apply(conn, event)


async def test_a_stop_whose_reason_quotes_a_nul_is_recorded_for_every_process(
    store: PostgresEventStore, db: Database
) -> None:
    """The stop is stored as jsonb, which holds no NUL: a reason quoting one left the stop
    unrecorded, unseen by other processes and tried again every second here."""
    await chat(store, WS, "c1", 1)
    bad = await append(store, WS, "conversation:c1", renamed("c1", "x"))
    runner = ProjectionRunner(db, [_QuotingNul()], batch_size=100)
    with pytest.raises(ProjectionFailed):
        await runner.catch_up()
    elsewhere = ProjectionRunner(db, [ConversationsProjector()], batch_size=100)
    failure = {s.name: s for s in await elsewhere.status()}["conversations"].failure
    assert failure is not None and failure.cursor == bad.cursor
    assert "a\\0bc" in failure.error


def test_a_stop_reason_is_made_storable() -> None:
    reason = failure_reason(ValueError("title 'a\x00b\udc80c'\non two lines"))
    assert reason == "ValueError: title 'a\\0b?c' on two lines"
    reason.encode("utf-8")  # no lone surrogate left


class _Lenient(ConversationsProjector):
    """A fixed projector: skips renames without a title."""

    async def apply(self, conn: Any, event: Any) -> None:
        if event.type == "conversation.renamed" and "title" not in event.data:
            return
        await super().apply(conn, event)


async def test_background_runner_gives_read_your_writes(
    store: PostgresEventStore, db: Database
) -> None:
    notifier = CommitSignal()
    # A long fallback poll: the runner must react to the commit signal (or to wait_for).
    runner = ProjectionRunner(db, default_projectors(), notifier=notifier, poll_interval_s=3600)
    await runner.start()
    assert notifier.listeners == [runner.wake]
    try:
        for i in range(5):
            await chat(store, WS, f"c{i}", 1)
            result = await append(store, WS, f"conversation:c{i}", renamed(f"c{i}", f"title {i}"))
            notifier.committed()
            assert await runner.wait_for(result.cursor, PATIENCE_S)
            conversation = await queries.get_conversation(db, WS, f"c{i}")
            assert conversation is not None and conversation.title == f"title {i}"
            assert len(await queries.get_messages(db, WS, f"c{i}")) == 2
        statuses = await runner.status()
        assert all(s.running and s.lag_events == 0 for s in statuses)

        # A poison event stops one projector in the background too; a fixed projector
        # (here: a new runner, as after a deploy) goes past it.
        bad = await append(
            store, WS, "conversation:c0", NewEvent(type="conversation.renamed", data={})
        )
        assert not await runner.wait_for(bad.cursor, PATIENCE_S, names=["conversations"])
        assert await runner.wait_for(bad.cursor, PATIENCE_S, names=["messages", "turns"])
    finally:
        await runner.stop()
    assert notifier.listeners == []
    assert not any(s.running for s in await runner.status())
    fixed = ProjectionRunner(db, [_Lenient()])
    assert await fixed.wait_for(bad.cursor, PATIENCE_S)


async def test_a_stop_is_seen_by_every_process_and_a_rebuild_elsewhere_ends_it(
    store: PostgresEventStore, db: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The service stops on a poison event: `svc projections status` in another process shows
    it (it is recorded on the checkpoint row), and meeting it there costs no second traceback; a
    successful rebuild in that process (with a fixed projector) clears it, and the service's
    runner, stopped, goes on from the rebuilt model."""
    await chat(store, WS, "c1", 1)
    bad = await append(store, WS, "conversation:c1", NewEvent(type="conversation.renamed", data={}))
    notifier = CommitSignal()
    service = ProjectionRunner(db, [ConversationsProjector()], notifier=notifier)
    await service.start()
    cli_db = await Database.connect(database_url, max_size=2)

    async def busy() -> None:
        """Commits and their wake-ups faster than the service's fallback poll: it never idles."""
        n = 0
        while True:
            n += 1
            await append(store, WS, f"conversation:busy{n}", started(WS, f"busy{n}"))
            notifier.committed()
            await asyncio.sleep(0.01)

    try:
        assert not await service.wait_for(bad.cursor, PATIENCE_S)  # False once it stopped
        cli = ProjectionRunner(cli_db, [ConversationsProjector()])
        async with asyncio.timeout(PATIENCE_S):  # the service stores the stop just after
            while True:
                (status,) = await cli.status()
                if status.failure is not None:
                    break
                await asyncio.sleep(0.05)
        assert status.failure.cursor == bad.cursor
        assert "title" in status.failure.error and not status.running
        # Its own catch-up (the CLI's on exit) meets the same stop: told in one line.
        caplog.clear()
        with pytest.raises(ProjectionFailed):
            await cli.catch_up()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert "already reported" in caplog.text

        fixed = ProjectionRunner(cli_db, [_Lenient()])
        await fixed.rebuild("conversations")
        assert (await fixed.status())[0].failure is None
        load = asyncio.create_task(busy())
        for _ in range(int(PATIENCE_S / 0.01)):  # the service looks within a second
            if (await service.status())[0].failure is None:
                break
            await asyncio.sleep(0.01)
        await cancel_and_wait(load)
        later = await append(store, WS, "conversation:c1", renamed("c1", "after the fix"))
        assert await service.wait_for(later.cursor, PATIENCE_S)
    finally:
        await service.stop()
        await cli_db.close()
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None and conversation.title == "after the fix"


async def test_wait_for_a_cursor_not_yet_visible_times_out(
    store: PostgresEventStore, db: Database
) -> None:
    runner = ProjectionRunner(db, default_projectors())
    await chat(store, WS, "c1", 1)
    head = await store.head()
    # An open writing transaction holds back every gap-free reader: an event committed after
    # it began stays invisible until it ends, so the runner cannot reach it yet.
    async with db.transaction() as blocker:
        await blocker.execute("SELECT pg_current_xact_id()")
        later = await append(store, WS, "conversation:c1", renamed("c1", "late"))
        assert await runner.wait_for(head, PATIENCE_S)
        assert not await runner.wait_for(later.cursor, 0.3)
    assert await runner.wait_for(later.cursor, PATIENCE_S)
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None and conversation.title == "late"


async def test_an_event_from_a_newer_version_is_waited_on_not_a_poison_event(
    store: PostgresEventStore, db: Database
) -> None:
    """A process meeting an event of a schema version newer than its code (a rollback, a
    mixed deploy) neither misreads it nor records a stop that would halt the projection in
    every process, the newer one included: the projector that reads it waits, and the
    others, which a rollback would otherwise freeze too (API keys among them), go on."""
    await chat(store, WS, "c1", 1)
    current = renamed("c1", "from the future")
    data = current.model_dump(mode="json")
    newer = NewEvent(type=current.type_name, data=data, schema_version=99)
    await append(store, WS, "conversation:c1", newer)
    await chat(store, WS, "c2", 1)  # after it in the log
    runner = ProjectionRunner(db, default_projectors(), batch_size=100)
    with pytest.raises(EventFromNewerVersion, match="upgrade this process"):
        await runner.catch_up(names=["conversations", "messages"])
    status = {s.name: s for s in await runner.status()}
    assert status["conversations"].failure is None
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None and conversation.title != "from the future"
    # Only the projector that reads that event waits: the others go on past it.
    assert status["messages"].lag_events == 0
    assert len(await queries.get_messages(db, WS, "c2")) == 2


async def test_a_type_this_process_does_not_know_is_waited_on_by_its_namespace(
    store: PostgresEventStore, db: Database
) -> None:
    """Review finding: only a known type of a newer schema version was waited on. A type
    unknown here (`identity.totp_reset` met by the version before it) was passed over by
    every projector, its checkpoint moved past it for good, and a rebuild by this process
    left it out. Now the projectors of its namespace wait on it (a rebuild stops on it);
    the others go on."""
    await chat(store, WS, "c1", 1)
    future = NewEvent(type="conversation.summarised", data={"conversation_id": "c1"})
    await append(store, WS, "conversation:c1", future)
    await append(store, WS, "conversation:c1", renamed("c1", "after it"))
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Later"))
    runner = ProjectionRunner(db, default_projectors(), batch_size=100)
    with pytest.raises(EventFromNewerVersion, match="upgrade this process"):
        await runner.catch_up(names=["conversations", "workspaces"])
    status = {s.name: s for s in await runner.status()}
    assert status["conversations"].failure is None and status["conversations"].lag_events > 0
    conversation = await queries.get_conversation(db, WS, "c1")
    assert conversation is not None and conversation.title != "after it"
    assert status["workspaces"].lag_events == 0  # another namespace: not its to wait on
    with pytest.raises(ProjectionFailed, match=r"conversation\.summarised"):
        await runner.rebuild("conversations")


async def test_sql_poison_inside_a_pipelined_run_is_pinpointed(
    store: PostgresEventStore, db: Database
) -> None:
    """A statement the database rejects fails a whole pipelined run of statements; the runner
    retries the batch one statement at a time to stop exactly on the event at fault."""
    await chat(store, WS, "c1", 2)
    good = await append(store, WS, "conversation:c2", user_message("c2", "m-ok", "fine"))
    # Valid against its schema, but its message id is already used in this workspace.
    bad = await append(store, WS, "conversation:c2", user_message("c2", "c1-u0", "again"))
    await append(store, WS, "conversation:c2", user_message("c2", "m-last", "after"))
    runner = ProjectionRunner(db, default_projectors(), batch_size=100)
    with pytest.raises(ProjectionFailed, match="messages"):
        await runner.catch_up(names=["messages"])
    status = {s.name: s for s in await runner.status()}
    failure = status["messages"].failure
    assert failure is not None and failure.cursor == bad.cursor
    assert "messages_workspace_id_message_id_key" in failure.error
    assert status["messages"].cursor == good.cursor
    assert [m.message_id for m in await queries.get_messages(db, WS, "c2")] == ["m-ok"]
    assert len(await queries.get_messages(db, WS, "c1")) == 4


async def test_a_pipelined_run_that_outlasts_the_drivers_timeout_is_redone_a_statement_at_a_time(
    store: PostgresEventStore, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver times a pipelined run (one executemany) as a whole, the server each
    statement: a long run of sound statements can time out on the client alone. That is
    not the database being down (retried as it is, forever): the batch is redone one
    statement at a time, and the read models move on."""
    await chat(store, WS, "c1", 2)
    timeouts = 0

    async def timing_out(self: Pipeline) -> None:
        nonlocal timeouts
        timeouts += 1
        try:
            raise TimeoutError
        except TimeoutError as exc:
            raise StoreUnavailable.with_detail("the event store database timed out", "") from exc

    monkeypatch.setattr(Pipeline, "flush", timing_out)
    runner = ProjectionRunner(db, default_projectors(), batch_size=100)
    await runner.catch_up(names=["conversations", "messages"])
    assert timeouts >= 2
    assert len(await queries.get_messages(db, WS, "c1")) == 4
    assert {s.name: s for s in await runner.status()}["messages"].lag_events == 0


async def test_rebuild_in_another_process_while_the_service_projects(
    store: PostgresEventStore, db: Database, database_url: str
) -> None:
    """`svc projections rebuild` next to a running service: both move the same checkpoints;
    the compare-and-set and the row lock keep every event applied once, without deadlock."""
    await _history(store, 0)
    service = ProjectionRunner(db, default_projectors(), poll_interval_s=0.01, batch_size=5)
    cli_db = await Database.connect(database_url, max_size=2)
    await service.start()
    try:
        cli = ProjectionRunner(cli_db, default_projectors(), batch_size=5)
        writer = asyncio.create_task(_history(store, 10))
        for name in cli.names:
            await cli.rebuild(name)
        # Its own last cursor: the gap-free head may stop short while a batch is open.
        assert await service.wait_for(await writer, PATIENCE_S)
    finally:
        await service.stop()
        await cli_db.close()
    concurrent = await _dump(db)
    assert len(concurrent["conversations"]) == 6
    assert {r[-2] for r in concurrent["conversations"]} == {6}  # message_count of each
    for name in service.names:
        await service.rebuild(name)
    assert await _dump(db) == concurrent


async def test_stop_ends_the_runner_wherever_its_cancellation_lands(
    db: Database, stops_wherever_cancelled: Callable[..., Awaitable[None]]
) -> None:
    await stops_wherever_cancelled(
        lambda: ProjectionRunner(db, [ConversationsProjector()], poll_interval_s=30.0)
    )


async def test_a_background_step_with_every_projector_busy_elsewhere_does_nothing(
    db: Database,
) -> None:
    """While a catch-up or rebuild of this process holds every projector, the background
    loop's step (which skips busy projectors) has nothing to move: nothing, not an error."""
    runner = ProjectionRunner(db, [ConversationsProjector()])
    slots = list(runner._slots.values())
    async with contextlib.AsyncExitStack() as held:
        for slot in slots:
            await held.enter_async_context(slot.lock)
        assert await runner._step(slots, wait=False) == 0


async def test_readers_see_the_old_read_model_until_a_rebuild_switches(
    store: PostgresEventStore, db: Database, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild beside the running service replays into copies: after every one of its
    batches the live model still answers as before (a revoked key stays revoked, the other
    keys are there) while the service keeps it current; the switch then leaves it equal to
    the incremental one."""
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Run"))
    for n in range(12):
        await append(store, WS, f"workspace:{WS}", key_issued(WS, f"k{n}", f"svc_key{n}"))
    await append(store, WS, f"workspace:{WS}", key_revoked(WS, "k0"))
    service = ProjectionRunner(db, default_projectors(), poll_interval_s=0.005, batch_size=5)
    await service.start()
    cli_db = await Database.connect(database_url, max_size=2)
    seen: list[tuple[bool, int]] = []
    real_batch = rebuild_module._Replay.batch

    async def batch_then_read(replay: Any, conn: Any) -> bool:
        more = await real_batch(replay, conn)
        if not conn.is_in_transaction():  # the passes before the switch
            revoked = await queries.find_api_key_by_hash(db, key_hash("svc_key0"))
            keys = await queries.list_api_keys(db, WS)
            seen.append((revoked is not None and revoked.revoked_at is not None, len(keys)))
        return more

    monkeypatch.setattr(rebuild_module._Replay, "batch", batch_then_read)
    try:
        await service.catch_up()
        cli = ProjectionRunner(cli_db, default_projectors(), batch_size=5)
        calls: list[tuple[int, int, str]] = []
        # An admin read (REPEATABLE READ) whose snapshot predates the switch, and whose
        # first look at api_keys comes after it: it must find the old rows, not none.
        async with db.scoped(WS) as reader:
            await reader.fetchval("SELECT count(*) FROM conversations")
            rebuilt = await cli.rebuild(
                "api_keys", lambda done, of, phase: calls.append((done, of, phase))
            )
            assert await reader.fetchval("SELECT count(key_id) FROM api_keys") == 12
        await append(store, WS, f"workspace:{WS}", key_issued(WS, "k-late", "svc_late"))
        assert await service.wait_for(await store.head(), PATIENCE_S)
    finally:
        await service.stop()
        await cli_db.close()
    assert rebuilt == 13 and calls[-1] == (13, 13, "done") and len(seen) >= 3
    assert seen == [(True, 12)] * len(seen)
    keys = await queries.list_api_keys(db, WS)
    assert len(keys) == 13 and [k.key_id for k in keys if k.revoked_at] == ["k0"]


async def test_a_rebuild_counts_again_what_the_growing_log_holds(
    store: PostgresEventStore, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events appended during the replay are counted into the total as it goes, so the
    progress is never shown complete while there is more to replay."""
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Grow"))
    for n in range(10):
        await append(store, WS, f"workspace:{WS}", key_issued(WS, f"g{n}", f"svc_grow{n}"))
    monkeypatch.setattr(rebuild_module, "RECOUNT_EVERY_S", 0.0)
    real_batch = rebuild_module._Replay.batch
    late: list[str] = []

    async def batch_then_grow(replay: Any, conn: Any) -> bool:
        more = await real_batch(replay, conn)
        if not conn.is_in_transaction() and len(late) < 3:
            late.append(f"late{len(late)}")
            await append(store, WS, f"workspace:{WS}", key_issued(WS, late[-1], late[-1] + "k"))
        return more

    monkeypatch.setattr(rebuild_module._Replay, "batch", batch_then_grow)
    calls: list[tuple[int, int, str]] = []
    runner = ProjectionRunner(db, default_projectors(), batch_size=4)
    rebuilt = await runner.rebuild("api_keys", lambda d, t, p: calls.append((d, t, p)))
    assert rebuilt == 13 and calls[:2] == [(0, 0, "checking"), (0, 10, "replaying")]
    replaying = [(done, total) for done, total, phase in calls if phase == "replaying"]
    assert max(total for _, total in replaying) == 13  # the totals followed the growth
    assert all(done < total for done, total in replaying[:-1])  # never full too early
    assert calls[-2:] == [(13, 13, "switching"), (13, 13, "done")]


async def test_a_page_of_the_log_is_cut_by_its_stored_bytes(
    store: PostgresEventStore, db: Database
) -> None:
    """Every event once, in order, pages holding at most the budget (the first event always
    taken), and `more` until the last page."""
    blob = secrets.token_urlsafe(75_000)  # about 100 kB stored: random text stays that size
    for i in range(7):
        await append(store, WS, f"conversation:big{i}", NewEvent("big", {"text": blob}, 1))
    pages: list[int] = []
    seen: list[str] = []
    point = ORIGIN
    async with db.acquire() as conn:
        while True:
            events, more = await read_log_cut(conn, point, 500, 250_000)
            if events:
                pages.append(len(events))
                seen += [e.stream_id for e in events]
                point = events[-1].point
            if not more:
                break
        one_each, _ = await read_log_cut(conn, ORIGIN, 500, 1)
    assert seen == [f"conversation:big{i}" for i in range(7)]
    assert max(pages) <= 3 and len(pages) >= 3, pages
    assert len(one_each) == 1


async def test_batches_cut_by_bytes_project_and_rebuild_every_event(
    store: PostgresEventStore, db: Database
) -> None:
    """A batch of one event (a budget of one byte) is a full batch: the runner goes on at
    once, and a rebuild does not take it for the end of the log."""
    await _history(store, 0)
    await ProjectionRunner(db, default_projectors()).catch_up()
    expected = await _dump(db)
    tight = ProjectionRunner(db, default_projectors(), batch_bytes=1)
    for projector in default_projectors():
        async with db.acquire() as conn:
            log_size = await conn.fetchval(
                "SELECT count(*) FROM events WHERE type = ANY($1)", sorted(projector.event_types)
            )
        assert await tight.rebuild(projector.name) == log_size
    assert await _dump(db) == expected


async def test_a_rebuild_whose_database_freezes_fails_instead_of_waiting_for_ever(
    store: PostgresEventStore, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: the rebuild's own connection waited for answers without a bound, so a
    database cut off without a reset (a frozen host) stopped its progress bar for ever. Its
    backend is frozen as it applies a batch here: the rebuild ends as StoreUnavailable once
    the pool's bound (the statement timeout plus a margin) has passed."""
    await append(store, WS, f"workspace:{WS}", workspace_created(WS, "Frozen"))
    for n in range(3):
        await chat(store, WS, f"f{n}", 2)
    short = await Database.connect(database_url, max_size=2, statement_timeout_ms=200)
    runner = ProjectionRunner(short, default_projectors(), batch_size=2)
    frozen: list[int] = []
    apply = rebuild_module._Replay._apply

    async def freezing(replay: Any, conn: Any, events: Any) -> None:
        if replay.done and not frozen:  # the second batch: SIGSTOP the rebuild's backend
            frozen.append(conn.get_server_pid())
            os.kill(frozen[0], signal.SIGSTOP)
        await apply(replay, conn, events)

    monkeypatch.setattr(rebuild_module._Replay, "_apply", freezing)
    try:
        async with asyncio.timeout(PATIENCE_S):
            with pytest.raises(StoreUnavailable, match="timed out"):
                await runner.rebuild("messages")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        await short.close()
    assert frozen
