"""Builders of real domain events for the projection tests, appended through the real store."""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from eventstore import NewEvent, PostgresEventStore
from eventstore.records import AppendResult
from schemas.conversation import (
    AssistantMessageCompleted,
    ConversationDeleted,
    ConversationMovedToFolder,
    ConversationRenamed,
    ConversationStarted,
    ConversationTagged,
    TurnFailed,
    TurnParams,
    TurnStarted,
    UserMessageReceived,
)
from schemas.events import EVENTS, Event
from schemas.workspace import ApiKeyIssued, ApiKeyRevoked, WorkspaceCreated

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def new_event(ev: Event) -> NewEvent:
    type_name, version, data = EVENTS.encode(ev)
    return NewEvent(type=type_name, data=data, schema_version=version)


async def append(
    store: PostgresEventStore, ws: str, stream: str, *events: Event | NewEvent
) -> AppendResult:
    batch = [e if isinstance(e, NewEvent) else new_event(e) for e in events]
    return await store.append(
        stream, batch, expected_version=None, command_id=uuid.uuid4().hex, workspace_id=ws
    )


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def workspace_created(ws: str, name: str, minute: float = 0) -> WorkspaceCreated:
    return WorkspaceCreated(workspace_id=ws, name=name, at=at(minute))


def key_issued(ws: str, key_id: str, key: str, minute: float = 0, **kw: Any) -> ApiKeyIssued:
    fields: dict[str, Any] = {
        "workspace_id": ws,
        "key_id": key_id,
        "name": f"key {key_id}",
        "key_hash": key_hash(key),
        "prefix": key[:8],
        "scopes": ("admin:read",),
        "rate_limit_rpm": None,
        "expires_at": None,
        "at": at(minute),
    }
    fields.update(kw)
    return ApiKeyIssued(**fields)


def key_revoked(ws: str, key_id: str, minute: float = 0) -> ApiKeyRevoked:
    return ApiKeyRevoked(workspace_id=ws, key_id=key_id, at=at(minute))


def started(ws: str, cid: str, minute: float = 0, **kw: Any) -> ConversationStarted:
    fields: dict[str, Any] = {
        "conversation_id": cid,
        "workspace_id": ws,
        "title": f"title {cid}",
        "project_id": None,
        "folder": None,
        "tags": (),
        "agent": None,
        "model": "offline",
        "at": at(minute),
    }
    fields.update(kw)
    return ConversationStarted(**fields)


def user_message(
    cid: str, mid: str, text: str, minute: float = 0, turn_id: str | None = None
) -> UserMessageReceived:
    return UserMessageReceived(
        conversation_id=cid, message_id=mid, content=text, name=None, turn_id=turn_id, at=at(minute)
    )


def turn_started(cid: str, turn_id: str, minute: float = 0) -> TurnStarted:
    return TurnStarted(
        conversation_id=cid,
        turn_id=turn_id,
        command_id="cmd-" + turn_id,
        model="offline",
        params=TurnParams(),
        request_messages=1,
        at=at(minute),
    )


def assistant_message(
    cid: str, turn_id: str, mid: str, text: str, minute: float = 0, tokens: tuple[int, int] = (3, 4)
) -> AssistantMessageCompleted:
    return AssistantMessageCompleted(
        conversation_id=cid,
        turn_id=turn_id,
        message_id=mid,
        content=text,
        finish_reason="stop",
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        total_tokens=sum(tokens),
        duration_ms=100,
        at=at(minute),
    )


def turn_failed(cid: str, turn_id: str, minute: float = 0) -> TurnFailed:
    return TurnFailed(
        conversation_id=cid,
        turn_id=turn_id,
        error_code="ErrCallTimeout",
        error_message="model call timed out",
        duration_ms=120_000,
        retryable=True,
        at=at(minute),
    )


def renamed(cid: str, title: str, minute: float = 0) -> ConversationRenamed:
    return ConversationRenamed(conversation_id=cid, title=title, at=at(minute))


def tagged(cid: str, tags: tuple[str, ...], minute: float = 0) -> ConversationTagged:
    return ConversationTagged(conversation_id=cid, tags=tags, at=at(minute))


def moved(cid: str, folder: str | None, minute: float = 0) -> ConversationMovedToFolder:
    return ConversationMovedToFolder(conversation_id=cid, folder=folder, at=at(minute))


def deleted(cid: str, minute: float = 0) -> ConversationDeleted:
    return ConversationDeleted(conversation_id=cid, at=at(minute))


async def chat(
    store: PostgresEventStore, ws: str, cid: str, turns: int, *, first_minute: float = 0
) -> None:
    """A conversation with `turns` completed turns: 2 * turns messages, in one append each."""
    stream = f"conversation:{cid}"
    await append(store, ws, stream, started(ws, cid, first_minute))
    for i in range(turns):
        minute = first_minute + i + 1
        tid = f"{cid}-t{i}"
        await append(
            store,
            ws,
            stream,
            user_message(cid, f"{cid}-u{i}", f"question {i}", minute, tid),
            turn_started(cid, tid, minute),
        )
        await append(
            store, ws, stream, assistant_message(cid, tid, f"{cid}-a{i}", f"answer {i}", minute)
        )
