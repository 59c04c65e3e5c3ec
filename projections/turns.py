"""Read model `turns`: one row per model turn with its status, usage and duration.

Status values: `running` (TurnStarted recorded, no outcome yet), `completed` (the assistant
message was recorded) and `failed` (TurnFailed recorded; error_code and error_message set).
`expires_at` is the turn's recorded expiry: 'infinity' when it never expires, NULL when its
TurnStarted predates expiries (migrations/0150 and 0151).
"""

from __future__ import annotations

from typing import ClassVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.conversation import AssistantMessageCompleted, TurnFailed, TurnStarted
from schemas.events import Event

TURN_STATUSES = ("running", "completed", "failed")


# One statement for the three events, so that a batch's turn rows reach the server in one
# round trip (pipeline.Pipeline). Each event fills its own columns and keeps the others; an
# outcome may arrive without a TurnStarted (a turn can fail before it starts).
_UPSERT = """
INSERT INTO turns (workspace_id, turn_id, conversation_id, status, model, prompt_tokens,
                   completion_tokens, total_tokens, duration_ms, error_code, error_message,
                   started_at, finished_at, command_id, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14,
        CASE WHEN $16 THEN 'infinity'::timestamptz ELSE $15 END)
ON CONFLICT (workspace_id, turn_id) DO UPDATE SET
    status = CASE WHEN EXCLUDED.status = 'running' THEN turns.status ELSE EXCLUDED.status END,
    model = coalesce(EXCLUDED.model, turns.model),
    prompt_tokens = coalesce(EXCLUDED.prompt_tokens, turns.prompt_tokens),
    completion_tokens = coalesce(EXCLUDED.completion_tokens, turns.completion_tokens),
    total_tokens = coalesce(EXCLUDED.total_tokens, turns.total_tokens),
    duration_ms = coalesce(EXCLUDED.duration_ms, turns.duration_ms),
    error_code = coalesce(EXCLUDED.error_code, turns.error_code),
    error_message = coalesce(EXCLUDED.error_message, turns.error_message),
    started_at = coalesce(EXCLUDED.started_at, turns.started_at),
    finished_at = coalesce(EXCLUDED.finished_at, turns.finished_at),
    command_id = coalesce(EXCLUDED.command_id, turns.command_id),
    expires_at = coalesce(EXCLUDED.expires_at, turns.expires_at)
"""


class TurnsProjector(Projector):
    name: ClassVar[str] = "turns"
    tables: ClassVar[tuple[str, ...]] = ("turns",)

    def handlers(self) -> dict[type[Event], Handler]:
        return {
            TurnStarted: self._started,
            AssistantMessageCompleted: self._completed,
            TurnFailed: self._failed,
        }

    async def _started(self, conn: Connection, rec: RecordedEvent, ev: TurnStarted) -> None:
        await conn.execute(
            _UPSERT,
            rec.workspace_id,
            ev.turn_id,
            ev.conversation_id,
            "running",
            ev.model,
            None,
            None,
            None,
            None,
            None,
            None,
            ev.at,
            None,
            ev.command_id,
            ev.expires_at,
            ev.never_expires,
        )

    async def _completed(
        self, conn: Connection, rec: RecordedEvent, ev: AssistantMessageCompleted
    ) -> None:
        await conn.execute(
            _UPSERT,
            rec.workspace_id,
            ev.turn_id,
            ev.conversation_id,
            "completed",
            None,
            ev.prompt_tokens,
            ev.completion_tokens,
            ev.total_tokens,
            ev.duration_ms,
            None,
            None,
            None,
            ev.at,
            None,
            None,
            False,
        )

    async def _failed(self, conn: Connection, rec: RecordedEvent, ev: TurnFailed) -> None:
        await conn.execute(
            _UPSERT,
            rec.workspace_id,
            ev.turn_id,
            ev.conversation_id,
            "failed",
            None,
            None,
            None,
            None,
            ev.duration_ms,
            ev.error_code,
            ev.error_message,
            None,
            ev.at,
            None,
            None,
            False,
        )
