"""The pure cores of the conversation, workspace and agent kinds: decide and evolve only."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel, ValidationError

from actors import (
    AgentBehaviour,
    AgentState,
    Behaviour,
    ConversationBehaviour,
    ConversationState,
    WorkspaceBehaviour,
    WorkspaceState,
    agent_key,
    conversation_key,
    workspace_key,
)
from actors.conversation import MAX_TURN_INPUTS
from schemas.agent import (
    AgentArchived,
    AgentParameters,
    ArchiveAgent,
    ChangeAgentModel,
    ChangeAgentParameters,
    CreateAgent,
    UpdateAgentProfile,
)
from schemas.commands import Command
from schemas.conversation import (
    CompleteTurn,
    ConversationDeleted,
    ConversationTagged,
    DeleteConversation,
    FailTurn,
    Message,
    MoveConversationToFolder,
    RenameConversation,
    RunTurn,
    StartConversation,
    TagConversation,
    ToolOutputReceived,
    TurnFailed,
    UserMessageReceived,
)
from schemas.errors import Conflict, InvalidInput, NotFound
from schemas.events import EVENTS, Event
from schemas.workspace import (
    ApiKeyRevoked,
    ChangeWorkspaceSetting,
    CreateWorkspace,
    IssueApiKey,
    RevokeApiKey,
)

WS = "ws-1"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
S = TypeVar("S", bound=BaseModel)
C = TypeVar("C", bound=Command)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def apply(behaviour: Behaviour[S], state: S, command: Command) -> tuple[S, Sequence[Event]]:
    events = behaviour.decide(state, command)
    for e in events:
        # Every event survives the store's encoding unchanged.
        assert EVENTS.decode(*EVENTS.encode(e)) == e
        state = behaviour.evolve(state, e)
    return state, events


def run(behaviour: Behaviour[S], state: S, *commands: Command) -> S:
    for c in commands:
        state, _ = apply(behaviour, state, c)
    return state


def cmd(cls: type[C], n: int, **fields: Any) -> C:
    return cls(command_id=f"c{n}", workspace_id=fields.pop("workspace_id", WS), **fields)


# --- conversation ---------------------------------------------------------------------------

conv = ConversationBehaviour()


def fresh_conversation() -> ConversationState:
    return conv.initial_state(conversation_key("c-1"))


def turn(n: int, text: str = "hello") -> RunTurn:
    return cmd(
        RunTurn,
        n,
        turn_id=f"t{n}",
        message_id=f"m{n}",
        model="m",
        messages=(Message(role="user", content=text),),
        at=at(n),
    )


def complete(n: int, content: str = "answer") -> CompleteTurn:
    return cmd(
        CompleteTurn,
        100 + n,
        turn_id=f"t{n}",
        message_id=f"a{n}",
        content=content,
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=2,
        duration_ms=10,
        at=at(n),
    )


def test_first_turn_starts_the_conversation() -> None:
    state, events = apply(conv, fresh_conversation(), turn(1, "  What is\nSVC?  "))
    assert [type(e).__name__ for e in events] == [
        "ConversationStarted",
        "UserMessageReceived",
        "TurnStarted",
    ]
    assert state.exists and state.workspace_id == WS
    assert state.title == "What is SVC?"
    assert state.turns["t1"].status == "running"
    assert state.turn_by_command == {"c1": "t1"}
    assert (state.created_at, state.updated_at, state.message_count) == (at(1), at(1), 1)


def said(events: Sequence[Event]) -> list[tuple[str, str, str, str | None]]:
    """A turn's recorded input: (event type, message id, content, name) of each message."""
    inputs = (e for e in events if isinstance(e, UserMessageReceived | ToolOutputReceived))
    return [(e.type_name, e.message_id, e.content, e.name) for e in inputs]


def test_a_turn_records_what_was_said_since_the_last_answer() -> None:
    """Review finding: only the newest user message was recorded, so a turn whose input
    ended with a tool's output recorded the user's question of the turn before again, and a
    tool output was never recorded at all."""
    state = run(conv, fresh_conversation(), turn(1, "look it up"), complete(1, "searching"))
    history = (
        Message(role="user", content="look it up"),
        Message(role="assistant", content="searching"),
        Message(role="tool", content="3 results", name="search"),
    )
    tool_turn = turn(2).model_copy(update={"messages": history})
    state, events = apply(conv, state, tool_turn)
    user, tool = UserMessageReceived.type_name, ToolOutputReceived.type_name
    assert said(events) == [(tool, "m2", "3 results", "search")]
    assert state.message_count == 3
    # Several things said since the last answer are each recorded, oldest first; the newest
    # keeps the command's message id. What the system says is not said by anyone.
    more = (
        *history,
        Message(role="assistant", content="found them"),
        Message(role="user", content="a", name="ann"),
        Message(role="system", content="be brief"),
        Message(role="tool", content="b"),
        Message(role="user", content="c"),
    )
    state = run(conv, state, complete(2))
    state, events = apply(conv, state, turn(3).model_copy(update={"messages": more}))
    assert said(events) == [
        (user, "m3.2", "a", "ann"),
        (tool, "m3.1", "b", None),
        (user, "m3", "c", None),
    ]
    assert state.message_count == 7
    # A history of nothing but user messages records the newest of them, a bounded number.
    flood = tuple(Message(role="user", content=str(n)) for n in range(MAX_TURN_INPUTS + 5))
    _, events = apply(conv, fresh_conversation(), turn(9).model_copy(update={"messages": flood}))
    recorded = said(events)
    assert len(recorded) == MAX_TURN_INPUTS
    assert recorded[0][1:3] == (f"m9.{MAX_TURN_INPUTS - 1}", "5")
    assert recorded[-1][1:3] == ("m9", str(MAX_TURN_INPUTS + 4))
    # A history ending with an answer (asking the model to go on) says nothing new.
    go_on = (*more, Message(role="assistant", content="partial"))
    state = run(conv, state, complete(3))
    _, events = apply(conv, state, turn(4).model_copy(update={"messages": go_on}))
    assert said(events) == []
    assert [type(e).__name__ for e in events] == ["TurnStarted"]


def fail_turn(n: int) -> FailTurn:
    return cmd(
        FailTurn,
        200 + n,
        turn_id=f"t{n}",
        error_code="upstream_error",
        error_message="the model server answered 502",
        duration_ms=5,
        retryable=True,
        at=at(n),
    )


def with_history(n: int, *messages: tuple[str, str]) -> RunTurn:
    history = tuple(Message.model_validate({"role": r, "content": t}) for r, t in messages)
    return turn(n).model_copy(update={"messages": history})


def test_a_failed_turns_input_sent_again_is_not_recorded_twice() -> None:
    """Review finding: a turn that failed recorded its input and answered nothing, so the
    next turn, whose history holds that input again, recorded it a second time."""
    user = UserMessageReceived.type_name
    state = run(conv, fresh_conversation(), turn(1, "hello"), fail_turn(1))
    state, events = apply(conv, state, with_history(2, ("user", "hello"), ("user", "there?")))
    assert said(events) == [(user, "m2", "there?", None)]
    state = run(conv, state, fail_turn(2))
    # The same request again (an SDK's retry of a 5xx, a new command): nothing new was said.
    again = with_history(3, ("user", "hello"), ("user", "there?"))
    state, events = apply(conv, state, again)
    assert said(events) == []
    # One that left the first out of its history: the second is still the one recorded.
    state = run(conv, state, fail_turn(3))
    state, events = apply(conv, state, with_history(4, ("user", "there?"), ("user", "hello")))
    assert said(events) == [(user, "m4", "hello", None)]
    # Said twice on purpose, after a failure: recorded once more, not twice.
    state = run(conv, state, fail_turn(4))
    twice = with_history(5, ("user", "there?"), ("user", "hello"), ("user", "hello"))
    state, events = apply(conv, state, twice)
    assert said(events) == [(user, "m5", "hello", None)]
    # After an answer, the same words are new words.
    state = run(conv, state, complete(5))
    assert state.unanswered == ()
    answered = with_history(6, ("user", "hello"), ("assistant", "answer"), ("user", "hello"))
    _, events = apply(conv, state, answered)
    assert said(events) == [(user, "m6", "hello", None)]


def test_a_conversation_begun_with_a_history_records_a_question_and_names_it() -> None:
    """Review findings: a conversation begun with a history ending in an answer (an
    assistant prefill) recorded no one's words; one begun with two questions took its title
    from the second while it recorded both."""
    user = UserMessageReceived.type_name
    prefill = with_history(1, ("user", "Write a haiku"), ("assistant", "Autumn"))
    state, events = apply(conv, fresh_conversation(), prefill)
    assert said(events) == [(user, "m1", "Write a haiku", None)]
    assert state.title == "Write a haiku"
    two = with_history(1, ("user", "first question"), ("user", "second"))
    state, events = apply(conv, fresh_conversation(), two)
    assert [text for _, _, text, _ in said(events)] == ["first question", "second"]
    assert state.title == "first question"


def test_completed_turn_is_kept_for_idempotent_retries() -> None:
    state = run(conv, fresh_conversation(), turn(1), complete(1, "42"))
    record = state.turns["t1"]
    assert (record.status, record.content, record.prompt_tokens, record.completion_tokens) == (
        "completed",
        "42",
        3,
        2,
    )
    assert state.message_count == 2
    # The same RunTurn again decides nothing: the handler answers from the record.
    assert conv.decide(state, turn(1)) == []


def test_turn_can_end_only_once() -> None:
    state = run(conv, fresh_conversation(), turn(1), complete(1))
    with pytest.raises(Conflict, match="already ended"):
        conv.decide(state, complete(1))
    fail = cmd(
        FailTurn,
        9,
        turn_id="t9",
        error_code="x",
        error_message="y",
        duration_ms=1,
        retryable=False,
        at=at(9),
    )
    with pytest.raises(NotFound, match="turn t9 does not exist"):
        conv.decide(state, fail)


def test_failed_turn_is_recorded() -> None:
    fail = cmd(
        FailTurn,
        50,
        turn_id="t1",
        error_code="upstream_error",
        error_message="502",
        duration_ms=7,
        retryable=True,
        at=at(2),
    )
    state, events = apply(conv, run(conv, fresh_conversation(), turn(1)), fail)
    assert isinstance(events[0], TurnFailed)
    assert state.turns["t1"].status == "failed" and state.turns["t1"].retryable


def test_run_turn_needs_a_user_message() -> None:
    only_system = turn(1).model_copy(update={"messages": (Message(role="system", content="x"),)})
    with pytest.raises(InvalidInput, match="role 'user'"):
        conv.decide(fresh_conversation(), only_system)


def test_turn_id_cannot_be_reused() -> None:
    state = run(conv, fresh_conversation(), turn(1))
    reused = turn(2).model_copy(update={"turn_id": "t1"})
    with pytest.raises(Conflict, match="already used"):
        conv.decide(state, reused)


def test_rename_tag_move_and_unchanged_values() -> None:
    state = run(conv, fresh_conversation(), turn(1))
    state = run(
        conv,
        state,
        cmd(RenameConversation, 2, title="Plans", at=at(2)),
        cmd(TagConversation, 3, tags=("a", "b"), at=at(3)),
        cmd(MoveConversationToFolder, 4, folder="work", at=at(4)),
    )
    assert (state.title, state.tags, state.folder, state.updated_at) == (
        "Plans",
        ("a", "b"),
        "work",
        at(4),
    )
    assert conv.decide(state, cmd(RenameConversation, 5, title="Plans", at=at(5))) == []
    _, events = apply(conv, state, cmd(TagConversation, 6, tags=("b",), at=at(6)))
    assert events == [ConversationTagged(conversation_id="c-1", tags=("b",), at=at(6))]
    state = run(conv, state, cmd(MoveConversationToFolder, 7, folder=None, at=at(7)))
    assert state.folder is None


def test_tags_and_titles_are_bounded() -> None:
    with pytest.raises(ValidationError):
        cmd(TagConversation, 1, tags=("a", "a"), at=at(1))
    with pytest.raises(ValidationError):
        cmd(TagConversation, 1, tags=tuple(str(i) for i in range(33)), at=at(1))
    with pytest.raises(ValidationError):
        cmd(RenameConversation, 1, title="x" * 201, at=at(1))
    with pytest.raises(ValidationError):
        cmd(RenameConversation, 1, title="naive time", at=datetime(2026, 1, 1))


def test_deleted_conversation_refuses_changes() -> None:
    state = run(conv, fresh_conversation(), turn(1))
    state, events = apply(conv, state, cmd(DeleteConversation, 2, at=at(2)))
    assert events == [ConversationDeleted(conversation_id="c-1", at=at(2))]
    with pytest.raises(NotFound, match="conversation c-1 does not exist"):
        conv.decide(state, cmd(RenameConversation, 3, title="x", at=at(3)))
    with pytest.raises(NotFound, match="does not exist"):
        conv.decide(state, turn(4))
    assert conv.decide(state, cmd(DeleteConversation, 5, at=at(5))) == []


def test_other_workspace_sees_no_conversation() -> None:
    state = run(conv, fresh_conversation(), turn(1))
    with pytest.raises(NotFound, match="does not exist"):
        conv.decide(state, cmd(RenameConversation, 2, title="x", at=at(2), workspace_id="ws-2"))
    with pytest.raises(NotFound, match="does not exist"):
        conv.decide(state, turn(3).model_copy(update={"workspace_id": "ws-2"}))


def test_explicit_start_is_idempotent_per_command_only() -> None:
    start = cmd(StartConversation, 1, title="t", tags=("x",), at=at(1))
    state = run(conv, fresh_conversation(), start)
    assert state.title == "t" and state.tags == ("x",)
    assert conv.decide(state, start) == []
    with pytest.raises(Conflict, match="already exists"):
        conv.decide(state, cmd(StartConversation, 2, at=at(2)))


def test_conversation_state_survives_a_snapshot_round_trip() -> None:
    state = run(conv, fresh_conversation(), turn(1), complete(1), turn(2))
    restored = ConversationState.model_validate(state.model_dump(mode="json"))
    assert restored == state


# --- workspace ------------------------------------------------------------------------------

ws = WorkspaceBehaviour()
KEY_HASH = hashlib.sha256(b"svc-secret-key").hexdigest()


def created_workspace() -> WorkspaceState:
    return run(
        ws, ws.initial_state(workspace_key(WS)), cmd(CreateWorkspace, 1, name="Acme", at=at(1))
    )


def issue(n: int, key_id: str = "k1", **extra: Any) -> IssueApiKey:
    fields: dict[str, Any] = {
        "key_id": key_id,
        "name": "ci",
        "key_hash": KEY_HASH,
        "prefix": "svc-secr",
        "scopes": ("admin:read",),
        "rate_limit_rpm": 60,
        "at": at(n),
    }
    return cmd(IssueApiKey, n, **(fields | extra))


def test_workspace_create_is_idempotent_per_command() -> None:
    state = created_workspace()
    assert state.name == "Acme" and state.created_at == at(1)
    assert ws.decide(state, cmd(CreateWorkspace, 1, name="Acme", at=at(1))) == []
    with pytest.raises(Conflict, match="already exists"):
        ws.decide(state, cmd(CreateWorkspace, 2, name="Other", at=at(2)))


def test_workspace_must_exist_for_settings_and_keys() -> None:
    empty = ws.initial_state(workspace_key(WS))
    with pytest.raises(NotFound, match="workspace ws-1 does not exist"):
        ws.decide(empty, issue(2))


def test_settings_record_values_and_secret_markers_only() -> None:
    state = run(
        ws,
        created_workspace(),
        cmd(ChangeWorkspaceSetting, 2, key="SVC_LLM_MODEL", value="m1", at=at(2)),
        cmd(ChangeWorkspaceSetting, 3, key="SVC_NATIVE_API_KEY", value=None, secret=True, at=at(3)),
    )
    assert state.settings["SVC_LLM_MODEL"].value == "m1"
    assert state.settings["SVC_NATIVE_API_KEY"].secret
    assert state.settings["SVC_NATIVE_API_KEY"].value is None
    same = cmd(ChangeWorkspaceSetting, 4, key="SVC_LLM_MODEL", value="m1", at=at(4))
    assert ws.decide(state, same) == []
    reset = cmd(ChangeWorkspaceSetting, 5, key="SVC_LLM_MODEL", value=None, at=at(5))
    assert "SVC_LLM_MODEL" not in run(ws, state, reset).settings
    with pytest.raises(ValidationError, match="marker"):
        cmd(ChangeWorkspaceSetting, 6, key="SVC_X", value="plain", secret=True, at=at(6))


def test_api_keys_are_issued_by_hash_and_revoked_once() -> None:
    state = run(ws, created_workspace(), issue(2))
    key = state.api_keys["k1"]
    assert (key.key_hash, key.prefix, key.scopes, key.rate_limit_rpm) == (
        KEY_HASH,
        "svc-secr",
        ("admin:read",),
        60,
    )
    with pytest.raises(Conflict, match="already used"):
        ws.decide(state, issue(3))
    state, events = apply(ws, state, cmd(RevokeApiKey, 4, key_id="k1", at=at(4)))
    assert events == [ApiKeyRevoked(workspace_id=WS, key_id="k1", at=at(4))]
    assert state.api_keys["k1"].revoked_at == at(4)
    assert ws.decide(state, cmd(RevokeApiKey, 5, key_id="k1", at=at(5))) == []
    with pytest.raises(NotFound, match="no API key of workspace ws-1 has the id given"):
        ws.decide(state, cmd(RevokeApiKey, 6, key_id="k9", at=at(6)))


def test_api_key_fields_are_validated() -> None:
    with pytest.raises(ValidationError, match="unknown scope"):
        issue(2, scopes=("root",))
    with pytest.raises(ValidationError):
        issue(2, key_hash="not-a-sha256")
    with pytest.raises(InvalidInput, match="expires_at"):
        ws.decide(created_workspace(), issue(2, expires_at=at(1)))


# --- agent ----------------------------------------------------------------------------------

agents = AgentBehaviour()


def created_agent() -> AgentState:
    create = cmd(CreateAgent, 1, name="helper", model="m1", system_prompt="be kind", at=at(1))
    return run(agents, agents.initial_state(agent_key("a-1")), create)


def test_agent_lifecycle() -> None:
    state = created_agent()
    assert (state.name, state.model, state.system_prompt, state.workspace_id) == (
        "helper",
        "m1",
        "be kind",
        WS,
    )
    params = AgentParameters(temperature=0.2, reasoning_effort="high")
    state = run(
        agents,
        state,
        cmd(UpdateAgentProfile, 2, description="helps", at=at(2)),
        cmd(ChangeAgentModel, 3, model="m2", at=at(3)),
        cmd(ChangeAgentParameters, 4, parameters=params, at=at(4)),
    )
    assert (state.name, state.description, state.model, state.parameters) == (
        "helper",
        "helps",
        "m2",
        params,
    )
    assert state.updated_at == at(4)
    assert agents.decide(state, cmd(ChangeAgentModel, 5, model="m2", at=at(5))) == []


def test_agent_profile_update_needs_a_field() -> None:
    with pytest.raises(InvalidInput, match="at least one"):
        agents.decide(created_agent(), cmd(UpdateAgentProfile, 2, at=at(2)))


def test_archived_agent_refuses_changes() -> None:
    state, events = apply(agents, created_agent(), cmd(ArchiveAgent, 2, at=at(2)))
    assert events == [AgentArchived(agent_id="a-1", at=at(2))]
    with pytest.raises(Conflict, match="agent a-1 is archived"):
        agents.decide(state, cmd(ChangeAgentModel, 3, model="m3", at=at(3)))
    assert agents.decide(state, cmd(ArchiveAgent, 4, at=at(4))) == []


def test_agent_of_another_workspace_is_not_found() -> None:
    with pytest.raises(NotFound, match="agent a-1 does not exist"):
        agents.decide(
            created_agent(), cmd(ChangeAgentModel, 2, model="m", at=at(2), workspace_id="ws-2")
        )


def test_agent_parameters_are_bounded() -> None:
    with pytest.raises(ValidationError):
        AgentParameters(temperature=2.5)
    with pytest.raises(ValidationError):  # a word, as chat's: the model server judges it
        AgentParameters(reasoning_effort="Minimal!")
    assert AgentParameters(reasoning_effort="minimal").reasoning_effort == "minimal"


def test_only_recent_turns_are_held_and_running_ones_stay() -> None:
    from actors.conversation import RECENT_TURNS, recorded_result

    state = run(conv, fresh_conversation(), turn(0))  # stays running throughout
    for n in range(1, RECENT_TURNS + 5):
        state = run(conv, state, turn(n), complete(n))
    assert state.turn_count == RECENT_TURNS + 5
    assert len(state.turns) == RECENT_TURNS
    assert state.turns["t0"].status == "running"
    assert "t1" not in state.turns and "c1" not in state.turn_by_command
    assert set(state.turn_by_command.values()) == set(state.turns)
    last = RECENT_TURNS + 4
    assert recorded_result(state, turn(last)).content == "answer"
    with pytest.raises(NotFound, match="does not exist"):
        recorded_result(state, turn(last).model_copy(update={"workspace_id": "ws-2"}))
    # An expired turn: the store's ledger recognised the command id, the state no longer
    # holds its answer. Refused, never run again.
    first_events = conv.decide(fresh_conversation(), turn(1))
    with pytest.raises(Conflict, match="without a result this retry can be answered with"):
        recorded_result(state, turn(1), first_events)
    with pytest.raises(Conflict, match="another request"):
        recorded_result(state, turn(1))


def test_a_retry_recorded_before_request_digests_is_judged_by_the_fields_it_names() -> None:
    """Review finding: an agent update's first run recorded before digests were kept holds
    the whole profile after the change; its retry names only the field it changed (the
    others None), which the fallback compared with the event's values and refused (409)."""
    import uuid as uuid_module
    from datetime import UTC, datetime

    from actors.context import _same_request
    from eventstore.records import RecordedEvent
    from schemas.agent import UpdateAgent

    def first_run(data: dict[str, object]) -> RecordedEvent:
        return RecordedEvent(
            1, 1, "agent:agt_1", 2, uuid_module.uuid4(), "ws", "agent.profile_updated", 1,
            data, {"command_type": "UpdateAgent", "command_id": "k"}, datetime.now(UTC),
        )  # fmt: skip

    recorded = first_run({"name": "ada", "description": "one", "system_prompt": "be brief"})
    at = datetime.now(UTC)
    retry = UpdateAgent(command_id="k", workspace_id="ws", description="one", at=at)
    assert _same_request(retry, recorded)
    other = UpdateAgent(command_id="k", workspace_id="ws", description="two", at=at)
    assert not _same_request(other, recorded)
