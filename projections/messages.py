"""Read model `messages`: every user message, tool output and assistant message, numbered
densely per conversation."""

from __future__ import annotations

from typing import ClassVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.conversation import (
    AssistantMessageCompleted,
    ToolOutputReceived,
    UserMessageReceived,
)
from schemas.events import Event

_INSERT = """
INSERT INTO messages (workspace_id, conversation_id, seq, message_id, role, content, name,
                      turn_id, created_at)
SELECT $1, $2, coalesce(max(seq), 0) + 1, $3, $4, $5, $6, $7, $8
FROM messages WHERE workspace_id = $1 AND conversation_id = $2
"""


class MessagesProjector(Projector):
    name: ClassVar[str] = "messages"
    tables: ClassVar[tuple[str, ...]] = ("messages",)

    def handlers(self) -> dict[type[Event], Handler]:
        return {
            UserMessageReceived: self._said,
            ToolOutputReceived: self._said,
            AssistantMessageCompleted: self._assistant,
        }

    # seq = max + 1 is safe without a lock: one runner transaction at a time holds this
    # projector's checkpoint row (see runner.py), so no two writers number the same
    # conversation concurrently.
    async def _said(
        self, conn: Connection, rec: RecordedEvent, ev: UserMessageReceived | ToolOutputReceived
    ) -> None:
        await conn.execute(
            _INSERT,
            rec.workspace_id,
            ev.conversation_id,
            ev.message_id,
            ev.role,
            ev.content,
            ev.name,
            ev.turn_id,
            ev.at,
        )

    async def _assistant(
        self, conn: Connection, rec: RecordedEvent, ev: AssistantMessageCompleted
    ) -> None:
        await conn.execute(
            _INSERT,
            rec.workspace_id,
            ev.conversation_id,
            ev.message_id,
            "assistant",
            ev.content,
            None,
            ev.turn_id,
            ev.at,
        )
