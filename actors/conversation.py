"""The conversation actor (`conversation:<id>`): messages, model turns, title, tags, folder.

The pure core records what happened; `handle` wraps a RunTurn around the model call:

1. execute RunTurn -> the turn's input (UserMessageReceived, ToolOutputReceived; see
   `_turn_input`) + TurnStarted are appended BEFORE the model is called. The append claims
   the command id in the store's ledger and moves the stream version, so a stale duplicate
   activation (another host, a retried request) either gets a concurrency conflict or a
   duplicate result and never starts a second paid model call (ARCHITECTURE decision 2).
2. stream the model through the provider that serves the requested model; every TextDelta
   goes to the caller as it arrives (deltas are not events, decision 5).
3. execute CompleteTurn (AssistantMessageCompleted with usage and duration), or FailTurn on
   an error, which is then re-raised.

The last item yielded is a `TurnResult`.

Abandoned turns: a turn runs to its end inside the handler of its own RunTurn, and an
activation runs one command at a time, so when any command starts no turn of this activation
is running. A turn the state still calls running was started by another activation: one that
is gone (a process that died mid-call), or one still at work in another process (two
gateways with the local runtime share a database, and nothing routes a key to one of them).
Nothing here tells the two apart but time: a turn cannot outlive its model call's time
budget plus a margin (`turn_lifetime`), so each turn records, as it starts, when that will
have run out (TurnStarted.expires_at; `never_expires` when calls had no time limit). Before
handling a command the handler records the running turns past their expiry as failed with
`turn_abandoned` (RecoverAbandonedTurns, stamped by the handler's clock): a retry with such a
turn's Idempotency-Key then gets that recorded failure, and a new key runs a new turn. A turn
not yet past its expiry is left to its owner: a retry with its key is `turn_in_progress`. A
writer that was in fact still alive past the expiry loses at the store's version fence when
it tries to record its answer.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from actors.behaviour import ActorContext, ActorKey, Behaviour, CommandOutcome
from actors.errors import (
    INTERNAL_FAILURE_MESSAGE,
    TURN_INTERRUPTED_MESSAGE,
    CommandInterrupted,
    RecordedTurnFailure,
    TurnCrashed,
    TurnInProgress,
)
from actors.models.port import (
    ChatMessage,
    Finished,
    ModelProvider,
    ModelRequest,
    TextDelta,
    Usage,
    well_formed,
)
from eventstore.errors import StatementAborted, StoreUnavailable
from schemas.commands import Command, service_command_id
from schemas.conversation import (
    MAX_CONTENT,
    MAX_DURATION_MS,
    MAX_TITLE,
    AssistantMessageCompleted,
    CompleteTurn,
    ConversationDeleted,
    ConversationMovedToFolder,
    ConversationRenamed,
    ConversationStarted,
    ConversationTagged,
    DeleteConversation,
    FailTurn,
    Message,
    MoveConversationToFolder,
    RecoverAbandonedTurns,
    RenameConversation,
    RunTurn,
    StartConversation,
    TagConversation,
    ToolOutputReceived,
    TurnFailed,
    TurnStarted,
    UserMessageReceived,
)
from schemas.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    RateLimited,
    SvcError,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    echoed,
    quoted,
)
from schemas.events import Event

log = logging.getLogger(__name__)

KIND = "conversation"
RECENT_TURNS = 16
HELD_CONTENT_CHARS = 4096
"""The longest answer a turn's record keeps for a retry to return. A longer one (up to a
million characters) is read from the log when a retry asks: sixteen of them held in every
active conversation's state, and written into each of its snapshots, took 16 MB apiece."""
NUL = "\x00"  # PostgreSQL text and jsonb cannot hold it
ABANDONED = "turn_abandoned"
ABANDONED_MESSAGE = (
    "the turn was abandoned: its outcome was never recorded (the process running it "
    "stopped, or lost the database, before it could record one)"
)
ABANDONED_BY_AN_OPERATOR = (
    "the turn was recorded as abandoned by an operator (`svc conversations abandon`); what "
    "its model answered, if anything, is not recorded"
)


def conversation_key(conversation_id: str) -> ActorKey:
    return ActorKey(KIND, conversation_id)


# --- state ----------------------------------------------------------------------------------


class TurnRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    turn_id: str
    # The conversation's turn count when this turn started: its place in start order.
    ordinal: int
    command_id: str
    model: str
    status: Literal["running", "completed", "failed"]
    started_at: AwareDatetime
    expires_at: AwareDatetime | None = None
    never_expires: bool = False
    ended_at: AwareDatetime | None = None
    message_id: str | None = None
    # The answer, when at most HELD_CONTENT_CHARS; None: longer, read from the log on a retry.
    content: str | None = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    duration_ms: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    retryable: bool = False
    # TurnStarted.body_digest: what a retry under the turn's Idempotency-Key must match.
    body_digest: str | None = None


class ConversationState(BaseModel):
    """`turns` and `turn_by_command` hold the outcome of the most recent RECENT_TURNS turns
    (and of every turn still running): a retried RunTurn (same command id) is answered from
    here instead of calling the model again. The window keeps the state, and so its snapshot,
    small whatever the conversation's length (activation from a snapshot stays about a
    millisecond); a retry of an older turn is answered from the log (the store's ledger
    names the events of its start and its ending: `_ended_turn_in_log`), never run twice."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    conversation_id: str
    workspace_id: str | None = None
    started_by: str | None = None
    deleted: bool = False
    title: str | None = None
    project_id: str | None = None
    folder: str | None = None
    tags: tuple[str, ...] = ()
    agent: str | None = None
    model: str | None = None
    created_at: AwareDatetime | None = None
    updated_at: AwareDatetime | None = None
    message_count: int = 0
    turn_count: int = 0
    # default_factory, not `= {}`: pydantic deep-copies a mutable default for every new
    # state, which cost about 1.7% of the gateway's CPU at 32 turns in flight.
    turns: dict[str, TurnRecord] = Field(default_factory=dict)
    turn_by_command: dict[str, str] = Field(default_factory=dict)
    unanswered: tuple[str, ...] = ()
    """Digests of the messages turns recorded as said since the last answer, the newest
    MAX_TURN_INPUTS: a failed turn's input, which its client sends again, is not recorded
    twice (`_turn_input`)."""

    @property
    def exists(self) -> bool:
        return self.started_by is not None


@dataclass(frozen=True, slots=True)
class TurnResult:
    """The final item of a RunTurn. `cursor` is the log cursor of the append that recorded
    the answer; None when `duplicate` (the answer was recorded by an earlier run)."""

    conversation_id: str
    turn_id: str
    message_id: str
    model: str
    content: str
    finish_reason: str
    usage: Usage
    duration_ms: int
    cursor: str | None
    duplicate: bool = False


# --- decide ---------------------------------------------------------------------------------


def _require_live(state: ConversationState, command: Command) -> None:
    # Missing, deleted and of another workspace answer exactly alike (docs/chat.md).
    if not state.exists or state.deleted or state.workspace_id != command.workspace_id:
        raise _missing(
            state,
            "; send the request without X-SVC-Conversation-Id to start a new one",
        )


def _missing(state: ConversationState, advice: str = "") -> NotFound:
    return NotFound(
        f"conversation {echoed(state.conversation_id)} does not exist{advice}",
        code="conversation_not_found",
    )


def _title_from(content: str) -> str | None:
    line = " ".join(content.split())
    if not line:
        return None
    return line if len(line) <= 80 else line[:79] + "…"


def _decide_start(state: ConversationState, c: StartConversation) -> list[Event]:
    if state.started_by == c.command_id:
        return []
    if state.exists:
        raise Conflict(f"conversation {state.conversation_id} already exists")
    return [
        ConversationStarted(
            conversation_id=state.conversation_id,
            workspace_id=c.workspace_id,
            title=c.title,
            project_id=c.project_id,
            folder=c.folder,
            tags=c.tags,
            agent=c.agent,
            model=c.model,
            command_id=c.command_id,
            at=c.at,
        )
    ]


def _decide_run(state: ConversationState, c: RunTurn) -> list[Event]:
    if c.command_id in state.turn_by_command:
        return []
    newest_user = next((m for m in reversed(c.messages) if m.role == "user"), None)
    if newest_user is None:
        raise InvalidInput("messages must contain at least one message with role 'user'")
    starts = not state.exists and not c.continue_only
    said = _turn_input(state, c.messages, newest_user, starts=starts)
    events: list[Event] = []
    if starts:
        first_user = next((m for m in said if m.role == "user"), newest_user)
        title = c.title or _title_from(first_user.content)
        events.append(
            ConversationStarted(
                conversation_id=state.conversation_id,
                workspace_id=c.workspace_id,
                title=title[:MAX_TITLE] if title else None,
                project_id=c.project_id,
                folder=c.folder,
                tags=c.tags,
                agent=c.agent,
                model=c.model,
                command_id=c.command_id,
                at=c.at,
            )
        )
    else:
        _require_live(state, c)
    if c.turn_id in state.turns:
        raise Conflict(f"turn id {c.turn_id} is already used in this conversation")
    events.extend(_inputs_received(state, c, said))
    events.append(
        TurnStarted(
            conversation_id=state.conversation_id,
            turn_id=c.turn_id,
            command_id=c.command_id,
            model=c.model,
            params=c.params,
            request_messages=len(c.messages),
            at=c.at,
            agent=c.agent,
            expires_at=c.expires_at,
            never_expires=c.never_expires,
            body_digest=c.body_digest,
        )
    )
    return events


MAX_TURN_INPUTS = 64
"""Messages of a turn's input recorded at most, the newest: a history of ten thousand user
messages and no answer would otherwise be ten thousand events of one request."""


def _turn_input(
    state: ConversationState, messages: Sequence[Message], newest_user: Message, *, starts: bool
) -> list[Message]:
    """What the client said that the conversation has not recorded yet: the user and tool
    messages after the history's last answer (what came before it was recorded by the turns
    that answered it), oldest first, the newest MAX_TURN_INPUTS of them.

    - Those a turn since the last answer recorded and got no answer for (it failed; a client
      sends them again, with or without more) are not recorded twice: the longest run of
      them that the input begins with is left out (`ConversationState.unanswered`).
    - A turn that starts the conversation records the newest user message at least: a
      history ending with an answer (an assistant prefill) would otherwise record no one's
      words. A later turn with such a history (the client asks the model to go on) records
      only the answer."""
    last_answer = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    said = [m for m in messages[last_answer + 1 :] if m.role in ("user", "tool")]
    said = said[_already_recorded(state.unanswered, said) :][-MAX_TURN_INPUTS:]
    return said if said or not starts else [newest_user]


def _already_recorded(unanswered: Sequence[str], said: Sequence[Message]) -> int:
    """How many of `said`'s first messages are the last ones of `unanswered`."""
    digests = [_said_digest(m.role, m.name, m.content) for m in said[: len(unanswered)]]
    for count in range(len(digests), 0, -1):
        if list(unanswered[-count:]) == digests[:count]:
            return count
    return 0


def _said_digest(role: str, name: str | None, content: str) -> str:
    """What tells two messages apart in `ConversationState.unanswered`, in 16 bytes."""
    text = f"{role}\x00{name or ''}\x00{content}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _inputs_received(state: ConversationState, c: RunTurn, said: list[Message]) -> list[Event]:
    """The events of the turn's input `said`. The newest takes the command's message id, an
    earlier one that id with its distance from the end: a retried request numbers them
    alike."""
    events: list[Event] = []
    for back, message in zip(range(len(said) - 1, -1, -1), said, strict=True):
        received = ToolOutputReceived if message.role == "tool" else UserMessageReceived
        events.append(
            received(
                conversation_id=state.conversation_id,
                message_id=c.message_id if back == 0 else f"{c.message_id}.{back}",
                content=message.content,
                name=message.name,
                turn_id=c.turn_id,
                at=c.at,
            )
        )
    return events


def _running_turn(state: ConversationState, c: CompleteTurn | FailTurn) -> TurnRecord:
    _require_live(state, c)
    turn = state.turns.get(c.turn_id)
    if turn is None:
        raise NotFound(
            f"turn {echoed(c.turn_id)} does not exist in conversation {state.conversation_id}"
        )
    if turn.status != "running":
        raise Conflict(f"turn {c.turn_id} already ended ({turn.status})")
    return turn


def _decide_complete(state: ConversationState, c: CompleteTurn) -> list[Event]:
    _running_turn(state, c)
    return [
        AssistantMessageCompleted(
            conversation_id=state.conversation_id,
            turn_id=c.turn_id,
            message_id=c.message_id,
            content=c.content,
            finish_reason=c.finish_reason,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            total_tokens=c.prompt_tokens + c.completion_tokens,
            duration_ms=c.duration_ms,
            at=c.at,
        )
    ]


def _decide_fail(state: ConversationState, c: FailTurn) -> list[Event]:
    _running_turn(state, c)
    return [
        TurnFailed(
            conversation_id=state.conversation_id,
            turn_id=c.turn_id,
            error_code=c.error_code,
            error_message=c.error_message,
            duration_ms=c.duration_ms,
            retryable=c.retryable,
            at=c.at,
        )
    ]


def _decide_recover(state: ConversationState, c: RecoverAbandonedTurns) -> list[Event]:
    # A deleted conversation's running turns are still recorded as failed; another
    # workspace's are not this command's (its callers name the conversation's own).
    if state.exists and state.workspace_id != c.workspace_id:
        raise _missing(state)
    events: list[Event] = []
    for turn_id in dict.fromkeys(c.turn_ids):
        turn = state.turns.get(turn_id)
        if turn is None or turn.status != "running":
            continue
        if not c.force and (
            turn.never_expires or (turn.expires_at is not None and turn.expires_at > c.at)
        ):
            continue  # its own budget has not run out, whatever the one in force now says
        elapsed = round((c.at - turn.started_at).total_seconds() * 1000)
        events.append(
            TurnFailed(
                conversation_id=state.conversation_id,
                turn_id=turn_id,
                error_code=ABANDONED,
                error_message=ABANDONED_BY_AN_OPERATOR if c.force else ABANDONED_MESSAGE,
                duration_ms=min(max(0, elapsed), MAX_DURATION_MS),
                retryable=True,
                at=c.at,
            )
        )
    return events


RESEND_WAITS_S = (0.05, 0.2, 0.5)
"""Waits before sending a turn's start or answer again after the store lost it (see
`_resent_while_lost`)."""
RESEND_DEADLINE_S = 2.0
"""No try of a resent append begins this long after the first: a store that stays away is
the client's 503, not a wait of minutes, well inside the turn's margin (TURN_MARGIN_S). So a
driver timeout, which comes after the statement timeout and more (a server not answering
at all), is not tried again."""


async def _resent_while_lost(
    ctx: ActorContext[ConversationState], command: Command, what: str
) -> CommandOutcome:
    """`command` executed; sent again (same id: the ledger makes it safe) a few times within
    RESEND_DEADLINE_S while the store loses it. A lost connection leaves an append's outcome
    unknown: its commit may have landed with the answer lost, and a try again either writes
    it or finds it written. A statement the database aborted (a timeout, a deadlock) was
    rolled back, its outcome known: no try again."""
    deadline = asyncio.get_running_loop().time() + RESEND_DEADLINE_S
    for wait_s in (*RESEND_WAITS_S, None):
        try:
            return await ctx.execute(command)
        except StatementAborted:
            raise
        except StoreUnavailable as exc:
            now = asyncio.get_running_loop().time()
            if wait_s is None or now + wait_s > deadline:
                raise
            log.warning(
                "%s: the store lost %s (%s); sending it again", ctx.key.stream_id, what, exc
            )
            await asyncio.sleep(wait_s)
    raise AssertionError("unreachable: the last try returns or raises")


async def _start(
    ctx: ActorContext[ConversationState], stamped: RunTurn
) -> tuple[CommandOutcome, bool]:
    """Record the turn's start (user message, TurnStarted) and say whether the turn is this
    call's to run. Left unrecorded by a lost connection, the turn would read as running,
    answer its key's retries 409 `turn_in_progress` and end `turn_abandoned`, with no model
    ever called: so it is resent while lost. When the start turns out recorded, and it is
    this call's own (the `at` it was stamped with, not a concurrent retry's on another
    process), the turn goes on."""
    started = await _resent_while_lost(ctx, stamped, f"turn {stamped.turn_id}'s start")
    # Whatever the outcome says (a duplicate, or nothing to do on a state the last try
    # caught up to), a running turn stamped with this call's own start is its to run.
    return started, _started_by(ctx.state, stamped)


def _started_by(state: ConversationState, stamped: RunTurn) -> bool:
    turn_id = state.turn_by_command.get(stamped.command_id)
    turn = state.turns.get(turn_id) if turn_id is not None else None
    return turn is not None and turn.status == "running" and turn.started_at == stamped.at


TURN_MARGIN_S = 60.0
"""Beyond a turn's model-call budget: its appends, and a wait behind other commands."""


def turn_lifetime(call_timeout_s: float) -> timedelta | None:
    """The longest a turn may run (its call budget plus `TURN_MARGIN_S`); a turn running for
    longer was abandoned. None when calls have no time limit: no age tells a dead turn from a
    slow one."""
    return None if call_timeout_s <= 0 else timedelta(seconds=call_timeout_s + TURN_MARGIN_S)


def _lifetime(budget_s: float | None) -> timedelta | None:
    """The lifetime a turn gets from `budget_s`; zero for a table that runs every turn of its
    conversations alone (no budget given: see ConversationBehaviour)."""
    return timedelta(0) if budget_s is None else turn_lifetime(budget_s)


def expired_turns(
    state: ConversationState, now: datetime, lifetime: timedelta | None
) -> tuple[str, ...]:
    """The running turns past their expiry at `now`: the one each recorded when it started
    (or none, `never_expires`) or, for a turn recorded before turns carried an expiry, its
    start plus `lifetime` (None: never)."""
    return tuple(
        t.turn_id
        for t in state.turns.values()
        if t.status == "running"
        and (expiry := turn_expiry(t, lifetime)) is not None
        and expiry < now
    )


def expiry_stamp(at: datetime) -> str:
    """A turn's expiry as its messages name it: UTC, to the second."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def turn_expiry(turn: TurnRecord, lifetime: timedelta | None) -> datetime | None:
    """When `turn` is given up if it has not ended: its recorded expiry, or for a turn
    recorded before turns carried one, its start plus `lifetime`; None: never."""
    if turn.never_expires:
        return None
    if turn.expires_at is not None:
        return turn.expires_at
    return None if lifetime is None else turn.started_at + lifetime


def _decide_rename(state: ConversationState, c: RenameConversation) -> list[Event]:
    _require_live(state, c)
    if state.title == c.title:
        return []
    return [ConversationRenamed(conversation_id=state.conversation_id, title=c.title, at=c.at)]


def _decide_tag(state: ConversationState, c: TagConversation) -> list[Event]:
    _require_live(state, c)
    if state.tags == c.tags:
        return []
    return [ConversationTagged(conversation_id=state.conversation_id, tags=c.tags, at=c.at)]


def _decide_move(state: ConversationState, c: MoveConversationToFolder) -> list[Event]:
    _require_live(state, c)
    if state.folder == c.folder:
        return []
    cid = state.conversation_id
    return [ConversationMovedToFolder(conversation_id=cid, folder=c.folder, at=c.at)]


def _decide_delete(state: ConversationState, c: DeleteConversation) -> list[Event]:
    # Deleting is idempotent: a second delete (a retry, or a race) changes nothing.
    if state.deleted and state.workspace_id == c.workspace_id:
        return []
    _require_live(state, c)
    return [ConversationDeleted(conversation_id=state.conversation_id, at=c.at)]


_DECIDERS: dict[type[Command], Callable[[ConversationState, Any], list[Event]]] = {
    StartConversation: _decide_start,
    RunTurn: _decide_run,
    CompleteTurn: _decide_complete,
    FailTurn: _decide_fail,
    RecoverAbandonedTurns: _decide_recover,
    RenameConversation: _decide_rename,
    TagConversation: _decide_tag,
    MoveConversationToFolder: _decide_move,
    DeleteConversation: _decide_delete,
}


# --- evolve ---------------------------------------------------------------------------------


def _with_turn(state: ConversationState, turn: TurnRecord, at: datetime) -> ConversationState:
    turns = dict(state.turns)
    turns[turn.turn_id] = turn
    by_command = state.turn_by_command
    if len(turns) > RECENT_TURNS:
        # Oldest first by start order, never by the dict's order: a state restored from a
        # snapshot has its keys in jsonb's order (shortest first, then bytewise), and live
        # and restored states must drop the same turns.
        ended = sorted(
            (t for t in turns.values() if t.status != "running"), key=lambda t: t.ordinal
        )
        expired = ended[: len(turns) - RECENT_TURNS]
        by_command = dict(by_command)
        for old in expired:
            del turns[old.turn_id]
            by_command.pop(old.command_id, None)
    return state.model_copy(
        update={"turns": turns, "turn_by_command": by_command, "updated_at": at}
    )


def _evolve(state: ConversationState, event: Event) -> ConversationState:
    if isinstance(event, ConversationStarted):
        return state.model_copy(
            update={
                "workspace_id": event.workspace_id,
                "title": event.title,
                "project_id": event.project_id,
                "folder": event.folder,
                "tags": event.tags,
                "agent": event.agent,
                "model": event.model,
                "created_at": event.at,
                "updated_at": event.at,
                "started_by": event.command_id or "",
            }
        )
    if isinstance(event, UserMessageReceived | ToolOutputReceived):
        said = _said_digest(event.role, event.name, event.content)
        return state.model_copy(
            update={
                "message_count": state.message_count + 1,
                "updated_at": event.at,
                "unanswered": (*state.unanswered, said)[-MAX_TURN_INPUTS:],
            }
        )
    if isinstance(event, TurnStarted):
        turn = TurnRecord(
            turn_id=event.turn_id,
            ordinal=state.turn_count,
            command_id=event.command_id,
            model=event.model,
            status="running",
            started_at=event.at,
            expires_at=event.expires_at,
            never_expires=event.never_expires,
            body_digest=event.body_digest,
        )
        by_command = dict(state.turn_by_command)
        by_command[event.command_id] = event.turn_id
        new = state.model_copy(
            update={"turn_by_command": by_command, "turn_count": state.turn_count + 1}
        )
        return _with_turn(new, turn, event.at)
    if isinstance(event, AssistantMessageCompleted | TurnFailed) and (
        event.turn_id not in state.turns
    ):
        # Only a running turn can end, and running turns never leave the window.
        answered = isinstance(event, AssistantMessageCompleted)
        return state.model_copy(
            update={"updated_at": event.at} | ({"unanswered": ()} if answered else {})
        )
    if isinstance(event, AssistantMessageCompleted):
        turn = state.turns[event.turn_id].model_copy(
            update={
                "status": "completed",
                "ended_at": event.at,
                "message_id": event.message_id,
                "content": event.content if len(event.content) <= HELD_CONTENT_CHARS else None,
                "finish_reason": event.finish_reason,
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
                "duration_ms": event.duration_ms,
            }
        )
        new = _with_turn(state, turn, event.at)
        return new.model_copy(update={"message_count": state.message_count + 1, "unanswered": ()})
    if isinstance(event, TurnFailed):
        turn = state.turns[event.turn_id].model_copy(
            update={
                "status": "failed",
                "ended_at": event.at,
                "duration_ms": event.duration_ms,
                "error_code": event.error_code,
                "error_message": event.error_message,
                "retryable": event.retryable,
            }
        )
        return _with_turn(state, turn, event.at)
    if isinstance(event, ConversationRenamed):
        return state.model_copy(update={"title": event.title, "updated_at": event.at})
    if isinstance(event, ConversationTagged):
        return state.model_copy(update={"tags": event.tags, "updated_at": event.at})
    if isinstance(event, ConversationMovedToFolder):
        return state.model_copy(update={"folder": event.folder, "updated_at": event.at})
    if isinstance(event, ConversationDeleted):
        return state.model_copy(update={"deleted": True, "updated_at": event.at})
    return state


# --- the behaviour --------------------------------------------------------------------------


async def _recorded_result_now(
    ctx: ActorContext[ConversationState], command: RunTurn, first_events: Sequence[Event] = ()
) -> TurnResult:
    """The recorded outcome of a retried turn. One the cached state calls running may have
    ended in another process since (two gateways on one database): read the stream again
    before answering `turn_in_progress`. An answer too long to be held in the state is read
    from the log."""
    turn_id = ctx.state.turn_by_command.get(command.command_id)
    turn = ctx.state.turns.get(turn_id) if turn_id is not None else None
    if turn is None and ctx.state.workspace_id == command.workspace_id:
        past = await _ended_turn_in_log(ctx, command, first_events)
        if past is not None:
            state, answer = past
            return recorded_result(state, command, first_events, long_answer=answer)
    if turn is not None and turn.status == "running":
        await ctx.refresh()
        turn = ctx.state.turns.get(turn.turn_id)
    long_answer = None
    if (
        turn is not None
        and turn.status == "completed"
        and turn.content is None
        and ctx.state.workspace_id == command.workspace_id  # else recorded_result's 404
    ):
        long_answer = await _answer_in_log(ctx, command, turn.turn_id)
    return recorded_result(ctx.state, command, first_events, long_answer=long_answer)


async def _ended_turn_in_log(
    ctx: ActorContext[ConversationState], command: RunTurn, first_events: Sequence[Event]
) -> tuple[ConversationState, str | None] | None:
    """A turn of this command id that has left the state's window, as its ending recorded
    it: the state of its events alone, and its answer. The window is counted in turns, so on
    a busy conversation a retry queued behind a few dozen others (a client's resend of a
    slow turn, an SDK's retry of a cut stream) finds its turn gone from the state within a
    second; the log still holds what it answered. None when the log holds no ending under
    the turn's own ids (one recorded as abandoned by another activation)."""
    started = next((e for e in first_events if isinstance(e, TurnStarted)), None)
    if started is None:
        return None
    mine = await _ending_in_log(ctx, command, started.turn_id, ("complete", "fail"))
    if not mine:
        return None
    scratch = ConversationState(
        conversation_id=ctx.state.conversation_id, workspace_id=ctx.state.workspace_id
    )
    state = functools.reduce(_evolve, [started, *mine], scratch)
    answer = next((e.content for e in mine if isinstance(e, AssistantMessageCompleted)), None)
    return state, answer


async def _answer_in_log(
    ctx: ActorContext[ConversationState], command: RunTurn, turn_id: str
) -> str:
    for event in await _ending_in_log(ctx, command, turn_id, ("complete",)):
        if isinstance(event, AssistantMessageCompleted):
            return event.content
    raise SvcError(f"the recorded answer of turn {turn_id} was not found in the log")


async def _ending_in_log(
    ctx: ActorContext[ConversationState],
    command: RunTurn,
    turn_id: str,
    steps: Sequence[str],
) -> list[Event]:
    """The events of `turn_id` that the turn's own ending commands (`steps`: its completion,
    its failure) recorded, found through the store's processed-commands ledger."""
    found: list[Event] = []
    for step in steps:
        recorded = await ctx.recorded(
            service_command_id(step, command.command_id), command.workspace_id
        )
        found += [e for e in recorded if getattr(e, "turn_id", None) == turn_id]
    return found


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def recorded_result(
    state: ConversationState,
    command: Command,
    first_events: Sequence[Event] = (),
    *,
    long_answer: str | None = None,
) -> TurnResult:
    """What a retried RunTurn returns: the first run's outcome, never a second model call.
    `first_events` are the events the first run of this command id recorded, if known;
    `long_answer` the answer of a completed turn whose record does not hold it."""
    if state.workspace_id != command.workspace_id:
        raise _missing(state)
    command_id = command.command_id
    turn_id = state.turn_by_command.get(command_id)
    if turn_id is None:
        started = next((e for e in first_events if isinstance(e, TurnStarted)), None)
        if started is not None:
            raise Conflict(
                f"turn {started.turn_id} of conversation {state.conversation_id} has ended "
                "without a result this retry can be answered with (it was recorded as "
                "abandoned); read the conversation's messages for what it holds, or send a "
                "new Idempotency-Key",
                code="idempotency_key_expired",
            )
        raise Conflict(
            "this Idempotency-Key was already used for another request to conversation "
            f"{state.conversation_id}; send a new Idempotency-Key",
            code="idempotency_key_reused",
        )
    turn = state.turns[turn_id]
    _check_same_body(state, turn, command)
    if turn.status == "running":
        expires_at = turn.expires_at
        raise TurnInProgress.of(
            turn_id,
            state.conversation_id,
            state.workspace_id,
            None if expires_at is None else expiry_stamp(expires_at),
            never_expires=turn.never_expires,
        )
    if turn.status == "failed":
        raise RecordedTurnFailure(
            f"{turn.error_message} (recorded result of the first attempt; "
            "send a new Idempotency-Key to try again)",
            code=turn.error_code,
        )
    return TurnResult(
        conversation_id=state.conversation_id,
        turn_id=turn.turn_id,
        message_id=turn.message_id or "",
        model=turn.model,
        content=_held_or(turn, long_answer),
        finish_reason=turn.finish_reason or "",
        usage=Usage(turn.prompt_tokens, turn.completion_tokens),
        duration_ms=turn.duration_ms or 0,
        cursor=None,
        duplicate=True,
    )


def _check_same_body(state: ConversationState, turn: TurnRecord, command: Command) -> None:
    """A key names one request: the same key with other messages, another model or other
    parameters is another request, refused rather than answered with this turn. Either side
    without a digest (a turn recorded before they were kept) is not compared."""
    retried = getattr(command, "body_digest", None)
    if turn.body_digest is None or retried is None or retried == turn.body_digest:
        return
    raise Conflict(
        f"this Idempotency-Key was used for turn {turn.turn_id} of conversation "
        f"{state.conversation_id}, a request with other messages, model or parameters; send a "
        "new Idempotency-Key for a different request",
        code="idempotency_key_reused",
    )


def _held_or(turn: TurnRecord, long_answer: str | None) -> str:
    if turn.content is not None:
        return turn.content
    if long_answer is None:
        raise SvcError(f"turn {turn.turn_id}'s answer is not held in the state: read it first")
    return long_answer


def _recordable(text: str) -> str:
    """`text` as the log can hold it: without NUL, and well formed (no lone surrogate)."""
    return well_formed(text.replace(NUL, ""))


def _failure_facts(exc: BaseException) -> tuple[str, str, bool]:
    """(error_code, message safe to show, retryable) for a failed turn."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the runtime stopping its worker
            return "interrupted", "the service stopped while the turn was running", True
        # A cancelled operation the turn awaited (a future another task cancelled): a defect,
        # which the table answers 500 (actors/table.py), and so does its record.
        return "internal_error", INTERNAL_FAILURE_MESSAGE, False
    if isinstance(exc, SvcError) and not exc.internal:
        retryable = isinstance(exc, UpstreamError | UpstreamTimeout | Unavailable | RateLimited)
        return exc.code, exc.message, retryable
    # A defect or an internal SvcError (a failed store query): its message may hold database
    # detail, which the record would show to operators and to a retry with the same key.
    return "internal_error", INTERNAL_FAILURE_MESSAGE, False


class ConversationBehaviour(Behaviour[ConversationState]):
    """`providers` are asked in order; the first whose `serves(model)` is true runs a turn.
    `clock` stamps the commands the handler builds (decide itself never reads a clock)."""

    kind: ClassVar[str] = KIND
    state_type: ClassVar[type[BaseModel]] = ConversationState
    # 2: TurnRecord.ordinal; 3: a long answer's content not held. A snapshot of an older
    # version is ignored (replayed in full).
    state_schema_version: ClassVar[int] = 4

    def __init__(
        self,
        providers: Sequence[ModelProvider] = (),
        *,
        clock: Callable[[], datetime] = _utcnow,
        new_message_id: Callable[[], str] = _new_message_id,
        call_budget_s: Callable[[], float] | None = None,
    ) -> None:
        """`call_budget_s()`: the model-call time budget in force, in seconds (0: no limit),
        read as each turn starts (it is a live setting): the turn's call gets it, and the
        turn records the expiry it gives (`turn_lifetime`). None, for a table that runs
        every turn of its conversations alone: each call keeps its provider's own budget,
        and a running turn of another activation is taken for abandoned at once."""
        self._providers = tuple(providers)
        self._clock = clock
        self._new_message_id = new_message_id
        self._call_budget_s = call_budget_s

    def initial_state(self, key: ActorKey) -> ConversationState:
        return ConversationState(conversation_id=key.id)

    def decide(self, state: ConversationState, command: Command) -> Sequence[Event]:
        decider = _DECIDERS.get(type(command))
        if decider is None:
            raise InvalidInput(f"a conversation does not handle {type(command).__name__}")
        return decider(state, command)

    def evolve(self, state: ConversationState, event: Event) -> ConversationState:
        return _evolve(state, event)

    def provider_for(self, model: str) -> ModelProvider:
        for provider in self._providers:
            if provider.serves(model):
                return provider
        raise NotFound(
            f"model {quoted(model)} is not available on this instance; "
            "list the available models with GET /v1/models",
            code="model_not_found",
        )

    async def handle(
        self, ctx: ActorContext[ConversationState], command: Command
    ) -> AsyncIterator[Any]:
        if not isinstance(command, RecoverAbandonedTurns):
            await self._recover_abandoned(ctx)
        if not isinstance(command, RunTurn):
            yield await ctx.execute(command)
            return
        if command.command_id in ctx.state.turn_by_command:
            yield await _recorded_result_now(ctx, command)
            return
        try:
            provider = self.provider_for(command.model)
        except NotFound:
            # A retried key whose model is no longer served: its first run answers (or the
            # key's misuse is told, 409), not the model's absence.
            earlier = await ctx.earlier_run(command)
            if earlier is None:
                raise
            yield await _recorded_result_now(ctx, command, earlier.events)
            return
        budget_s = self._budget_now()
        stamped = self._stamped(command, budget_s)
        try:
            started, ours = await _start(ctx, stamped)
        except asyncio.CancelledError as exc:
            await self._fail_if_started(ctx, stamped, exc)
            raise
        if (started.duplicate or not started.events) and not ours:
            yield await _recorded_result_now(ctx, command, started.events)
            return
        # From here a stop that cuts the turn short records it as failed: the same key would
        # return that failure.
        ctx.interruption = CommandInterrupted(TURN_INTERRUPTED_MESSAGE)
        async for item in self._run_model(ctx, command, provider, budget_s):
            yield item

    async def _fail_if_started(
        self, ctx: ActorContext[ConversationState], stamped: RunTurn, exc: BaseException
    ) -> None:
        """A stop that cut the start short may have done so after it committed (its answer
        on the way, or a resend's wait): left so, the turn reads as running, its key answers
        409 until the turn is abandoned, and the model is never called. It is recorded as
        failed, as a turn a stop cuts short later is, and its caller told so."""
        try:
            await ctx.refresh()
        except Exception:
            return  # the store is away: the next command records the turn as abandoned
        if _started_by(ctx.state, stamped):
            await self._record_failure(ctx, stamped, exc, 0)
            ctx.interruption = CommandInterrupted(TURN_INTERRUPTED_MESSAGE)

    def _stamped(self, command: RunTurn, budget_s: float | None) -> RunTurn:
        """The turn as it starts: stamped with its start (it may have waited behind another
        turn) and with the expiry of `budget_s`, the call budget its model call is given.
        Other activations judge the turn by these, not by a budget changed while it runs."""
        now = self._clock()
        lifetime = _lifetime(budget_s)
        return command.model_copy(
            update={
                "at": now,
                "expires_at": None if lifetime is None else now + lifetime,
                "never_expires": lifetime is None,
            }
        )

    def _budget_now(self) -> float | None:
        """The call budget in force (a live setting: read it once per use); None: none given."""
        return None if self._call_budget_s is None else self._call_budget_s()

    def _abandoned_after(self) -> timedelta | None:
        return _lifetime(self._budget_now())

    async def _recover_abandoned(self, ctx: ActorContext[ConversationState]) -> None:
        """Record the turns of a gone incarnation as failed (see the module docstring)."""
        lifetime, now = self._abandoned_after(), self._clock()
        if not expired_turns(ctx.state, now, lifetime):
            return
        # Another process may have ended them since this state was read: look first.
        await ctx.refresh()
        state = ctx.state
        abandoned = expired_turns(state, now, lifetime)
        if not abandoned or state.workspace_id is None:
            return
        log.warning(
            "conversation %s: recording abandoned turns %s as failed",
            state.conversation_id,
            ", ".join(abandoned),
        )
        # Deterministic id: two activations racing to recover the same turns write once.
        seed = ctx.key.stream_id + "/" + ",".join(sorted(abandoned))
        recover = RecoverAbandonedTurns(
            command_id=service_command_id("recover", hashlib.sha256(seed.encode()).hexdigest()),
            workspace_id=state.workspace_id,
            turn_ids=abandoned,
            at=self._clock(),
        )
        await ctx.execute(recover)

    async def _run_model(
        self,
        ctx: ActorContext[ConversationState],
        command: RunTurn,
        provider: ModelProvider,
        budget_s: float | None,
    ) -> AsyncIterator[Any]:
        began = time.monotonic()
        parts: list[str] = []
        length = 0
        finished: Finished | None = None
        complete: CompleteTurn | None = None
        try:
            # Without a reader for the deltas (an ask), the upstream is asked for one completion.
            async for item in provider.stream(_request(command, ctx.streaming, budget_s)):
                if isinstance(item, TextDelta):
                    length += len(item.text)
                    if length > MAX_CONTENT:  # stop reading now: the log could not hold it
                        raise _overlong(command.model)
                    parts.append(item.text)
                    yield item
                else:
                    finished = item
            if finished is None:
                raise UpstreamError(f"model {command.model!r} ended its answer without finishing")
            duration_ms = _elapsed_ms(began)
            complete = self._completion(command, "".join(parts), finished, duration_ms)
            # Inside the try: a completion the store refuses or never confirms (an outage, a
            # stop's deadline) must leave the turn failed, not running until it expires.
            # Should it have committed after all, the failure is refused as a conflict.
            what = f"turn {command.turn_id}'s answer"
            outcome = await _resent_while_lost(ctx, complete, what)
        except (Exception, asyncio.CancelledError) as exc:
            cursor = await self._record_failure(ctx, command, exc, _elapsed_ms(began))
            ended = _ended_elsewhere(ctx.state, command.turn_id) if cursor is None else None
            if ended is not None and isinstance(exc, Exception):
                raise _outcome_not_recorded(ended) from exc
            if (
                isinstance(exc, Exception)
                and complete is not None
                and finished is not None
                and _answer_recorded(ctx.state, command.turn_id)
            ):
                # The answer committed and only its confirmation was lost: it is the
                # answer, paid for and recorded; a failure would have the client ask again.
                # Sent once more, it is found in the ledger, with its cursor.
                try:
                    outcome = await ctx.execute(complete)
                except SvcError:  # the ledger unreadable now: the record, without a cursor
                    yield await _recorded_result_now(ctx, command)
                    return
                yield _turn_result(ctx, command, complete, finished, outcome)
                return
            if cursor is not None and isinstance(exc, Exception) and not isinstance(exc, SvcError):
                raise TurnCrashed.of(exc, cursor) from exc
            raise
        yield _turn_result(ctx, command, complete, finished, outcome)

    def _completion(
        self, command: RunTurn, content: str, finished: Finished, duration_ms: int
    ) -> CompleteTurn:
        """The turn's completion as the log records it. An answer the log cannot hold (an
        empty or overlong finish reason, negative token counts, more text than a message
        holds, a NUL character that PostgreSQL text cannot store) is the model server's
        fault: a failed turn and a 502, never the client's 400."""
        if NUL in content or NUL in finished.finish_reason:
            raise UpstreamError(
                f"model {command.model!r} answered with a NUL character (\\u0000), which "
                "cannot be recorded",
                code="upstream_bad_response",
            )
        try:
            return CompleteTurn(
                command_id=service_command_id("complete", command.command_id),
                workspace_id=command.workspace_id,
                turn_id=command.turn_id,
                message_id=self._new_message_id(),
                content=content,
                finish_reason=finished.finish_reason,
                prompt_tokens=finished.usage.prompt_tokens,
                completion_tokens=finished.usage.completion_tokens,
                duration_ms=duration_ms,
                at=self._clock(),
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise UpstreamError(
                f"model {command.model!r} answered with a completion that cannot be recorded "
                f"({where}: {first['msg']})",
                code="upstream_bad_response",
            ) from None

    async def _record_failure(
        self,
        ctx: ActorContext[ConversationState],
        command: RunTurn,
        exc: BaseException,
        duration_ms: int,
    ) -> str | None:
        """Records the turn as failed; the record's cursor, also set on `exc` if it is an
        SvcError (None when the record could not be made)."""
        code, message, retryable = _failure_facts(exc)
        # An upstream's message may hold what the log cannot (NUL, a lone surrogate): it must
        # not cost the record of the failure itself.
        code, message = _recordable(code), _recordable(message)
        fail = FailTurn(
            command_id=service_command_id("fail", command.command_id),
            workspace_id=command.workspace_id,
            turn_id=command.turn_id,
            error_code=code[:100],
            error_message=message[:2000],
            duration_ms=duration_ms,
            retryable=retryable,
            at=self._clock(),
        )
        try:
            recorded = await ctx.execute(fail)
        except Exception:
            if _answer_recorded(ctx.state, command.turn_id):
                if isinstance(exc, asyncio.CancelledError):
                    # A stop cut the turn short after its answer committed (in the append
                    # that went on without its caller, or in the snapshot after it): the
                    # answer stands, and the same Idempotency-Key returns it.
                    log.warning(
                        "turn %s was interrupted after its answer was recorded", command.turn_id
                    )
                    ctx.interruption = CommandInterrupted(ANSWER_RECORDED_MESSAGE)
                return None  # else the caller answers with it
            ended = _ended_elsewhere(ctx.state, command.turn_id)
            if ended is not None:
                log.warning(
                    "turn %s was recorded as failed (%s) by another process while this one "
                    "ran it; its outcome here is not recorded",
                    command.turn_id,
                    ended.error_code,
                )
                return None
            # The original error matters more to the caller; the turn stays "running" in the
            # log until the next command of this conversation records it as abandoned.
            log.exception("could not record the failure of turn %s", command.turn_id)
            return None
        if isinstance(exc, SvcError) and recorded.cursor:
            exc.recorded_cursor = recorded.cursor
        return recorded.cursor or None


def _turn_result(
    ctx: ActorContext[ConversationState],
    command: RunTurn,
    complete: CompleteTurn,
    finished: Finished,
    outcome: CommandOutcome,
) -> TurnResult:
    return TurnResult(
        conversation_id=ctx.key.id,
        turn_id=command.turn_id,
        message_id=complete.message_id,
        model=command.model,
        content=complete.content,
        finish_reason=complete.finish_reason,
        usage=finished.usage,
        duration_ms=complete.duration_ms,
        cursor=outcome.cursor,
        duplicate=outcome.duplicate,
    )


ANSWER_RECORDED_MESSAGE = (
    "the service stopped as this chat turn's answer was being recorded; the answer is "
    "recorded in the conversation: a request sent with an Idempotency-Key gets it by being "
    "sent again with the same key (to another instance, or after the restart); without one, "
    "read it from the conversation rather than sending the request again"
)


def _answer_recorded(state: ConversationState, turn_id: str) -> bool:
    turn = state.turns.get(turn_id)
    return turn is not None and turn.status == "completed"


def _ended_elsewhere(state: ConversationState, turn_id: str) -> TurnRecord | None:
    """The turn, failed in the log, once this process could record none of its outcome:
    another process recorded its end while this one still ran it (an operator's `svc
    conversations abandon`, or a recovery that took its expiry for a process gone)."""
    turn = state.turns.get(turn_id)
    return turn if turn is not None and turn.status == "failed" else None


def _outcome_not_recorded(turn: TurnRecord) -> RecordedTurnFailure:
    return RecordedTurnFailure(
        f"turn {turn.turn_id} was recorded as failed ({turn.error_code}) while this process "
        "still ran it, by `svc conversations abandon` or by a recovery that took it for "
        "abandoned; what the model answered is not recorded: send the request again with a "
        "new Idempotency-Key",
        code=turn.error_code,
    )


def _overlong(model: str) -> UpstreamError:
    return UpstreamError(
        f"model {model!r} answered more than {MAX_CONTENT:,} characters, more than a message "
        "holds; lower max_tokens",
        code="upstream_bad_response",
    )


def _request(command: RunTurn, streaming: bool, budget_s: float | None) -> ModelRequest:
    params = command.params
    return ModelRequest(
        model=command.model,
        messages=tuple(ChatMessage(m.role, m.content, m.name) for m in command.messages),
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        max_tokens_as=params.max_tokens_as or "max_tokens",
        stop=params.stop,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        reasoning_effort=params.reasoning_effort,
        verbosity=params.verbosity,
        stream=streaming,
        call_timeout_s=budget_s,
        traceparent=command.traceparent,
    )


def _elapsed_ms(began: float) -> int:
    return min(max(0, round((time.monotonic() - began) * 1000)), MAX_DURATION_MS)
