"""Conversation commands and events.

A conversation is one logical actor (`conversation:<id>`). Its durable facts are the events
below; model token deltas are not events (ARCHITECTURE decision 5).

Timestamps: every command that produces an event carries `at`, stamped by the caller (the
gateway or the actor's handler) when it builds the command. `decide()` must stay pure, so it
copies `at` into the events instead of reading a clock; replaying the log therefore rebuilds
exactly the same state, times included.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from schemas.commands import Command
from schemas.events import EVENTS, Event, event

MAX_TITLE = 200
MAX_TAGS = 32
MAX_TAG = 64
MAX_FOLDER = 200
MAX_CONTENT = 1_000_000
MAX_TOKEN_LIMIT = 1_000_000
"""The largest `max_tokens` a turn takes: above any model's context, so never a real limit."""
MAX_MESSAGES = 10_000
MAX_DURATION_MS = 2**31 - 1
"""The longest duration a turn records (about 24.8 days), as the read models' 32-bit
integers hold it; a turn abandoned longer ago than that records this."""
MAX_TOKEN_COUNT = 2**31 - 1
"""The most tokens a turn records, prompt and completion together: the read models keep
counts as 32-bit integers, and no model's answer comes near."""

Id = Annotated[str, Field(min_length=1, max_length=200)]
Title = Annotated[str, Field(min_length=1, max_length=MAX_TITLE)]
Folder = Annotated[str, Field(min_length=1, max_length=MAX_FOLDER)]
Tag = Annotated[str, Field(min_length=1, max_length=MAX_TAG, pattern=r"^\S(.*\S)?$")]


def _unique_tags(tags: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(tags)) != len(tags):
        raise ValueError("tags must be unique")
    return tags


Tags = Annotated[tuple[Tag, ...], Field(max_length=MAX_TAGS), AfterValidator(_unique_tags)]
Role = Literal["system", "user", "assistant", "tool"]


class Message(BaseModel):
    """One OpenAI-style chat message as the client sent it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    role: Role
    content: str = Field(max_length=MAX_CONTENT)
    name: str | None = Field(default=None, max_length=200)


MAX_STOP = 4
"""Stop sequences per turn, as OpenAI's API allows."""
MAX_STOP_CHARS = 200


ReasoningEffort = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z][a-z_-]*$")]
"""OpenAI's `reasoning_effort` (`minimal`, `low`, `medium`, `high`, and what newer models add),
passed to the model server as given: it judges the value."""
Verbosity = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z][a-z_-]*$")]


class TurnParams(BaseModel):
    """Sampling parameters of one turn; None (or no stop sequence) means "not sent upstream".
    Fields added later default to that, so older events read as they were recorded."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKEN_LIMIT)
    stop: tuple[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)], ...] = Field(
        default=(), max_length=MAX_STOP
    )
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    max_tokens_as: Literal["max_completion_tokens"] | None = None
    """The name the client gave `max_tokens`, sent upstream under it: OpenAI's reasoning
    models refuse `max_tokens`. None: `max_tokens`."""
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None

    @model_serializer(mode="wrap")
    def _later_fields_only_when_set(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A turn that uses none of the fields added after the first release is recorded
        # exactly as before, so a gateway of that release can still read it (a rolling
        # upgrade): its TurnParams forbids fields it does not know.
        data = handler(self)
        for name in _LATER_PARAMS:
            if data.get(name) in (None, (), []):
                data.pop(name, None)
        return data


_LATER_PARAMS = (
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens_as",
    "reasoning_effort",
    "verbosity",
)


# --- commands -------------------------------------------------------------------------------


class StartConversation(Command):
    """Create an empty conversation (admin API). RunTurn also starts one implicitly."""

    title: Title | None = None
    project_id: Id | None = None
    folder: Folder | None = None
    tags: Tags = ()
    agent: Id | None = None
    model: Id | None = None
    at: AwareDatetime


class RunTurn(Command):
    """Run one model turn: record the turn's input, call the model, record the answer.

    `messages` is the full OpenAI-style history the client sent, oldest first; it is what the
    model sees. The turn's input is what the client said since the history's last answer:
    the `user` and `tool` messages after its last `assistant` message, each recorded
    (UserMessageReceived, ToolOutputReceived); what comes before was recorded by the turns
    that answered it. `turn_id` and `message_id` (the newest input's; an earlier one's is
    derived from it) are generated by the caller so that `decide()` stays pure; the
    assistant message id is generated by the handler when it builds CompleteTurn.
    The title/project/folder/tags fields are used only when this turn starts the
    conversation; `agent` (the id of the agent the model name resolved to, if any) also goes
    into TurnStarted. `continue_only`: the client named the conversation, so it must already
    exist in the caller's workspace; a turn never starts a conversation under an id a client
    chose (ids are the service's to issue, and one workspace could otherwise claim an id
    before another).
    """

    turn_id: Id
    message_id: Annotated[str, Field(min_length=1, max_length=180)]
    """Shorter than an Id: the ids of a turn's earlier inputs add a suffix to it."""
    model: Id
    messages: tuple[Message, ...] = Field(min_length=1, max_length=MAX_MESSAGES)
    params: TurnParams = TurnParams()
    title: Title | None = None
    project_id: Id | None = None
    folder: Folder | None = None
    tags: Tags = ()
    agent: Id | None = None
    continue_only: bool = False
    at: AwareDatetime
    # Stamped with `at` by the conversation's handler as the turn starts (TurnStarted).
    expires_at: AwareDatetime | None = None
    never_expires: bool = False
    traceparent: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
    )
    """The W3C trace context of the gateway's span of this turn, sent to the model server
    (not recorded: a turn's events are the same with tracing on or off)."""
    body_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    """A digest of the client's request as sent (its model, messages and parameters), set
    when an Idempotency-Key names the turn: a retry under that key must be the same request
    (recorded with TurnStarted; another one is refused, never given this turn's answer)."""

    def held_chars(self) -> int:
        return sum(len(m.content) for m in self.messages)


class CompleteTurn(Command):
    turn_id: Id
    message_id: Id
    content: str = Field(max_length=MAX_CONTENT)
    finish_reason: str = Field(min_length=1, max_length=64)
    prompt_tokens: int = Field(ge=0, le=MAX_TOKEN_COUNT)
    completion_tokens: int = Field(ge=0, le=MAX_TOKEN_COUNT)
    duration_ms: int = Field(ge=0)
    at: AwareDatetime

    @model_validator(mode="after")
    def _total_fits(self) -> CompleteTurn:
        if self.prompt_tokens + self.completion_tokens > MAX_TOKEN_COUNT:
            raise ValueError(f"prompt and completion tokens together exceed {MAX_TOKEN_COUNT}")
        return self


class FailTurn(Command):
    turn_id: Id
    error_code: str = Field(min_length=1, max_length=100)
    error_message: str = Field(max_length=2_000)
    duration_ms: int = Field(ge=0)
    retryable: bool
    at: AwareDatetime


class RecoverAbandonedTurns(Command):
    """Record `turn_ids` as failed with `turn_abandoned`: turns a gone incarnation started and
    never ended. Issued by the conversation's own handler, the gateways' sweep and, `force`d,
    an operator (`svc conversations abandon`), never by a client. A turn no longer running
    when this is decided is left alone, and so, unless `force`, is one whose recorded expiry
    is still ahead or that never expires."""

    turn_ids: tuple[Id, ...] = Field(min_length=1, max_length=MAX_MESSAGES)
    at: AwareDatetime
    force: bool = False


class RenameConversation(Command):
    title: Title
    at: AwareDatetime


class TagConversation(Command):
    """Replace the conversation's tag set with `tags` (the full set, not a delta)."""

    tags: Tags
    at: AwareDatetime


class MoveConversationToFolder(Command):
    """Move to `folder`; None takes the conversation out of any folder."""

    folder: Folder | None
    at: AwareDatetime


class DeleteConversation(Command):
    at: AwareDatetime


# --- events ---------------------------------------------------------------------------------


@event
class ConversationStarted(Event):
    type_name: ClassVar[str] = "conversation.started"
    conversation_id: Id
    workspace_id: Id
    title: Title | None
    project_id: Id | None
    folder: Folder | None
    tags: Tags
    agent: Id | None
    model: Id | None
    # The creating command's id: a retried create is recognised even after a replay.
    command_id: Id | None = None
    at: AwareDatetime


@event
class UserMessageReceived(Event):
    """A user message of a turn's input (RunTurn), recorded before the model is called."""

    type_name: ClassVar[str] = "conversation.user_message_received"
    role: ClassVar[Literal["user", "tool"]] = "user"
    """The role of the message in the conversation's record (a ClassVar: not in the event)."""
    conversation_id: Id
    message_id: Id
    content: str = Field(max_length=MAX_CONTENT)
    name: str | None
    turn_id: Id | None
    at: AwareDatetime


@event
class ToolOutputReceived(Event):
    """A tool's output the client sent as part of a turn's input (a `tool` message), recorded
    before the model is called; `name` is the tool's, when the message gave one."""

    type_name: ClassVar[str] = "conversation.tool_output_received"
    role: ClassVar[Literal["user", "tool"]] = "tool"
    conversation_id: Id
    message_id: Id
    content: str = Field(max_length=MAX_CONTENT)
    name: str | None
    turn_id: Id
    at: AwareDatetime


@event
class TurnStarted(Event):
    """Appended before the model is called: the fence against a second paid call
    (ARCHITECTURE decision 2)."""

    type_name: ClassVar[str] = "conversation.turn_started"
    schema_version: ClassVar[int] = 2
    conversation_id: Id
    turn_id: Id
    command_id: Id
    model: Id
    params: TurnParams
    request_messages: int = Field(ge=0)
    at: AwareDatetime
    # The agent whose configuration this turn ran with (gateway/chat.py resolves it).
    agent: Id | None = None
    # When this turn, if still running, was abandoned: its start plus the model-call budget
    # it was given plus a margin (actors/conversation.py, turn_lifetime). None when calls had
    # no time limit (then `never_expires` is true and no age abandons it), and on turns
    # recorded before these fields existed (both unset), which are judged by the budget in
    # force when they are judged.
    expires_at: AwareDatetime | None = None
    # True when the turn's call had no time limit: no age makes it abandoned.
    never_expires: bool = False
    # RunTurn.body_digest of the request that started it (version 2 on; None before, and for
    # a request without an Idempotency-Key).
    body_digest: str | None = None


@EVENTS.upcaster(TurnStarted.type_name, 1)
def _turn_started_v1(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 added `body_digest`: a turn recorded before has none (nothing to compare a
    retry with), which its default says."""
    return data


@event
class AssistantMessageCompleted(Event):
    type_name: ClassVar[str] = "conversation.assistant_message_completed"
    conversation_id: Id
    turn_id: Id
    message_id: Id
    content: str = Field(max_length=MAX_CONTENT)
    finish_reason: str
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    duration_ms: int = Field(ge=0)
    at: AwareDatetime


@event
class TurnFailed(Event):
    type_name: ClassVar[str] = "conversation.turn_failed"
    conversation_id: Id
    turn_id: Id
    error_code: str
    error_message: str
    duration_ms: int = Field(ge=0)
    retryable: bool
    at: AwareDatetime


@event
class ConversationRenamed(Event):
    type_name: ClassVar[str] = "conversation.renamed"
    conversation_id: Id
    title: Title
    at: AwareDatetime


@event
class ConversationTagged(Event):
    """Carries the full tag set after the change."""

    type_name: ClassVar[str] = "conversation.tagged"
    conversation_id: Id
    tags: Tags
    at: AwareDatetime


@event
class ConversationMovedToFolder(Event):
    type_name: ClassVar[str] = "conversation.moved_to_folder"
    conversation_id: Id
    folder: Folder | None
    at: AwareDatetime


@event
class ConversationDeleted(Event):
    type_name: ClassVar[str] = "conversation.deleted"
    conversation_id: Id
    at: AwareDatetime
