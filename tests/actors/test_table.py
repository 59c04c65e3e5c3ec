"""The activation table itself, below the runtime port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, ClassVar, cast

import pytest
from actor_doubles import COUNTER, AddToCounter, CounterBehaviour, CounterState, ScriptedProvider

from actors import (
    ActivationTable,
    ActorKey,
    CommandInterrupted,
    CommandOutcome,
    ConflictRetriesExhausted,
    ConversationBehaviour,
    ConversationState,
    MailboxFull,
    RuntimeNotStarted,
    RuntimeStopping,
    UnknownActorKind,
    WorkspaceBehaviour,
    conversation_key,
    workspace_key,
)
from actors import context as context_module
from actors import table as table_module
from actors.behaviour import ActorContext
from actors.context import Activation, Counters, ExecutionPolicy, conflict_backoff
from actors.conversation import RECENT_TURNS
from actors.errors import RecordedTurnFailure, TurnCrashed
from eventstore import PostgresEventStore
from eventstore.errors import StatementAborted, StoreUnavailable
from eventstore.records import NewEvent, RecordedEvent, Snapshot
from schemas.commands import Command
from schemas.conversation import Message, RenameConversation, RunTurn
from schemas.errors import Conflict, InvalidInput, SvcError, UpstreamError
from schemas.events import EVENTS
from schemas.workspace import CreateWorkspace, IssueApiKey, RevokeApiKey

WS = "ws-1"


def add(amount: int = 1, command_id: str | None = None) -> AddToCounter:
    return AddToCounter(command_id=command_id or uuid.uuid4().hex, workspace_id=WS, amount=amount)


class ReplayInFull(ConversationBehaviour):
    """Ignores every snapshot of the real behaviour (another state schema): full replay."""

    state_schema_version: ClassVar[int] = ConversationBehaviour.state_schema_version + 1


async def load(
    store: PostgresEventStore, key: ActorKey, behaviour: ConversationBehaviour
) -> Activation[ConversationState]:
    activation = Activation(key, behaviour, store, EVENTS, ExecutionPolicy(), Counters())
    await activation.load()
    return activation


async def run_turns(table: ActivationTable, key: ActorKey, count: int) -> None:
    for n in range(count):
        turn = RunTurn(
            command_id=uuid.uuid4().hex,
            workspace_id=WS,
            turn_id=f"t{n}",
            message_id=f"m{n}",
            model="scripted",
            messages=(Message(role="user", content=f"question {n}"),),
            at=datetime.now(UTC),
        )
        await table.submit(key, turn).last()


async def test_conversation_from_snapshot_equals_full_replay(store: PostgresEventStore) -> None:
    table = ActivationTable(store, [ConversationBehaviour([ScriptedProvider()])], snapshot_every=5)
    await table.start()
    key = conversation_key(uuid.uuid4().hex)
    await run_turns(table, key, 4)
    rename = RenameConversation(
        command_id=uuid.uuid4().hex, workspace_id=WS, title="renamed", at=datetime.now(UTC)
    )
    await table.submit(key, rename).last()
    await table.stop()

    snapshot = await store.load_snapshot(key.stream_id)
    # Appends end at versions 3, 4, 6, 7, 9, 10, 12, 13, 14: snapshots at 6 and 12 (five or
    # more new events each), then at 14 when stop() passivates the actor.
    assert snapshot is not None and snapshot.version == 14
    assert table.stats().snapshots_saved == 3

    recorded = await store.read_stream(key.stream_id)
    behaviour = ConversationBehaviour()
    folded = behaviour.initial_state(key)
    for rec in recorded:
        folded = behaviour.evolve(folded, EVENTS.decode(rec.type, rec.schema_version, rec.data))

    from_snapshot = await load(store, key, ConversationBehaviour())
    full = await load(store, key, ReplayInFull())
    assert from_snapshot.state == full.state == folded
    assert from_snapshot.version == full.version == len(recorded) == 14
    assert folded.title == "renamed" and len(folded.turns) == 4


async def test_a_full_replay_reads_its_stream_a_page_at_a_time(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay of a long stream of large events holds a page of them at a time, never the
    whole stream; the state is the same as one folded from a single read."""
    key = conversation_key(uuid.uuid4().hex)
    table = ActivationTable(store, [ConversationBehaviour([ScriptedProvider()])])
    await table.start()
    await run_turns(table, key, 5)
    await table.stop()
    whole = await load(store, key, ReplayInFull())

    monkeypatch.setattr(context_module, "REPLAY_PAGE", 4)
    read = store.read_stream
    pages: list[int] = []

    async def recording_read(*args: Any, **kwargs: Any) -> list[RecordedEvent]:
        page = await read(*args, **kwargs)
        pages.append(len(page))
        return page

    monkeypatch.setattr(store, "read_stream", recording_read)
    paged = await load(store, key, ReplayInFull())
    assert paged.state == whole.state and paged.version == whole.version
    assert max(pages) == 4 and sum(pages) == whole.version


def _turn(turn_id: str, content: str = "question") -> RunTurn:
    return RunTurn(
        command_id=uuid.uuid4().hex,
        workspace_id=WS,
        turn_id=turn_id,
        message_id=f"m-{turn_id}",
        model="scripted",
        messages=(Message(role="user", content=content),),
        at=datetime.now(UTC),
    )


async def test_turn_window_drops_the_same_turn_after_a_snapshot(
    store: PostgresEventStore,
) -> None:
    # Turn ids that sort against their start order: jsonb hands a snapshot's `turns` back
    # shortest key first, then bytewise, so a window that dropped "the first key" dropped the
    # newest finished turn after a restore and the oldest one live.
    ids = [f"t{99 - n:02d}" for n in range(RECENT_TURNS + 1)]
    key = conversation_key(uuid.uuid4().hex)
    first = ActivationTable(store, [ConversationBehaviour([ScriptedProvider()])])
    await first.start()
    for turn_id in ids[:RECENT_TURNS]:
        await first.submit(key, _turn(turn_id)).last()
    await first.stop()  # passivation snapshots the full window
    assert (await store.load_snapshot(key.stream_id)) is not None

    second = ActivationTable(store, [ConversationBehaviour([ScriptedProvider()])])
    await second.start()
    await second.submit(key, _turn(ids[-1])).last()
    await second.stop()

    from_snapshot = await load(store, key, ConversationBehaviour())
    full = await load(store, key, ReplayInFull())
    assert set(full.state.turns) == set(ids[1:])  # the oldest turn left the window
    assert from_snapshot.state == full.state
    assert from_snapshot.state.turn_by_command == full.state.turn_by_command


async def test_conflict_retries_are_bounded(store: PostgresEventStore) -> None:
    stale = ActivationTable(store, [CounterBehaviour()], conflict_retries=0)
    fresh = ActivationTable(store, [CounterBehaviour()])
    await stale.start()
    await fresh.start()
    key = ActorKey(COUNTER, uuid.uuid4().hex)
    await stale.submit(key, add()).last()
    await fresh.submit(key, add()).last()
    with pytest.raises(ConflictRetriesExhausted, match="other writers moved the stream"):
        await stale.submit(key, add()).last()
    # The failed command left the actor usable: it caught up and the next one lands.
    outcome = await stale.submit(key, add()).last()
    assert outcome.last_version == 3
    await stale.stop()
    await fresh.stop()


def test_conflict_backoff_is_random_below_a_doubling_capped_bound() -> None:
    policy = ExecutionPolicy(conflict_backoff_s=0.002)
    assert conflict_backoff(policy, 1) == 0.0  # one conflict: retried at once
    for conflicts, bound in ((2, 0.002), (3, 0.004), (4, 0.008), (8, 0.1), (30, 0.1)):
        waits = {conflict_backoff(policy, conflicts) for _ in range(50)}
        assert all(0.0 <= w <= bound for w in waits) and len(waits) > 1, conflicts
    assert max(conflict_backoff(policy, 30) for _ in range(200)) > 0.05


def test_a_retried_turn_keeps_a_conflict_or_an_unknown_model_as_first_answered() -> None:
    from actors import RecordedTurnFailure

    again = RecordedTurnFailure("moved 9 times", code="concurrency_conflict")
    assert (again.http_status, again.error_type) == (409, "conflict_error")
    again = RecordedTurnFailure("no model gpt-9", code="model_not_found")
    assert (again.http_status, again.error_type) == (404, "invalid_request_error")
    # A completion the store could not record (the turn is then recorded as failed): a 503.
    first = StatementAborted("canceling statement due to statement timeout")
    again = RecordedTurnFailure(first.message, code=first.code)
    assert (again.http_status, again.error_type) == (first.http_status, first.error_type)
    assert again.http_status == 503 and again.final


async def test_command_id_reused_on_another_actor_is_refused(store: PostgresEventStore) -> None:
    table = ActivationTable(store, [CounterBehaviour()])
    await table.start()
    await table.submit(ActorKey(COUNTER, "a"), add(command_id="shared")).last()
    with pytest.raises(Conflict, match="already used for a request to counter a; send a new"):
        await table.submit(ActorKey(COUNTER, "b"), add(command_id="shared")).last()
    await table.stop()


async def test_submit_checks_lifecycle_and_kind(store: PostgresEventStore) -> None:
    table = ActivationTable(store, [CounterBehaviour()])
    with pytest.raises(RuntimeNotStarted):
        table.submit(ActorKey(COUNTER, "a"), add())
    await table.start()
    with pytest.raises(UnknownActorKind, match="'nope'"):
        table.submit(ActorKey("nope", "a"), add())
    await table.stop()
    with pytest.raises(RuntimeStopping):
        table.submit(ActorKey(COUNTER, "a"), add())


class _AwaitsACancelledFuture(CounterBehaviour):
    """Its first command awaits a future another task cancels (a library's callback, say)."""

    def __init__(self) -> None:
        self.first = True

    async def handle(self, ctx: ActorContext[CounterState], command: Command) -> AsyncIterator[Any]:
        if self.first:
            self.first = False
            doomed = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(doomed.cancel)
            await doomed
        async for item in super().handle(ctx, command):
            yield item


async def test_a_stray_cancellation_fails_one_command_not_the_actor(
    store: PostgresEventStore,
) -> None:
    table = ActivationTable(store, [_AwaitsACancelledFuture()])
    await table.start()
    key = ActorKey(COUNTER, uuid.uuid4().hex)
    try:
        with pytest.raises(SvcError, match="cut short by a cancelled operation"):
            await table.submit(key, add()).last()
        async with asyncio.timeout(10):  # the worker lives on: the next command runs
            outcome = await table.submit(key, add()).last()
        assert isinstance(outcome, CommandOutcome)
    finally:
        await table.stop()


class _FirstLoadCancelled:
    """The store, except that the first snapshot load awaits a future another task cancels."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store
        self.first = True

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def load_snapshot(self, stream_id: str) -> Any:
        if self.first:
            self.first = False
            doomed = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(doomed.cancel)
            await doomed
        return await self._store.load_snapshot(stream_id)


async def test_a_stray_cancellation_of_a_load_fails_its_commands_not_the_key(
    store: PostgresEventStore,
) -> None:
    """Ended by it, the worker left the actor registered with no one to run its mailbox:
    that command and every later one for the key waited for good."""
    table = ActivationTable(cast(Any, _FirstLoadCancelled(store)), [CounterBehaviour()])
    await table.start()
    key = ActorKey(COUNTER, uuid.uuid4().hex)
    await store.append(
        key.stream_id,
        [NewEvent("test.counter_added", {"amount": 1, "note": ""})],
        expected_version=0,
        command_id=uuid.uuid4().hex,
        workspace_id=WS,
    )
    try:
        async with asyncio.timeout(10):
            with pytest.raises(SvcError, match="could not be loaded"):
                await table.submit(key, add()).last()
            outcome = await table.submit(key, add()).last()
        assert isinstance(outcome, CommandOutcome) and outcome.last_version == 2
        assert table.stats().queued == 0
    finally:
        await table.stop()


async def test_table_without_store_runs_queries_but_refuses_writes() -> None:
    table = ActivationTable(None, [CounterBehaviour()])
    await table.start()
    from actors.errors import StoreRequired

    with pytest.raises(StoreRequired, match="no event store"):
        await table.submit(ActorKey(COUNTER, "a"), add()).last()
    await table.stop()


async def test_explicit_passivation_snapshots_idle_actors_only(store: PostgresEventStore) -> None:
    table = ActivationTable(store, [CounterBehaviour()])
    await table.start()
    idle, busy = ActorKey(COUNTER, uuid.uuid4().hex), ActorKey(COUNTER, uuid.uuid4().hex)
    await table.submit(idle, add(2)).last()
    slow = table.submit(busy, AddToCounter(command_id="slow", workspace_id=WS, delay_s=1.0))
    assert await table.passivate([idle, busy, ActorKey(COUNTER, "never-active")]) == [idle]
    assert not table.is_active(idle) and table.is_active(busy)
    snapshot = await store.load_snapshot(idle.stream_id)
    assert snapshot is not None and snapshot.version == 1
    await slow.last()
    await table.stop()


async def test_the_cap_is_restored_once_a_burst_of_busy_actors_is_over(
    store: PostgresEventStore,
) -> None:
    """Busy actors may take the table over its cap; once they are idle, the next activation
    passivates as many least recently used ones as it takes to be under the cap again."""
    table = ActivationTable(store, [CounterBehaviour()], max_active=2)
    await table.start()
    burst = [ActorKey(COUNTER, uuid.uuid4().hex) for _ in range(4)]
    replies = [
        table.submit(k, AddToCounter(command_id=uuid.uuid4().hex, workspace_id=WS, delay_s=0.3))
        for k in burst
    ]
    for reply in replies:
        await reply.last()
    assert table.stats().active == 4  # over the cap while they were all busy
    await table.submit(ActorKey(COUNTER, uuid.uuid4().hex), add(1)).last()
    assert table.stats().active == 2
    assert table.stats().passivations_lru == 3
    await table.stop()


async def test_at_the_cap_an_activation_looks_at_the_least_recently_used_actors_only(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At its cap every new actor evicts one: the table looks for it from the least recently
    used end and stops there, instead of walking every actor it holds."""
    looked_at = 0
    idle = table_module._Slot.idle

    def counted(slot: Any) -> bool:
        nonlocal looked_at
        looked_at += 1
        return bool(idle.fget(slot))  # type: ignore[attr-defined]

    table = ActivationTable(store, [CounterBehaviour()], max_active=50)
    await table.start()
    keys = [ActorKey(COUNTER, uuid.uuid4().hex) for _ in range(50)]
    for key in keys:
        await table.submit(key, add(1)).last()
    monkeypatch.setattr(table_module._Slot, "idle", property(counted))
    await table.submit(ActorKey(COUNTER, uuid.uuid4().hex), add(1)).last()

    assert not table.is_active(keys[0]) and table.is_active(keys[1])
    assert table.stats().active == 50
    assert looked_at == 1
    await table.stop()


class _StalledOnTheWayOut(CounterBehaviour):
    """A command that, when cancelled, waits forever to record its failure: a store that
    stopped answering at shutdown."""

    async def handle(self, ctx: Any, command: Command) -> AsyncIterator[Any]:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.Event().wait()
        yield None


async def until_running(table: ActivationTable) -> None:
    """Until a command runs (its actor activated from the store, which takes a while under
    load): what the test sends next must find it running, not queued."""
    async with asyncio.timeout(10):
        while True:
            stats = table.stats()
            if stats.busy and not stats.queued:  # busy while it loads too, command queued
                return
            await asyncio.sleep(0.005)


async def test_stop_fails_a_command_that_cannot_finish_recording_its_interruption(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "INTERRUPT_RECORD_S", 0.2)
    await interrupted_at_stop(ActivationTable(store, [_StalledOnTheWayOut()]))


async def interrupted_at_stop(table: ActivationTable) -> None:
    """Run one command on `table` and stop it past its deadline: the caller is told the
    command was interrupted."""
    await table.start()
    reply = table.submit(ActorKey(COUNTER, uuid.uuid4().hex), add(1))
    await until_running(table)
    summary = await table.stop(deadline_s=0.1)
    assert summary.interrupted == 1
    with pytest.raises(CommandInterrupted):
        await reply.last()


class _EndsAfterItsInterruption(CounterBehaviour):
    """A command that shrugs off both cancellations of a stop and then ends normally: a
    store that answered after all, late."""

    async def handle(self, ctx: Any, command: Command) -> AsyncIterator[Any]:
        for _ in range(2):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(60)
        yield None


async def test_a_command_given_up_on_at_a_stop_is_counted_once(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted failed when its caller was told it was interrupted, and not processed too
    when it ended after all (the metrics showed one command twice)."""
    monkeypatch.setattr(table_module, "INTERRUPT_RECORD_S", 0.2)
    table = ActivationTable(store, [_EndsAfterItsInterruption()])
    await interrupted_at_stop(table)
    await asyncio.sleep(0.1)  # its handler has ended by now
    stats = table.stats()
    assert (stats.commands_failed, stats.commands_processed) == (1, 0), stats


def test_a_failure_no_one_reads_is_logged_with_a_traceback_only_if_internal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A discarded reply (a `tell`, a client gone) logs its command's failure: a defect (a
    TurnCrashed, its cause chained) with the traceback that is the only account of it; an
    upstream's failure, or a recorded one answered again, in one line."""
    caplog.set_level(logging.WARNING, logger="actors.table")
    try:
        try:
            raise KeyError("the defect")
        except KeyError as exc:
            raise TurnCrashed.of(exc, "c1-cursor") from exc
    except TurnCrashed as caught:
        crashed = caught
    failures = [
        crashed,
        UpstreamError("the upstream model server answered 502"),
        RecordedTurnFailure("internal error while running the turn", code="internal_error"),
    ]
    for failure in failures:
        reply = table_module.Reply("turn of conversation:c")
        reply.discard()
        reply.fail(failure)
    records = [r for r in caplog.records if r.name == "actors.table"]
    assert [r.levelname for r in records] == ["ERROR", "WARNING", "WARNING"]
    assert records[0].exc_info is not None and "KeyError: 'the defect'" in caplog.text
    assert records[1].exc_info is None and records[2].exc_info is None


def test_runtime_errors_pickle_with_their_code() -> None:
    import pickle

    from actors import AskTimeout, RecordedTurnFailure
    from actors.errors import StoreRequired

    errors = [
        RuntimeStopping(),
        RuntimeNotStarted(),
        UnknownActorKind.of("nope", ["counter"]),
        StoreRequired.of("counter:a"),
        AskTimeout("late"),
        ConflictRetriesExhausted("moved"),
        RecordedTurnFailure("502 from upstream", code="upstream_error"),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert (copy.message, copy.code) == (error.message, error.code)


class CountingStore(PostgresEventStore):
    """The real store, counting the reads an activation makes."""

    reads = 0

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        self.reads += 1
        return await super().load_snapshot(stream_id)

    async def read_stream(
        self,
        stream_id: str,
        from_version: int = 1,
        *,
        workspace_id: str | None = None,
        to_version: int | None = None,
    ) -> list[RecordedEvent]:
        self.reads += 1
        return await super().read_stream(
            stream_id, from_version, workspace_id=workspace_id, to_version=to_version
        )


async def test_a_new_stream_command_activates_its_actor_without_reading(
    store: PostgresEventStore,
) -> None:
    counting = CountingStore(store.db)
    table = ActivationTable(counting, [CounterBehaviour()])
    await table.start()
    fresh = ActorKey(COUNTER, uuid.uuid4().hex)
    outcome = await table.submit(fresh, add(2).model_copy(update={"new_stream": True})).last()
    await table.stop()
    assert counting.reads == 0
    assert isinstance(outcome, CommandOutcome) and outcome.last_version == 1
    assert [e.version for e in await store.read_stream(fresh.stream_id)] == [1]


async def test_a_wrong_new_stream_promise_is_caught_by_the_version_fence(
    store: PostgresEventStore,
) -> None:
    """A stream that exists after all: the first append conflicts, the actor catches up from
    the store and decides again, so nothing is lost or forked."""
    table = ActivationTable(store, [CounterBehaviour()])
    await table.start()
    existing = ActorKey(COUNTER, uuid.uuid4().hex)
    for _ in range(3):
        await table.submit(existing, add(1)).last()
    await table.passivate([existing])
    outcome = await table.submit(existing, add(4).model_copy(update={"new_stream": True})).last()
    stats = table.stats()
    await table.stop()
    assert isinstance(outcome, CommandOutcome) and outcome.first_version == 4
    assert stats.conflicts_retried == 1
    assert [e.version for e in await store.read_stream(existing.stream_id)] == [1, 2, 3, 4]


async def test_a_refusal_or_no_op_is_decided_again_on_what_another_process_appended(
    store: PostgresEventStore,
) -> None:
    """Two processes host the same workspace actor (two gateways, or the CLI beside one).
    A key issued by the first is unknown to the second's cached state: revoking it there
    must not be refused as "no such key" (a refusal meets no version fence), nor a second
    revoke be taken for a no-op when the first came from elsewhere."""
    first, second = (ActivationTable(store, [WorkspaceBehaviour()]) for _ in range(2))
    await first.start()
    await second.start()
    ws = f"ws-{uuid.uuid4().hex[:8]}"
    key = workspace_key(ws)
    now = datetime.now(UTC)
    created = CreateWorkspace(command_id=uuid.uuid4().hex, workspace_id=ws, name=ws, at=now)
    await second.submit(key, created).last()  # the second process caches the workspace
    issue = IssueApiKey(
        command_id=uuid.uuid4().hex,
        workspace_id=ws,
        key_id="key-1",
        name="cli key",
        key_hash="0" * 64,
        prefix="svc_abcd",
        scopes=("chat",),
        at=now,
    )
    await first.submit(key, issue).last()
    revoke = RevokeApiKey(command_id=uuid.uuid4().hex, workspace_id=ws, key_id="key-1", at=now)
    outcome = await second.submit(key, revoke).last()
    assert isinstance(outcome, CommandOutcome) and len(outcome.events) == 1
    types = [e.type for e in await store.read_stream(key.stream_id)]
    assert types[-1] == "workspace.api_key_revoked"
    await first.stop()
    await second.stop()


class _StoreDownForReads:
    """A store whose reads fail as unavailable: the database went away mid-command."""

    async def read_stream(self, *args: Any, **kwargs: Any) -> list[RecordedEvent]:
        raise StoreUnavailable("the event store database is unavailable")

    async def processed(self, *args: Any, **kwargs: Any) -> None:
        raise StoreUnavailable("the event store database is unavailable")


async def test_a_refusal_stands_when_the_stream_cannot_be_read_again() -> None:
    """The read before a refusal stands only guards against a stale state: when it fails,
    the client gets its 400 (or 404), not the store's 503."""
    activation = Activation(
        ActorKey(COUNTER, uuid.uuid4().hex),
        CounterBehaviour(),
        _StoreDownForReads(),  # type: ignore[arg-type]
        EVENTS,
        ExecutionPolicy(),
        Counters(),
    )
    activation.start_empty()
    with pytest.raises(InvalidInput, match="adding 0"):
        await activation.execute(add(0))


async def test_a_full_mailbox_refuses_more_commands_at_once(store: PostgresEventStore) -> None:
    """A hot actor whose commands pile up (a slow store, clients retrying) refuses past its
    limit with a retryable 503 instead of queueing without end; what it queued still runs."""
    table = ActivationTable(store, [CounterBehaviour()], mailbox_limit=3)
    await table.start()
    try:
        key = ActorKey(COUNTER, uuid.uuid4().hex)
        slow = AddToCounter(command_id=uuid.uuid4().hex, workspace_id=WS, delay_s=0.3)
        running = table.submit(key, slow)
        await until_running(table)  # the slow one has left the mailbox
        queued = [table.submit(key, add()) for _ in range(3)]
        with pytest.raises(MailboxFull) as refused:
            table.submit(key, add())
        assert refused.value.http_status == 503 and refused.value.code == "actor_busy"
        outcomes = [await reply.last() for reply in (running, *queued)]
        assert [o.last_version for o in outcomes if isinstance(o, CommandOutcome)] == [1, 2, 3, 4]
        await table.submit(key, add()).last()  # room again
    finally:
        await table.stop()


def _turn_of(chars: int) -> RunTurn:
    return _turn(f"turn-{uuid.uuid4().hex}", "x" * chars)


async def test_mailboxes_refuse_text_past_their_budgets(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 turns of 4 MiB queued behind one long turn held 4 GB: the count bounded the
    mailbox, not what it held. One actor's waiting text is bounded, and so is the table's."""
    monkeypatch.setattr(table_module, "MAILBOX_CHARS", 250)
    monkeypatch.setattr(table_module, "TABLE_QUEUED_CHARS", 400)
    slow = ScriptedProvider(deltas=["x"], delay_s=0.3)
    table = ActivationTable(store, [ConversationBehaviour([slow])])
    await table.start()
    try:
        one, other = (conversation_key(uuid.uuid4().hex) for _ in range(2))
        running = table.submit(one, _turn_of(100))
        await until_running(table)  # out of the mailbox
        queued = [table.submit(one, _turn_of(100)) for _ in range(2)]
        with pytest.raises(MailboxFull, match="waiting for this conversation") as refused:
            table.submit(one, _turn_of(100))
        assert refused.value.code == "actor_busy" and refused.value.retry_after_s
        # An actor with nothing waiting takes its command; the whole table's budget still holds.
        waiting_elsewhere = table.submit(other, _turn_of(150))
        active = table.stats().active
        with pytest.raises(MailboxFull, match="waiting for this process"):
            table.submit(conversation_key(uuid.uuid4().hex), _turn_of(200))
        assert table.stats().active == active  # refused before activating (and replaying)
        for reply in (running, *queued, waiting_elsewhere):
            await reply.last()
        await table.submit(one, _turn_of(240)).last()  # every budget is free again
    finally:
        await table.stop()
