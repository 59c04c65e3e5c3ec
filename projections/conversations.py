"""Read model `conversations`: one row per conversation with its metadata and message count."""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.conversation import (
    AssistantMessageCompleted,
    ConversationDeleted,
    ConversationMovedToFolder,
    ConversationRenamed,
    ConversationStarted,
    ConversationTagged,
    TurnFailed,
    UserMessageReceived,
)
from schemas.events import Event

# One statement for a conversation's start and its messages, the events of every chat turn,
# so that a batch's conversation rows reach the server as one run (pipeline.Pipeline) however
# the turns of different conversations interleave. $10 says which half applies: a start
# inserts the row (and the update, gated off, touches nothing); a message bumps the count by
# $11 (1); a failed turn (its model call refused, timed out, or the turn recorded as abandoned)
# bumps it by 0, moving only `updated_at`, as the actor's state does. A started turn needs no
# statement of its own: it is recorded with its user message, at the same time.
_STARTED_OR_MESSAGE = """
WITH started AS (
    INSERT INTO conversations (workspace_id, id, title, project_id, folder, tags, agent, model,
                               created_at, updated_at)
    SELECT $1, $2, $4, $5, $6, $7, $8, $9, $3, $3 WHERE $10
    ON CONFLICT (workspace_id, id) DO NOTHING
)
UPDATE conversations SET message_count = message_count + $11,
                         updated_at = greatest(updated_at, $3)
WHERE workspace_id = $1 AND id = $2 AND NOT $10
"""

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
            AssistantMessageCompleted: self._message,
            ConversationRenamed: self._renamed,
            ConversationTagged: self._tagged,
            ConversationMovedToFolder: self._moved,
            ConversationDeleted: self._deleted,
            TurnFailed: self._failed,
        }

    async def _started(self, conn: Connection, rec: RecordedEvent, ev: ConversationStarted) -> None:
        await conn.execute(
            _STARTED_OR_MESSAGE,
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
        )

    async def _message(
        self,
        conn: Connection,
        rec: RecordedEvent,
        ev: UserMessageReceived | AssistantMessageCompleted,
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
        await conn.execute(
            _STARTED_OR_MESSAGE,
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
        )

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
