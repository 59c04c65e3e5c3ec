"""Read model `conversations`: one row per conversation with its metadata and message count."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, NamedTuple

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.pipeline import fold
from projections.projector import Handler, Projector
from schemas.conversation import (
    AssistantMessageCompleted,
    ConversationDeleted,
    ConversationMovedToFolder,
    ConversationRenamed,
    ConversationStarted,
    ConversationTagged,
    ToolOutputReceived,
    TurnFailed,
    UserMessageReceived,
)
from schemas.events import Event

# One statement for a conversation's start and its messages, the events of every chat turn,
# so that a batch's conversation rows reach the server as one run (pipeline.Pipeline) however
# the turns of different conversations interleave; and folded per conversation
# (`pipeline.fold`), so a conversation started and given its first message in one batch is
# one insert, and one that gets several messages in a batch one update. $10 says which half
# applies: a start inserts the row with the count and latest time of the messages folded into
# it (a second start of one conversation, which the actor never records, changes only the
# count and `updated_at`); a message adds $11 (1) to the count and moves `updated_at` to $12;
# a failed turn (its model call refused, timed out, or the turn recorded as abandoned) adds
# 0, moving only `updated_at`, as the actor's state does. A started turn needs no statement
# of its own: it is recorded with its input, at the same time; one with no input (a client
# asking the model to go on) moves `updated_at` when it ends.
_STARTED_OR_MESSAGE = """
WITH started AS (
    INSERT INTO conversations (workspace_id, id, title, project_id, folder, tags, agent, model,
                               message_count, created_at, updated_at)
    SELECT $1, $2, $4, $5, $6, $7, $8, $9, $11, $3::timestamptz, greatest($3::timestamptz, $12)
    WHERE $10
    ON CONFLICT (workspace_id, id) DO UPDATE
    SET message_count = conversations.message_count + EXCLUDED.message_count,
        updated_at = greatest(conversations.updated_at, EXCLUDED.updated_at)
)
UPDATE conversations SET message_count = message_count + $11,
                         updated_at = greatest(updated_at, $12)
WHERE workspace_id = $1 AND id = $2 AND NOT $10
"""


class _Row(NamedTuple):
    """The arguments of `_STARTED_OR_MESSAGE`, in order."""

    workspace_id: str
    conversation_id: str
    created_at: datetime
    title: str | None
    project_id: str | None
    folder: str | None
    tags: list[str]
    agent: str | None
    model: str | None
    started: bool
    messages: int
    latest_at: datetime


def _merge(earlier: tuple[Any, ...], later: tuple[Any, ...]) -> tuple[Any, ...]:
    """One conversation's two consecutive writes as one: the first start's fields, the
    messages of both, the later time. A message before the start of a conversation that has
    no row yet would be counted here and lost one by one; the actor records a start before
    anything else in its stream, so that order never reaches a batch."""
    first, second = _Row(*earlier), _Row(*later)
    base = first if first.started or not second.started else second
    return base._replace(
        messages=first.messages + second.messages,
        latest_at=max(first.latest_at, second.latest_at),
    )


async def _write(conn: Connection, row: _Row) -> None:
    key = (row.workspace_id, row.conversation_id)
    await fold(conn, _STARTED_OR_MESSAGE, key, row, _merge)


_TOUCH = """
UPDATE conversations SET {set}, updated_at = greatest(updated_at, $3)
WHERE workspace_id = $1 AND id = $2
"""


class ConversationsProjector(Projector):
    name: ClassVar[str] = "conversations"
    tables: ClassVar[tuple[str, ...]] = ("conversations",)

    def handlers(self) -> dict[type[Event], Handler]:
        return {
            ConversationStarted: self._started,
            UserMessageReceived: self._message,
            ToolOutputReceived: self._message,
            AssistantMessageCompleted: self._message,
            ConversationRenamed: self._renamed,
            ConversationTagged: self._tagged,
            ConversationMovedToFolder: self._moved,
            ConversationDeleted: self._deleted,
            TurnFailed: self._failed,
        }

    async def _started(self, conn: Connection, rec: RecordedEvent, ev: ConversationStarted) -> None:
        row = _Row(
            rec.workspace_id,
            ev.conversation_id,
            ev.at,
            ev.title,
            ev.project_id,
            ev.folder,
            list(ev.tags),
            ev.agent,
            ev.model,
            True,
            0,
            ev.at,
        )
        await _write(conn, row)

    async def _message(
        self,
        conn: Connection,
        rec: RecordedEvent,
        ev: UserMessageReceived | ToolOutputReceived | AssistantMessageCompleted,
    ) -> None:
        # Not idempotent on purpose: the count is right only because the runner applies each
        # event exactly once (checkpoint compare-and-set in the same transaction).
        await self._bump(conn, rec, ev.conversation_id, ev.at, 1)

    async def _failed(self, conn: Connection, rec: RecordedEvent, ev: TurnFailed) -> None:
        await self._bump(conn, rec, ev.conversation_id, ev.at, 0)

    @staticmethod
    async def _bump(
        conn: Connection, rec: RecordedEvent, conversation_id: str, at: datetime, messages: int
    ) -> None:
        row = _Row(
            rec.workspace_id,
            conversation_id,
            at,
            None,
            None,
            None,
            [],
            None,
            None,
            False,
            messages,
            at,
        )
        await _write(conn, row)

    async def _renamed(self, conn: Connection, rec: RecordedEvent, ev: ConversationRenamed) -> None:
        await conn.execute(
            _TOUCH.format(set="title = $4"), rec.workspace_id, ev.conversation_id, ev.at, ev.title
        )

    async def _tagged(self, conn: Connection, rec: RecordedEvent, ev: ConversationTagged) -> None:
        await conn.execute(
            _TOUCH.format(set="tags = $4"),
            rec.workspace_id,
            ev.conversation_id,
            ev.at,
            list(ev.tags),
        )

    async def _moved(
        self, conn: Connection, rec: RecordedEvent, ev: ConversationMovedToFolder
    ) -> None:
        await conn.execute(
            _TOUCH.format(set="folder = $4"), rec.workspace_id, ev.conversation_id, ev.at, ev.folder
        )

    async def _deleted(self, conn: Connection, rec: RecordedEvent, ev: ConversationDeleted) -> None:
        await conn.execute(
            _TOUCH.format(set="deleted = true"), rec.workspace_id, ev.conversation_id, ev.at
        )
