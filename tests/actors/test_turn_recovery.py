"""Turns of a dead incarnation: recorded as abandoned by the next activation, never rerun.

A "dead incarnation" is a table that appended UserMessageReceived + TurnStarted and then never
recorded the turn's end: its provider is held at a gate, and a second table on the same store
plays the process that took over. Releasing the gate at the end shows the stale writer losing
at the store's version fence.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest
from actor_doubles import MakeRuntime, RuntimeUnderTest, ScriptedProvider, answer
from test_conversation_turns import eventually_recorded, run_turn, types_of

from actors import ConversationBehaviour, RecordedTurnFailure, TurnResult, conversation_key
from actors.conversation import ABANDONED, TURN_MARGIN_S, ConversationState, expired_turns
from actors.errors import TurnInProgress, UpstreamError
from actors.models.port import Finished, ModelEvent, ModelRequest, TextDelta, Usage
from eventstore import PostgresEventStore
from schemas.conversation import (
    RecoverAbandonedTurns,
    RenameConversation,
    RunTurn,
    TurnFailed,
    TurnParams,
    TurnStarted,
)
from schemas.errors import Conflict, NotFound

WS = "ws-1"
STARTED = "conversation.turn_started"
FAILED = "conversation.turn_failed"


class GatedProvider:
    """Serves "scripted"; sends one delta, then waits for `gate` before finishing: a model
    call that is still in flight when its process is given up for dead."""

    name = "gated"

    def __init__(self, fails: bool = False) -> None:
        self.gate = asyncio.Event()
        self.calls = 0
        self.fails = fails

    def serves(self, model: str) -> bool:
        return model == "scripted"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.calls += 1
        yield TextDelta("partial")
        await self.gate.wait()
        if self.fails:
            raise UpstreamError("the model server answered 500")
        yield Finished("stop", Usage(prompt_tokens=1, completion_tokens=1))


async def dead_incarnation(
    make_runtime: MakeRuntime,
    store: PostgresEventStore,
    cid: str,
    command: RunTurn,
    clock: Callable[[], datetime] | None = None,
    budget_s: float | None = None,
    fails: bool = False,
) -> tuple[GatedProvider, asyncio.Task[object]]:
    """A table that started `command`'s turn (at `clock()`, under the call budget `budget_s`;
    None: a lifetime of zero) and will not finish it until the gate opens (then failing, if
    `fails`)."""
    gated = GatedProvider(fails)
    behaviour = ConversationBehaviour([gated], clock=clock or _now, call_budget_s=_budget(budget_s))
    old = await make_runtime([behaviour])
    task: asyncio.Task[object] = asyncio.create_task(old.ask(conversation_key(cid), command))
    await eventually_recorded(store, cid, STARTED)
    return gated, task


async def fresh_table(make_runtime: MakeRuntime) -> tuple[RuntimeUnderTest, ScriptedProvider]:
    provider = ScriptedProvider()
    return await make_runtime([ConversationBehaviour([provider])]), provider


async def test_retry_after_a_dead_incarnation_gets_the_recorded_failure(
    make_runtime: MakeRuntime, store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    cid = uuid.uuid4().hex
    command = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, old_task = await dead_incarnation(make_runtime, store, cid, command)
    runtime, provider = await fresh_table(make_runtime)

    with pytest.raises(RecordedTurnFailure) as raised:
        await runtime.ask(conversation_key(cid), command)
    assert raised.value.code == ABANDONED
    assert provider.calls == 0
    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert [r.type for r in recorded][-2:] == [STARTED, FAILED]
    failed = recorded[-1].data
    assert (failed["turn_id"], failed["error_code"], failed["retryable"]) == (
        command.turn_id,
        ABANDONED,
        True,
    )

    # Asked again (and streamed): the same recorded failure, still no model call.
    with pytest.raises(RecordedTurnFailure):
        async for _ in runtime.stream(conversation_key(cid), command):
            pass
    assert provider.calls == 0

    # The old incarnation was alive after all: its answer loses at the version fence. Its
    # caller is told what became of the turn and what to do (QA finding: "turn ... already
    # ended (failed)", a 409, and an ERROR with a traceback in the log).
    gated.gate.set()
    with pytest.raises(RecordedTurnFailure) as lost:
        await old_task
    assert lost.value.code == ABANDONED and "new Idempotency-Key" in lost.value.message
    assert (await types_of(store, cid))[-1] == FAILED
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_a_turn_abandoned_while_its_model_call_fails_is_told_so_without_an_error_logged(
    make_runtime: MakeRuntime, store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """QA finding: the failure could not be recorded over the abandonment, and the log got
    an ERROR with a traceback for what the docs call the expected outcome."""
    cid = uuid.uuid4().hex
    command = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, old_task = await dead_incarnation(make_runtime, store, cid, command, fails=True)
    runtime, _ = await fresh_table(make_runtime)
    with pytest.raises(RecordedTurnFailure):
        await runtime.ask(conversation_key(cid), command)  # records it abandoned

    gated.gate.set()
    with pytest.raises(RecordedTurnFailure) as lost:
        await old_task
    assert lost.value.code == ABANDONED and "not recorded" in lost.value.message
    assert (await types_of(store, cid)).count(FAILED) == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "recorded as failed (turn_abandoned) by another process" in caplog.text


async def test_the_next_command_sees_the_turn_failed_and_a_new_key_runs_a_new_turn(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    cid = uuid.uuid4().hex
    gated, old_task = await dead_incarnation(make_runtime, store, cid, run_turn())
    runtime, provider = await fresh_table(make_runtime)

    rename = RenameConversation(
        command_id=uuid.uuid4().hex, workspace_id=WS, title="after the crash", at=_now()
    )
    await runtime.ask(conversation_key(cid), rename)
    assert (await types_of(store, cid))[-3:] == [STARTED, FAILED, "conversation.renamed"]

    result = await runtime.ask(conversation_key(cid), run_turn("again"))
    assert isinstance(result, TurnResult) and result.content == answer(provider, 1)
    assert (await types_of(store, cid))[-1] == "conversation.assistant_message_completed"

    gated.gate.set()
    with pytest.raises(RecordedTurnFailure, match="not recorded"):
        await old_task


async def test_a_later_activation_still_answers_the_retry_from_the_log(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    cid = uuid.uuid4().hex
    command = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, old_task = await dead_incarnation(make_runtime, store, cid, command)
    second, _ = await fresh_table(make_runtime)
    rename = RenameConversation(command_id=uuid.uuid4().hex, workspace_id=WS, title="t", at=_now())
    await second.ask(conversation_key(cid), rename)
    await second.stop(deadline_s=5.0)

    third, provider = await fresh_table(make_runtime)
    with pytest.raises(RecordedTurnFailure) as raised:
        await third.ask(conversation_key(cid), command)
    assert raised.value.code == ABANDONED and provider.calls == 0
    # Recovered once: the turn failed exactly one time in the log.
    assert (await types_of(store, cid)).count(FAILED) == 1

    gated.gate.set()
    with pytest.raises(RecordedTurnFailure):
        await old_task


async def test_a_conversation_without_running_turns_records_nothing_extra(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    cid = uuid.uuid4().hex
    await runtime.ask(conversation_key(cid), run_turn())
    await runtime.ask(conversation_key(cid), run_turn("second"))
    assert FAILED not in await types_of(store, cid)


# --- the pure core -----------------------------------------------------------------------------


def _now() -> datetime:
    return datetime.now(UTC)


def running_turns(state: ConversationState) -> tuple[str, ...]:
    return tuple(t.turn_id for t in state.turns.values() if t.status == "running")


def _state_with_running_turn(
    behaviour: ConversationBehaviour, command: RunTurn
) -> ConversationState:
    state = behaviour.initial_state(conversation_key("c1"))
    for event in behaviour.decide(state, command):
        state = behaviour.evolve(state, event)
    return state


def test_recover_fails_only_the_running_turns_it_names() -> None:
    behaviour = ConversationBehaviour()
    command = run_turn()
    state = _state_with_running_turn(behaviour, command)
    assert running_turns(state) == (command.turn_id,)
    later = command.at + timedelta(seconds=2)
    recover = RecoverAbandonedTurns(
        command_id="r1", workspace_id=WS, turn_ids=(command.turn_id, "unknown"), at=later
    )

    events = behaviour.decide(state, recover)

    assert len(events) == 1 and isinstance(events[0], TurnFailed)
    failed = events[0]
    assert (failed.error_code, failed.retryable, failed.duration_ms, failed.at) == (
        ABANDONED,
        True,
        2000,
        later,
    )
    state = behaviour.evolve(state, failed)
    assert running_turns(state) == ()
    assert state.turns[command.turn_id].error_code == ABANDONED
    assert behaviour.decide(state, recover) == []


BUDGET_S = 60.0
LIFETIME = timedelta(seconds=BUDGET_S + TURN_MARGIN_S)


def _budget(budget_s: float | None) -> Callable[[], float] | None:
    return None if budget_s is None else lambda: budget_s


def with_budget(budget_s: float | None, provider: ScriptedProvider) -> ConversationBehaviour:
    return ConversationBehaviour([provider], call_budget_s=_budget(budget_s))


async def test_a_turn_another_process_is_still_running_is_left_to_it(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """Two gateways with the local runtime on one database: a turn the other one started
    less than a turn's lifetime ago is in progress, not abandoned. A retry with its key is
    `turn_in_progress`, other commands go on, and its answer is recorded when it comes."""
    cid = uuid.uuid4().hex
    command = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, first = await dead_incarnation(make_runtime, store, cid, command, budget_s=BUDGET_S)
    provider = ScriptedProvider()
    other = await make_runtime([with_budget(BUDGET_S, provider)])

    with pytest.raises(Conflict) as raised:
        await other.ask(conversation_key(cid), command)
    assert raised.value.code == "turn_in_progress" and provider.calls == 0
    # QA finding: it said "retry shortly", where the turn's end may only come at its expiry
    # (its process gone): the message names that time, and what a retry then gets.
    expiry = re.search(r"if it has not finished by (\S+) ", raised.value.message)
    assert expiry is not None and "turn_abandoned" in raised.value.message
    assert datetime.fromisoformat(expiry.group(1)) > datetime.now(UTC)
    rename = RenameConversation(
        command_id=uuid.uuid4().hex, workspace_id=WS, title="meanwhile", at=_now()
    )
    await other.ask(conversation_key(cid), rename)
    assert FAILED not in await types_of(store, cid)

    gated.gate.set()
    result = await first
    assert isinstance(result, TurnResult) and result.turn_id == command.turn_id
    assert (await types_of(store, cid))[-1] == "conversation.assistant_message_completed"

    # The other process's cached state still says "running": the retry reads the stream
    # again and gets the recorded answer, not turn_in_progress until the lifetime is over.
    again = await other.ask(conversation_key(cid), command)
    assert isinstance(again, TurnResult) and again.content == result.content
    assert provider.calls == 0


async def test_a_running_turn_older_than_its_lifetime_is_abandoned(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    cid = uuid.uuid4().hex
    started_long_ago = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, first = await dead_incarnation(
        make_runtime,
        store,
        cid,
        started_long_ago,
        clock=lambda: _now() - 2 * LIFETIME,
        budget_s=BUDGET_S,
    )
    other = await make_runtime([with_budget(BUDGET_S, ScriptedProvider())])
    with pytest.raises(RecordedTurnFailure) as raised:
        await other.ask(conversation_key(cid), started_long_ago)
    assert raised.value.code == ABANDONED
    gated.gate.set()
    with pytest.raises(RecordedTurnFailure):
        await first


async def test_a_turn_asked_for_long_ago_is_as_old_as_its_start(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """A turn that waited behind others before it started (its request older than a turn's
    lifetime) is stamped when it starts: another process does not take it for abandoned."""
    cid = uuid.uuid4().hex
    asked_long_ago = run_turn().model_copy(update={"at": _now() - 2 * LIFETIME})
    gated, first = await dead_incarnation(
        make_runtime, store, cid, asked_long_ago, budget_s=BUDGET_S
    )
    other = await make_runtime([with_budget(BUDGET_S, ScriptedProvider())])
    rename = RenameConversation(
        command_id=uuid.uuid4().hex, workspace_id=WS, title="meanwhile", at=_now()
    )
    await other.ask(conversation_key(cid), rename)
    assert FAILED not in await types_of(store, cid)
    gated.gate.set()
    assert isinstance(await first, TurnResult)


async def test_a_turn_is_judged_by_the_budget_it_started_with_not_a_lowered_one(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """The call budget is lowered while a turn runs under the old one: another process
    leaves the turn to its owner until the turn's own lifetime is over."""
    cid = uuid.uuid4().hex
    command = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, first = await dead_incarnation(make_runtime, store, cid, command, budget_s=BUDGET_S)
    provider = ScriptedProvider()
    lowered = await make_runtime([with_budget(None, provider)])
    with pytest.raises(Conflict) as raised:
        await lowered.ask(conversation_key(cid), command)
    assert raised.value.code == "turn_in_progress" and provider.calls == 0
    assert FAILED not in await types_of(store, cid)

    gated.gate.set()
    assert isinstance(await first, TurnResult)
    assert (await types_of(store, cid))[-1] == "conversation.assistant_message_completed"


async def test_a_turn_whose_call_had_no_time_limit_is_never_abandoned(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """A turn started while calls had no time limit records that it never expires: a budget
    set since does not make it abandoned, however old it is."""
    cid = uuid.uuid4().hex
    command = run_turn(command_id=f"key-{uuid.uuid4().hex}")
    gated, first = await dead_incarnation(
        make_runtime, store, cid, command, clock=lambda: _now() - 2 * LIFETIME, budget_s=0.0
    )
    recorded = await store.read_stream(conversation_key(cid).stream_id)
    assert recorded[-1].type == STARTED
    assert recorded[-1].data.get("expires_at") is None and recorded[-1].data["never_expires"]
    provider = ScriptedProvider()
    other = await make_runtime([with_budget(BUDGET_S, provider)])
    with pytest.raises(Conflict) as raised:
        await other.ask(conversation_key(cid), command)
    assert raised.value.code == "turn_in_progress" and provider.calls == 0
    gated.gate.set()
    assert isinstance(await first, TurnResult)


def test_a_turn_recorded_before_turns_carried_an_expiry_is_judged_by_the_budget_now() -> None:
    behaviour = ConversationBehaviour()
    state = behaviour.initial_state(conversation_key("c1"))
    started = TurnStarted(
        conversation_id="c1",
        turn_id="t1",
        command_id="k1",
        model="scripted",
        params=TurnParams(),
        request_messages=1,
        at=_now() - 2 * LIFETIME,
    )
    state = behaviour.evolve(state, started)
    assert expired_turns(state, _now(), 3 * LIFETIME) == ()
    assert expired_turns(state, _now(), LIFETIME) == ("t1",)
    assert expired_turns(state, _now(), None) == ()
    recover = RecoverAbandonedTurns(command_id="r1", workspace_id=WS, turn_ids=("t1",), at=_now())
    [failed] = behaviour.decide(state, recover)
    assert isinstance(failed, TurnFailed) and failed.error_code == ABANDONED

    # Abandoned a month ago: a duration the read models' integers hold, not the month.
    month_later = recover.model_copy(update={"at": _now() + timedelta(days=30)})
    [failed] = behaviour.decide(state, month_later)
    assert isinstance(failed, TurnFailed) and failed.duration_ms == 2**31 - 1

    # Another workspace's command recovers nothing here: the conversation is not its own.
    owned = state.model_copy(update={"started_by": "cmd-start", "workspace_id": WS})
    assert behaviour.decide(owned, recover)
    with pytest.raises(NotFound):
        behaviour.decide(owned, recover.model_copy(update={"workspace_id": "ws-other"}))


async def test_a_turns_call_gets_the_budget_its_expiry_was_recorded_by(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    """The budget is a live setting, here one that changes on every read: the call and the
    recorded expiry still agree, as both come from one read."""
    reads = iter(range(10, 100, 10))
    provider = ScriptedProvider()
    runtime = await make_runtime(
        [ConversationBehaviour([provider], call_budget_s=lambda: float(next(reads)))]
    )
    cid = uuid.uuid4().hex
    await runtime.ask(conversation_key(cid), run_turn())
    await runtime.ask(conversation_key(cid), run_turn())

    started = [
        TurnStarted.model_validate(r.data)
        for r in await store.read_stream(conversation_key(cid).stream_id)
        if r.type == STARTED
    ]
    budgets = [r.call_timeout_s for r in provider.requests]
    assert len(budgets) == 2
    for turn, budget in zip(started, budgets, strict=True):
        assert budget is not None and turn.expires_at is not None and not turn.never_expires
        assert turn.expires_at - turn.at == timedelta(seconds=budget + TURN_MARGIN_S)


def test_recover_leaves_a_turn_whose_recorded_expiry_is_still_ahead() -> None:
    """The sweep names turns by their age under the budget in force now; a turn whose own
    expiry is later is left running until then."""
    behaviour = ConversationBehaviour()
    command = run_turn().model_copy(update={"expires_at": _now() + LIFETIME})
    state = _state_with_running_turn(behaviour, command)
    assert command.expires_at is not None
    early = command.expires_at - timedelta(seconds=1)
    late = command.expires_at + timedelta(seconds=1)
    assert expired_turns(state, early, timedelta(0)) == ()
    assert expired_turns(state, late, None) == (command.turn_id,)

    def recover(at: datetime) -> RecoverAbandonedTurns:
        return RecoverAbandonedTurns(
            command_id="r1", workspace_id=WS, turn_ids=(command.turn_id,), at=at
        )

    assert behaviour.decide(state, recover(early)) == []
    [failed] = behaviour.decide(state, recover(late))
    assert isinstance(failed, TurnFailed) and failed.error_code == ABANDONED


def test_a_turn_never_given_up_names_what_ends_it() -> None:
    """Review finding: with no call time limit a turn is never recorded as abandoned, and
    "retry to get its answer or its failure" would have a client loop for ever."""
    in_progress = TurnInProgress.of("t1", "c1", "ws-9", None, never_expires=True)
    for message in (in_progress.message, in_progress.unkeyed()):
        assert "never given up by itself" in message
        assert "svc conversations abandon --workspace ws-9 c1" in message
    # One recorded before turns carried their expiry is given up as any other (review
    # finding: it was told never to be).
    older = TurnInProgress.of("t1", "c1", "ws-9", None)
    for message in (older.message, older.unkeyed()):
        assert "never given up" not in message
        assert "SVC_LLM_CALL_TIMEOUT_S plus a minute after its start" in message
