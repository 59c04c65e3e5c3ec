"""RunTurn through every runtime: deltas stream back, the turn's facts land in the store."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from actor_doubles import MakeRuntime, RuntimeUnderTest, ScriptedProvider, answer

from actors import (
    ActivationTable,
    ConversationBehaviour,
    LocalRuntime,
    RecordedTurnFailure,
    RuntimeStopping,
    TurnResult,
    conversation_key,
)
from actors import conversation as conversation_module
from actors.errors import TURN_INTERRUPTED_MESSAGE, TurnCrashed
from actors.models.port import TextDelta
from eventstore import PostgresEventStore
from eventstore.errors import StatementAborted, StoreError, StoreUnavailable
from eventstore.records import NewEvent, RecordedEvent
from schemas.conversation import Message, RenameConversation, RunTurn, TurnParams
from schemas.errors import Conflict, NotFound, SvcError, UpstreamError, UpstreamTimeout
from schemas.events import EVENTS

WS = "ws-1"
COMPLETED = "conversation.assistant_message_completed"


def run_turn(
    text: str = "hi there", *, model: str = "scripted", command_id: str | None = None
) -> RunTurn:
    turn = uuid.uuid4().hex
    return RunTurn(
        command_id=command_id or uuid.uuid4().hex,
        workspace_id=WS,
        turn_id=f"turn-{turn}",
        message_id=f"msg-{turn}",
        model=model,
        messages=(
            Message(role="system", content="be brief"),
            Message(role="user", content=text, name="ada"),
        ),
        params=TurnParams(temperature=0.5, max_tokens=64),
        at=datetime.now(UTC),
    )


async def types_of(store: PostgresEventStore, conversation_id: str) -> list[str]:
    return [r.type for r in await store.read_stream(conversation_key(conversation_id).stream_id)]


async def eventually_recorded(store: PostgresEventStore, cid: str, last_type: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 20.0
    while not (types := await types_of(store, cid)) or types[-1] != last_type:
        if loop.time() > end:
            pytest.fail(f"conversation {cid} never recorded {last_type}: {types}")
        await asyncio.sleep(0.02)


async def test_run_turn_streams_deltas_then_records_the_turn(
    runtime: RuntimeUnderTest, store: PostgresEventStore, provider: ScriptedProvider
) -> None:
    cid = uuid.uuid4().hex
    command = run_turn("hello, who are you?")
    items = [item async for item in runtime.stream(conversation_key(cid), command)]

    deltas, result = items[:-1], items[-1]
    assert deltas == [TextDelta(t) for t in (*provider.deltas, " #1")]
    assert isinstance(result, TurnResult)
    assert (result.conversation_id, result.turn_id, result.model) == (
        cid,
        command.turn_id,
        "scripted",
    )
    assert result.content == answer(provider, 1)
    assert result.finish_reason == "stop"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (6, 4)
    assert result.cursor and not result.duplicate

    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert [(r.version, r.type) for r in recorded] == [
        (1, "conversation.started"),
        (2, "conversation.user_message_received"),
        (3, "conversation.turn_started"),
        (4, "conversation.assistant_message_completed"),
    ]
    started, user, turn, done = (r.data for r in recorded)
    assert started["workspace_id"] == WS and started["title"] == "hello, who are you?"
    assert (user["content"], user["name"], user["turn_id"]) == (
        "hello, who are you?",
        "ada",
        command.turn_id,
    )
    assert turn["params"] == {"temperature": 0.5, "top_p": None, "max_tokens": 64}
    assert (turn["request_messages"], turn["command_id"]) == (2, command.command_id)
    assert done["content"] == result.content and done["message_id"] == result.message_id
    assert (done["prompt_tokens"], done["completion_tokens"], done["total_tokens"]) == (6, 4, 10)
    assert done["duration_ms"] == result.duration_ms >= 0
    assert all(r.workspace_id == WS for r in recorded)


async def test_second_turn_appends_to_the_same_conversation(
    runtime: RuntimeUnderTest, store: PostgresEventStore, provider: ScriptedProvider
) -> None:
    cid = uuid.uuid4().hex
    await runtime.ask(conversation_key(cid), run_turn("one"))
    second = await runtime.ask(conversation_key(cid), run_turn("two"))
    assert isinstance(second, TurnResult) and second.content == answer(provider, 2)
    assert (await types_of(store, cid)).count("conversation.started") == 1
    assert len(await types_of(store, cid)) == 7


async def test_a_long_answer_is_not_held_in_the_state_yet_a_retry_returns_it(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """Sixteen answers of up to a million characters each were held in every active
    conversation's state and written into each snapshot."""
    long = ScriptedProvider(deltas=["word " * 2000])  # 10,000 characters
    runtime = await make_runtime([ConversationBehaviour([long])])
    cid, command = uuid.uuid4().hex, run_turn(command_id="long-key")
    first = await runtime.ask(conversation_key(cid), command)
    again = await runtime.ask(conversation_key(cid), command)
    assert isinstance(first, TurnResult) and isinstance(again, TurnResult)
    assert len(first.content) > conversation_module.HELD_CONTENT_CHARS
    assert again.duplicate and (again.content, again.usage) == (first.content, first.usage)
    # From a fresh activation too, which folds the log (or a snapshot) again.
    other = await make_runtime([ConversationBehaviour([ScriptedProvider()])])
    third = await other.ask(conversation_key(cid), command)
    # The same answer each time, never a second call (which would end " #2", or the other
    # runtime's own provider's words): the provider may run in another process (Ray).
    assert isinstance(third, TurnResult) and third.content == first.content
    assert first.content.endswith(" #1")
    # The same id from another workspace is the 404 of any conversation not its own.
    with pytest.raises(NotFound):
        await runtime.ask(conversation_key(cid), command.model_copy(update={"workspace_id": "w2"}))
    behaviour = ConversationBehaviour()  # the fold every activation runs
    state = behaviour.initial_state(conversation_key(cid))
    for recorded in await store.read_stream(conversation_key(cid).stream_id):
        decoded = EVENTS.decode(recorded.type, recorded.schema_version, recorded.data)
        state = behaviour.evolve(state, decoded)
    assert len(state.model_dump_json()) < 5_000  # what a snapshot of it holds
    assert state.turns[first.turn_id].content is None


async def test_retried_turn_returns_the_first_answer_without_a_model_call(
    make_runtime: MakeRuntime, runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    cid = uuid.uuid4().hex
    first = await runtime.ask(conversation_key(cid), run_turn(command_id="turn-key"))
    again = await runtime.ask(conversation_key(cid), run_turn(command_id="turn-key"))
    assert isinstance(first, TurnResult) and isinstance(again, TurnResult)
    assert again.duplicate and not first.duplicate
    assert (again.turn_id, again.content, again.usage) == (
        first.turn_id,
        first.content,
        first.usage,
    )
    # A fresh activation (another host, after a restart) must not call the model either: its
    # provider would answer "#1" for its own first call.
    other = await make_runtime([ConversationBehaviour([ScriptedProvider()])])
    third = await other.ask(conversation_key(cid), run_turn(command_id="turn-key"))
    assert isinstance(third, TurnResult) and third.duplicate and third.content == first.content
    assert await types_of(store, cid) == [
        "conversation.started",
        "conversation.user_message_received",
        "conversation.turn_started",
        "conversation.assistant_message_completed",
    ]


async def test_a_retry_must_be_the_request_its_key_first_named(
    make_runtime: MakeRuntime, runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    """The digest of the client's request rides with the turn (TurnStarted version 2): the
    same key with another request is refused, with the same one answered from the record,
    in a fresh activation too. A turn recorded before digests were (version 1, none) is
    answered to any retry, as it was."""
    cid = uuid.uuid4().hex
    first = run_turn(command_id="key-a").model_copy(update={"body_digest": "a" * 32})
    assert isinstance(await runtime.ask(conversation_key(cid), first), TurnResult)
    other = await make_runtime([ConversationBehaviour([ScriptedProvider()])])
    for host in (runtime, other):
        again = run_turn(command_id="key-a").model_copy(update={"body_digest": "a" * 32})
        assert (await host.ask(conversation_key(cid), again)).duplicate
        another = run_turn(command_id="key-a").model_copy(update={"body_digest": "b" * 32})
        with pytest.raises(Conflict) as refused:
            await host.ask(conversation_key(cid), another)
        assert refused.value.code == "idempotency_key_reused"

    recorded = await store.read_stream(conversation_key(cid).stream_id)
    started = next(r for r in recorded if r.type == "conversation.turn_started")
    assert started.schema_version == 2 and started.data["body_digest"] == "a" * 32
    old = {k: v for k, v in started.data.items() if k != "body_digest"}
    assert EVENTS.decode(started.type, 1, old).body_digest is None  # type: ignore[attr-defined]


async def test_abandoned_stream_still_records_the_turn(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    slow = ScriptedProvider(deltas=[f"w{i} " for i in range(10)], delay_s=0.05)
    runtime = await make_runtime([ConversationBehaviour([slow])])
    cid = uuid.uuid4().hex
    stream = runtime.stream(conversation_key(cid), run_turn())
    async for item in stream:
        assert isinstance(item, TextDelta)
        break
    await stream.aclose()  # type: ignore[attr-defined]

    await eventually_recorded(store, cid, "conversation.assistant_message_completed")
    done = (await store.read_stream(conversation_key(cid).stream_id))[-1].data
    assert done["content"] == answer(slow, 1)


async def test_failing_provider_records_turn_failed_and_reraises(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    failing = ScriptedProvider(fail_after=1)
    runtime = await make_runtime([ConversationBehaviour([failing])])
    cid = uuid.uuid4().hex
    command = run_turn()
    seen: list[object] = []
    with pytest.raises(UpstreamError, match="502"):
        async for item in runtime.stream(conversation_key(cid), command):
            seen.append(item)
    assert seen == [TextDelta(failing.deltas[0])]

    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert recorded[-1].type == "conversation.turn_failed"
    failed = recorded[-1].data
    assert (failed["turn_id"], failed["error_code"], failed["retryable"]) == (
        command.turn_id,
        "upstream_error",
        True,
    )
    # The retry gets the recorded failure; the model is not called again.
    with pytest.raises(RecordedTurnFailure, match="first attempt"):
        await runtime.ask(conversation_key(cid), command)
    assert len(await store.read_stream(conversation_key(cid).stream_id)) == len(recorded)


async def test_a_turn_ended_by_a_defect_is_recorded_and_raised_with_its_cursor(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """An exception that is no SvcError (a defect) fails the turn like any other failure: it
    is recorded, and the caller gets a 500 carrying the record's cursor and naming the
    defect (for the log: the gateway shows a client an error id only)."""
    broken = ScriptedProvider(fail_after=1, failure=KeyError("the defect"))
    runtime = await make_runtime([ConversationBehaviour([broken])])
    cid = uuid.uuid4().hex
    with pytest.raises(TurnCrashed) as raised:
        async for _ in runtime.stream(conversation_key(cid), run_turn()):
            pass
    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert recorded[-1].type == "conversation.turn_failed"
    assert recorded[-1].data["error_code"] == "internal_error"
    crashed = raised.value
    assert crashed.http_status == 500 and crashed.recorded_cursor == recorded[-1].cursor
    assert "KeyError" in crashed.message  # a ray host sends no __cause__ across


async def test_an_answer_past_what_a_message_holds_is_cut_off_as_it_streams(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """A flooding upstream is stopped at the first delta past MAX_CONTENT, not read to its
    end and then refused: memory stays bounded by what a message can hold."""
    flooding = ScriptedProvider(deltas=["x" * 400_000] * 10)
    runtime = await make_runtime([ConversationBehaviour([flooding])])
    cid = uuid.uuid4().hex
    seen: list[object] = []
    with pytest.raises(UpstreamError) as raised:
        async for item in runtime.stream(conversation_key(cid), run_turn()):
            seen.append(item)
    assert raised.value.code == "upstream_bad_response" and "max_tokens" in raised.value.message
    assert len(seen) == 2  # 800,000 characters passed on; the third delta went over
    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert recorded[-1].type == "conversation.turn_failed"
    assert recorded[-1].data["error_code"] == "upstream_bad_response"


async def test_a_retried_failure_keeps_the_status_of_its_first_attempt(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """A timed-out turn is a 504; its retry (same command id) answers 504 again, not the
    502 of an upstream's refusal."""
    timing_out = ScriptedProvider(fail_after=0, failure=UpstreamTimeout("over the 3s budget"))
    runtime = await make_runtime([ConversationBehaviour([timing_out])])
    cid, command = uuid.uuid4().hex, run_turn()
    with pytest.raises(UpstreamTimeout):
        await runtime.ask(conversation_key(cid), command)
    recorded = await store.read_stream(conversation_key(cid).stream_id)
    with pytest.raises(RecordedTurnFailure) as raised:
        await runtime.ask(conversation_key(cid), command)
    retried = raised.value
    assert (retried.http_status, retried.error_type, retried.code) == (
        UpstreamTimeout.http_status,
        UpstreamTimeout.error_type,
        "ErrCallTimeout",
    )
    assert "over the 3s budget" in retried.message
    # Nothing more recorded: the model was not called again (under the ray runtime the
    # provider runs in a host process, so the log is what the test can see).
    assert len(await store.read_stream(conversation_key(cid).stream_id)) == len(recorded)


async def test_unknown_model_is_refused_before_anything_is_recorded(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    cid = uuid.uuid4().hex
    with pytest.raises(NotFound, match="not available"):
        await runtime.ask(conversation_key(cid), run_turn(model="no-such-model"))
    assert await types_of(store, cid) == []


async def test_commands_on_a_missing_conversation_say_so(runtime: RuntimeUnderTest) -> None:
    rename = RenameConversation(
        command_id=uuid.uuid4().hex, workspace_id=WS, title="x", at=datetime.now(UTC)
    )
    with pytest.raises(NotFound, match="does not exist"):
        await runtime.ask(conversation_key(uuid.uuid4().hex), rename)


async def test_retry_on_a_second_activation_finds_the_first_turn_abandoned(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    # Routing gives a key one process, so a second activation takes the first for dead and
    # records its running turn as abandoned; the first, if alive after all, loses at the
    # version fence and tells its caller that its answer is not recorded
    # (tests/actors/test_turn_recovery.py covers this in depth).
    # 2 s of turn: time for the second host to record it abandoned first, under Ray too.
    slow = ScriptedProvider(deltas=["a"] * 5, delay_s=0.4)
    first_host = await make_runtime([ConversationBehaviour([slow])])
    second_host = await make_runtime([ConversationBehaviour([ScriptedProvider()])])
    cid = uuid.uuid4().hex
    command = run_turn(command_id="busy-key")
    running = asyncio.create_task(first_host.ask(conversation_key(cid), command))
    await eventually_recorded(store, cid, "conversation.turn_started")
    with pytest.raises(RecordedTurnFailure) as raised:
        await second_host.ask(conversation_key(cid), command)
    assert raised.value.code == "turn_abandoned"
    with pytest.raises(RecordedTurnFailure, match="is not recorded"):
        await running


async def test_stop_past_the_deadline_records_the_interrupted_turn(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    hanging = ScriptedProvider(deltas=["x"], delay_s=60.0)
    runtime = await make_runtime([ConversationBehaviour([hanging])])
    cid = uuid.uuid4().hex
    task = asyncio.create_task(runtime.ask(conversation_key(cid), run_turn()))
    await eventually_recorded(store, cid, "conversation.turn_started")
    await runtime.stop(deadline_s=0.1)
    with pytest.raises(RuntimeStopping):
        await task
    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert recorded[-1].type == "conversation.turn_failed"
    assert (recorded[-1].data["error_code"], recorded[-1].data["retryable"]) == (
        "interrupted",
        True,
    )


class _StartThatHangs:
    """The store, but a turn's start never answers once it committed (a connection that
    stalls on the way back)."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store
        self.committed = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def append(self, stream_id: str, events: Sequence[NewEvent], **kw: Any) -> Any:
        result = await self._store.append(stream_id, events, **kw)
        if any(e.type == STARTED for e in events):
            self.committed.set()
            await asyncio.Event().wait()
        return result


async def test_a_stop_that_cuts_a_committed_start_short_records_the_turn_failed(
    store: PostgresEventStore,
) -> None:
    """Left running, the turn's key answered 409 until it was abandoned, with no model call,
    and its caller was told a same-key retry returns the result or runs it."""
    hanging = _StartThatHangs(store)
    provider = ScriptedProvider()
    runtime = LocalRuntime(ActivationTable(cast(Any, hanging), [ConversationBehaviour([provider])]))
    await runtime.start()
    cid = uuid.uuid4().hex
    asking = asyncio.create_task(runtime.ask(conversation_key(cid), run_turn()))
    await hanging.committed.wait()
    await runtime.stop(deadline_s=0.05)
    with pytest.raises(RuntimeStopping) as told:
        await asking
    assert told.value.message == TURN_INTERRUPTED_MESSAGE
    failed = (await store.read_stream(conversation_key(cid).stream_id))[-1]
    assert failed.type == "conversation.turn_failed", failed
    assert failed.data["error_code"] == "interrupted" and provider.calls == 0


class SnapshotsThatHang:
    """The store, but the save of a snapshot holding a completed turn never returns (a
    stalled database) while `armed`."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store
        self.armed = True
        self.hanging = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def save_snapshot(self, snapshot: Any) -> None:
        turns = snapshot.state.get("turns", {}).values()
        if self.armed and any(t["status"] == "completed" for t in turns):
            self.hanging.set()
            await asyncio.Event().wait()
        await self._store.save_snapshot(snapshot)


async def test_a_stop_after_the_answer_committed_says_it_is_recorded(
    store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Cut short in the snapshot after its answer committed, the turn's caller was told its
    turn was recorded as failed and to send it again with a new key: a second model call
    and a doubled turn for an answer the log holds."""
    stalling = SnapshotsThatHang(store)
    provider = ScriptedProvider(deltas=["x"])
    table = ActivationTable(
        cast(PostgresEventStore, stalling), [ConversationBehaviour([provider])], snapshot_every=1
    )
    runtime = LocalRuntime(table)
    await runtime.start()
    cid, command = uuid.uuid4().hex, run_turn()
    asking = asyncio.create_task(runtime.ask(conversation_key(cid), command))
    await stalling.hanging.wait()  # the snapshot after the answer's append
    stalling.armed = False
    await runtime.stop(deadline_s=0.05)
    with pytest.raises(RuntimeStopping) as told:
        await asking
    assert "the answer is recorded" in told.value.message
    assert "new Idempotency-Key" not in told.value.message
    assert (await types_of(store, cid))[-1] == COMPLETED
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # The same key returns the answer, without a second model call.
    again = LocalRuntime(ActivationTable(store, [ConversationBehaviour([provider])]))
    await again.start()
    try:
        result = await again.ask(conversation_key(cid), command)
    finally:
        await again.stop()
    assert isinstance(result, TurnResult) and result.duplicate
    assert len(provider.requests) == 1


async def test_the_model_is_asked_to_stream_only_when_someone_reads_the_deltas(
    store: PostgresEventStore,
) -> None:
    # The local runtime's own contract: `ask` reads no intermediate item.
    provider = ScriptedProvider()
    runtime = LocalRuntime(ActivationTable(store, [ConversationBehaviour([provider])]))
    await runtime.start()
    try:
        key = conversation_key(uuid.uuid4().hex)
        streamed = [item async for item in runtime.stream(key, run_turn("one"))]
        asked = await runtime.ask(key, run_turn("two"))
    finally:
        await runtime.stop()
    assert [r.stream for r in provider.requests] == [True, False]
    # Either way the whole answer comes back and is recorded.
    assert isinstance(streamed[-1], TurnResult) and isinstance(asked, TurnResult)
    assert asked.content == answer(provider, 2)


async def _last_event_of_a_failed_turn(
    store: PostgresEventStore, table: ActivationTable
) -> RecordedEvent:
    """Run one turn on `table`, which must fail it with an SvcError; the conversation's last
    recorded event."""
    await table.start()
    cid = uuid.uuid4().hex
    with pytest.raises(SvcError):
        await table.submit(conversation_key(cid), run_turn()).last()
    await table.stop()
    return (await store.read_stream(conversation_key(cid).stream_id))[-1]


class _CompletionOutage:
    """The store, except that every append of a turn's completion fails as an outage
    would (StoreUnavailable, or `failure`) without writing anything."""

    def __init__(self, store: PostgresEventStore, failure: SvcError | None = None) -> None:
        self._store = store
        self.refused = 0
        self.failure = failure or StoreUnavailable("the database went away")

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def append(self, stream_id: str, events: Sequence[NewEvent], **kw: Any) -> Any:
        if any(e.type == COMPLETED for e in events):
            self.refused += 1
            raise self.failure
        return await self._store.append(stream_id, events, **kw)


STARTED = "conversation.turn_started"


class _StartOutage:
    """The store, except that the first `failures` appends of a turn's start (of its
    answer, with `of=COMPLETED`) fail as an outage would: with `landed`, after the real
    append committed (the answer was lost on its way back), else before writing anything."""

    def __init__(
        self,
        store: PostgresEventStore,
        *,
        landed: bool,
        failures: int = 1,
        failure: StoreUnavailable | None = None,
        delay_s: float = 0.0,
        of: str = STARTED,
    ) -> None:
        self._store = store
        self.of = of
        self.landed = landed
        self.failures = failures
        self.failure = failure or StoreUnavailable("the connection was lost")
        self.delay_s = delay_s
        self.attempts = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def append(self, stream_id: str, events: Sequence[NewEvent], **kw: Any) -> Any:
        if not any(e.type == self.of for e in events):
            return await self._store.append(stream_id, events, **kw)
        self.attempts += 1
        if self.attempts > self.failures:
            return await self._store.append(stream_id, events, **kw)
        if self.landed:
            await self._store.append(stream_id, events, **kw)
        await asyncio.sleep(self.delay_s)
        raise self.failure


@pytest.mark.parametrize("landed", [True, False])
async def test_a_turn_whose_start_the_store_failed_is_sent_again_and_runs_once(
    store: PostgresEventStore, landed: bool
) -> None:
    """The start's append failed with its outcome unknown. Sent again with the same id, it
    either writes the start or finds its own already written: either way the model is
    called once and the turn completes, rather than reading as running until it is
    abandoned (its key answered 409 meanwhile, then 502 `turn_abandoned`)."""
    outage, provider = _StartOutage(store, landed=landed), ScriptedProvider()
    table = ActivationTable(cast(Any, outage), [ConversationBehaviour([provider])])
    await table.start()
    try:
        cid = uuid.uuid4().hex
        command = run_turn()
        result = await table.submit(conversation_key(cid), command).last()
        assert isinstance(result, TurnResult) and result.turn_id == command.turn_id
        assert outage.attempts == 2 and provider.calls == 1
        types = await types_of(store, cid)
        assert types.count(STARTED) == 1 and types.count(COMPLETED) == 1
        # A retry of the request with the same id is answered from the record.
        again = await table.submit(conversation_key(cid), command).last()
        assert isinstance(again, TurnResult) and again.duplicate and provider.calls == 1
        assert (again.message_id, again.content) == (result.message_id, result.content)
    finally:
        await table.stop()


@pytest.mark.parametrize(("landed", "failures"), [(True, 1), (False, 1), (True, 100)])
async def test_an_answer_whose_record_the_store_lost_is_answered_not_failed(
    store: PostgresEventStore, landed: bool, failures: int
) -> None:
    """The answer's append failed with its outcome unknown. Sent again, it is written, or
    found written; and an answer found committed when every try failed is still the
    answer. A 503 for it would have the client (the SDKs, on their own) ask and pay again."""
    outage = _StartOutage(store, landed=landed, failures=failures, of=COMPLETED)
    provider = ScriptedProvider()
    table = ActivationTable(cast(Any, outage), [ConversationBehaviour([provider])])
    await table.start()
    try:
        cid = uuid.uuid4().hex
        result = await table.submit(conversation_key(cid), run_turn()).last()
        assert isinstance(result, TurnResult) and result.content and provider.calls == 1
        assert result.cursor  # read-your-writes, as for any answer this call recorded
        types = await types_of(store, cid)
        assert types.count(COMPLETED) == 1 and "conversation.turn_failed" not in types
    finally:
        await table.stop()


@pytest.mark.parametrize(
    ("failure", "tries"),
    [
        (StoreUnavailable("the connection was lost"), 4),
        # Rolled back, its outcome known: the client's 503 at once, not tried again.
        (StatementAborted("canceling statement due to lock timeout"), 1),
    ],
)
async def test_a_start_the_store_keeps_failing_is_the_clients_503_with_no_model_call(
    store: PostgresEventStore, failure: StoreUnavailable, tries: int
) -> None:
    outage = _StartOutage(store, landed=False, failures=100, failure=failure)
    provider = ScriptedProvider()
    table = ActivationTable(cast(Any, outage), [ConversationBehaviour([provider])])
    await table.start()
    try:
        cid = uuid.uuid4().hex
        with pytest.raises(type(failure)):
            await table.submit(conversation_key(cid), run_turn()).last()
        assert outage.attempts == tries and provider.calls == 0
        assert await types_of(store, cid) == []
    finally:
        await table.stop()


class _RetryStartsElsewhere(_StartOutage):
    """The first append of a turn's start fails before writing; meanwhile a retry of the
    same request on another process (same command id, its own start time) writes its
    start, and its model call is under way there."""

    async def append(self, stream_id: str, events: Sequence[NewEvent], **kw: Any) -> Any:
        if self.attempts == 0 and any(e.type == STARTED for e in events):
            self.attempts += 1
            later = datetime.now(UTC).isoformat()
            theirs = [
                NewEvent(
                    e.type,
                    {**e.data, "at": later} if e.type == STARTED else e.data,
                    e.schema_version,
                    e.metadata,
                )
                for e in events
            ]
            await self._store.append(stream_id, theirs, **kw)
            raise StoreUnavailable("the connection was lost")
        return await self._store.append(stream_id, events, **kw)


async def test_no_try_of_the_start_begins_past_its_deadline(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow failures (a driver timeout arrives after the statement timeout and more) are
    not tried again past the deadline: the client's 503 comes without further waits."""
    monkeypatch.setattr(conversation_module, "RESEND_DEADLINE_S", 1.0)
    outage = _StartOutage(store, landed=False, failures=100, delay_s=0.4)
    provider = ScriptedProvider()
    table = ActivationTable(cast(Any, outage), [ConversationBehaviour([provider])])
    await table.start()
    try:
        with pytest.raises(StoreUnavailable):
            await table.submit(conversation_key(uuid.uuid4().hex), run_turn()).last()
        # The first failed at 0.4 s; the second began at 0.45 s and failed at 0.85 s; a
        # third would begin at 1.05 s at the earliest, past the deadline. (The second still
        # begins if the first's failure comes up to 0.55 s late, on a loaded host.)
        assert outage.attempts == 2 and provider.calls == 0
    finally:
        await table.stop()


async def test_a_start_another_process_recorded_meanwhile_is_not_run_twice(
    store: PostgresEventStore,
) -> None:
    """Sent again, the start finds one recorded under its command id that is not its own
    (another `at`): it answers as any retry of a running turn does, 409
    `turn_in_progress`, and never calls the model."""
    outage, provider = _RetryStartsElsewhere(store, landed=False), ScriptedProvider()
    table = ActivationTable(cast(Any, outage), [ConversationBehaviour([provider])])
    await table.start()
    try:
        cid = uuid.uuid4().hex
        with pytest.raises(Conflict) as refused:
            await table.submit(conversation_key(cid), run_turn()).last()
        assert refused.value.code == "turn_in_progress" and provider.calls == 0
        assert (await types_of(store, cid)).count(STARTED) == 1
    finally:
        await table.stop()


async def test_a_completion_the_store_never_takes_leaves_the_turn_failed(
    store: PostgresEventStore,
) -> None:
    """The model answered but recording the answer failed, sent again while the store
    lost it: the turn is recorded as failed then (retryable), not left running until its
    expiry makes it `turn_abandoned`."""
    outage = _CompletionOutage(store)
    failed = await _last_event_of_a_failed_turn(
        store, ActivationTable(cast(Any, outage), [ConversationBehaviour([ScriptedProvider()])])
    )
    assert outage.refused == 1 + len(conversation_module.RESEND_WAITS_S)
    assert failed.type == "conversation.turn_failed"
    assert (failed.data["error_code"], failed.data["retryable"]) == ("store_unavailable", True)


async def test_a_turn_cut_by_a_cancelled_operation_is_a_500_replayed_alike(
    store: PostgresEventStore,
) -> None:
    """A CancelledError the turn met in something it awaited, not a stop of the runtime: the
    table answers 500, and the record said `interrupted`, so the same key answered 503."""
    provider = ScriptedProvider(fail_after=1, failure=cast(Any, asyncio.CancelledError()))
    table = ActivationTable(store, [ConversationBehaviour([provider])])
    await table.start()
    try:
        key, command = conversation_key(uuid.uuid4().hex), run_turn()
        with pytest.raises(SvcError) as first:
            await table.submit(key, command).last()
        assert first.value.http_status == 500
        failed = (await store.read_stream(key.stream_id))[-1]
        assert failed.data["error_code"] == "internal_error", failed.data
        with pytest.raises(RecordedTurnFailure) as replayed:
            await table.submit(key, command).last()
        assert replayed.value.http_status == 500
    finally:
        await table.stop()


async def test_an_internal_failure_is_recorded_and_replayed_without_its_detail(
    store: PostgresEventStore,
) -> None:
    """A failed store query's message names database detail: the turn's record, which
    operators read and a retry with the same key is answered with, holds the generic one."""
    detail = "event store query failed (42501 InsufficientPrivilegeError: on table events)"
    outage = _CompletionOutage(store, StoreError(detail))
    table = ActivationTable(cast(Any, outage), [ConversationBehaviour([ScriptedProvider()])])
    await table.start()
    try:
        key, command = conversation_key(uuid.uuid4().hex), run_turn()
        with pytest.raises(StoreError):
            await table.submit(key, command).last()
        failed = (await store.read_stream(key.stream_id))[-1]
        assert failed.type == "conversation.turn_failed"
        assert failed.data["error_code"] == "internal_error"
        assert failed.data["error_message"] == "internal error while running the turn"
        with pytest.raises(RecordedTurnFailure) as replayed:
            await table.submit(key, command).last()
        assert replayed.value.http_status == 500 and "42501" not in replayed.value.message
    finally:
        await table.stop()


@pytest.mark.parametrize(
    ("message", "code", "recorded"),
    [("bad\x00request", "upstream_error", "badrequest"), ("cut \ud83d", "x\udc00", "cut ?")],
)
async def test_a_failure_whose_message_the_log_cannot_hold_is_still_recorded(
    store: PostgresEventStore, message: str, code: str, recorded: str
) -> None:
    """An upstream error with a NUL or a lone surrogate in its message or code: the turn is
    recorded as failed (without them), not left running because the store refused the
    record of its failure."""
    failure = UpstreamError(message, code=code)
    provider = ScriptedProvider(fail_after=1, failure=failure)
    failed = await _last_event_of_a_failed_turn(
        store, ActivationTable(store, [ConversationBehaviour([provider])])
    )
    assert failed.type == "conversation.turn_failed"
    assert failed.data["error_message"] == recorded
    assert failed.data["error_code"] == code.replace("\udc00", "?")


async def test_a_retry_of_a_turn_past_the_held_window_is_answered_from_the_log(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """QA finding: the state holds the last RECENT_TURNS turns' outcomes, counted in turns,
    so on a busy conversation a resend queued behind a few dozen turns (a slow turn's, a
    cut stream's) found its turn gone within a second and was refused with 409
    `idempotency_key_expired`. It is answered from the log, as any retry is."""
    provider = ScriptedProvider()
    runtime = await make_runtime([ConversationBehaviour([provider])])
    key = conversation_key(uuid.uuid4().hex)
    digest = {"body_digest": "d" * 32}
    first = await runtime.ask(key, run_turn(command_id="old-key").model_copy(update=digest))
    for n in range(conversation_module.RECENT_TURNS + 2):
        await runtime.ask(key, run_turn(f"and then {n}"))
    recorded = len(await store.read_stream(key.stream_id))
    refolded = ScriptedProvider()
    fresh = await make_runtime([ConversationBehaviour([refolded])])
    for host in (runtime, fresh):  # the active state, and one folded again from the log
        again = await host.ask(key, run_turn(command_id="old-key").model_copy(update=digest))
        assert isinstance(first, TurnResult) and isinstance(again, TurnResult)
        assert again.duplicate
        assert (again.turn_id, again.message_id, again.content, again.usage) == (
            first.turn_id,
            first.message_id,
            first.content,
            first.usage,
        )
        other = run_turn(command_id="old-key").model_copy(update={"body_digest": "e" * 32})
        with pytest.raises(Conflict) as refused:
            await host.ask(key, other)
        assert refused.value.code == "idempotency_key_reused"
    assert len(await store.read_stream(key.stream_id)) == recorded
    if isinstance(runtime, LocalRuntime):  # under Ray the providers run in the hosts
        assert (provider.calls, refolded.calls) == (conversation_module.RECENT_TURNS + 3, 0)

    failing = ScriptedProvider(fail_after=0, failure=UpstreamTimeout("over the 3s budget"))
    runtime = await make_runtime([ConversationBehaviour([failing])])
    key = conversation_key(uuid.uuid4().hex)
    with pytest.raises(UpstreamTimeout):
        await runtime.ask(key, run_turn(command_id="failed-key"))
    for n in range(conversation_module.RECENT_TURNS + 2):
        with pytest.raises(UpstreamTimeout):
            await runtime.ask(key, run_turn(f"and then {n}"))
    with pytest.raises(RecordedTurnFailure) as failed:
        await runtime.ask(key, run_turn(command_id="failed-key"))
    assert failed.value.code == "ErrCallTimeout" and "over the 3s budget" in failed.value.message
